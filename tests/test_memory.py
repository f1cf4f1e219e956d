"""Memory, read deterministically from XLA's compiled memory analysis (no timing)."""

import jax
import jax.numpy as jnp

import gc_jax

WIDTH, DEPTH, DIM_OUT, CHUNK = 256, 8, 64, 128
MIB = 2**20


def deep_mlp(params, x, key):
    for w in params["layers"]:
        x = jnp.tanh(x @ w)
    return x @ params["out"]


def alignment_loss(params, q, d):
    """An O(batch) loss, so only the cache itself may grow with the batch."""
    return -jnp.mean(jnp.sum(q * d, axis=-1))


PARAMS = {
    "layers": [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * DEPTH,
    "out": jax.ShapeDtypeStruct((WIDTH, DIM_OUT), jnp.float32),
}


def temp_bytes(fn, batch):
    x = jax.ShapeDtypeStruct((batch, WIDTH), jnp.float32)
    return jax.jit(fn).lower(PARAMS, x, x).compile().memory_analysis().temp_size_in_bytes


def cached():
    return gc_jax.cached_value_and_grad(alignment_loss, deep_mlp, CHUNK)


def full_batch():
    return jax.value_and_grad(
        lambda p, q, d: alignment_loss(p, deep_mlp(p, q, None), deep_mlp(p, d, None))
    )


def test_temp_memory_grows_only_with_the_cache():
    small, large = 1024, 16384
    growth = temp_bytes(cached(), large) - temp_bytes(cached(), small)
    cache_growth = 2 * (large - small) * DIM_OUT * 4  # two inputs' representations
    # The cache and its gradient: twice the representations, plus a little slack.
    assert growth <= 2 * cache_growth + MIB, (
        f"temp memory grew by {growth / MIB:.1f} MiB from B={small} to B={large}; "
        f"the cache grew by {cache_growth / MIB:.1f} MiB"
    )


def test_far_below_full_batch_for_a_deep_model():
    batch = 16384
    ours, full = temp_bytes(cached(), batch), temp_bytes(full_batch(), batch)
    assert ours * 10 < full, f"gc_jax {ours / MIB:.1f} MiB vs full batch {full / MIB:.1f} MiB"
