"""The toy dual encoder most tests train: small, with dropout, and a learnable temperature."""

import jax
import jax.numpy as jnp

from gc_jax.losses import contrastive_loss

D_IN, D_HID, D_OUT = 6, 16, 8


def init_params(seed=0, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = {
        "w1": jax.random.normal(k1, (D_IN, D_HID)) / 2,
        "w2": jax.random.normal(k2, (D_HID, D_OUT)) / 4,
        "doc": jax.random.normal(k3, (D_IN, D_OUT)) / 2,
        "log_temp": jnp.array(-0.5),
    }
    return jax.tree.map(lambda v: v.astype(dtype), params)


def query_tower(p, x, key):
    """An MLP with dropout when given a key."""
    h = jnp.tanh(x @ p["w1"])
    if key is not None:
        h = h * jax.random.bernoulli(key, 0.8, h.shape) / 0.8
    return h @ p["w2"]


def doc_tower(p, x, key):
    """A one-layer tower (no dropout)."""
    return jnp.tanh(x @ p["doc"])


ENCODERS = (query_tower, doc_tower)


def loss_fn(p, q, d, scale=1.0):
    return contrastive_loss(q, d, temperature=jnp.exp(p["log_temp"]) * scale)


def batch(rows, seed, k=1):
    """Queries and ``k`` documents per query."""
    kq, kd = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kq, (rows, D_IN)), jax.random.normal(kd, (rows * k, D_IN))
