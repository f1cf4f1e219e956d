"""Linen and NNX modules as encoders, with dropout replayed exactly."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from reference import full_batch_value_and_grad

import gc_jax
from gc_jax.losses import contrastive_loss


def loss(params, q, d):
    return contrastive_loss(q, d, temperature=0.5)


def inputs(rows=10, k=2):
    kq, kd = jax.random.split(jax.random.key(7))
    return jax.random.normal(kq, (rows, 6)), jax.random.normal(kd, (rows * k, 6))


class LinenTower(nn.Module):
    @nn.compact
    def __call__(self, tokens, mask):
        h = nn.Dense(16)(tokens * mask[:, None])
        h = nn.Dropout(0.3, deterministic=False)(nn.gelu(h))
        return {"pooled": nn.Dense(8)(h), "hidden": h}


class NNXTower(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(6, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.dense2 = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.dropout(nnx.gelu(self.dense1(x))))


def as_dict(x):
    return {"tokens": x, "mask": (jnp.arange(x.shape[0]) % 4 != 0).astype(x.dtype)}


def compare(encode, params, chunk_size, q, d, rng):
    got = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size))(params, q, d, rng=rng)
    want = full_batch_value_and_grad(loss, encode, chunk_size, params, q, d, rng=rng)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
    return got


@pytest.mark.parametrize("chunk_size", [3, 10])
def test_linen_module_with_dict_inputs_and_dropout(chunk_size):
    model = LinenTower()
    q, d = inputs()
    params = model.init(jax.random.key(0), **as_dict(q))["params"]
    encode = gc_jax.linen_encoder(model, get_rep=lambda out: out["pooled"])
    with_dropout, _ = compare(encode, params, chunk_size, as_dict(q), as_dict(d), jax.random.key(1))
    other_key, _ = compare(encode, params, chunk_size, as_dict(q), as_dict(d), jax.random.key(2))
    assert not jnp.allclose(with_dropout, other_key)


@pytest.mark.parametrize("chunk_size", [4, 10])
def test_nnx_module_with_dropout(chunk_size):
    model = NNXTower(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    q, d = inputs()
    encode = gc_jax.nnx_encoder(model)
    _, grads = compare(encode, params, chunk_size, q, d, jax.random.key(3))
    assert isinstance(grads, nnx.State)
    # Without a key the module runs deterministically (no dropout).
    eval_loss, _ = compare(encode, params, chunk_size, q, d, None)
    plain = nnx.view(model, deterministic=True)
    chex.assert_trees_all_close(eval_loss, loss(None, plain(q), plain(d)), rtol=1e-5)


def test_nnx_grads_update_the_model_with_an_optimizer():
    model = NNXTower(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss, gc_jax.nnx_encoder(model), 4))
    _, grads = grad_fn(nnx.state(model, nnx.Param), *inputs(), rng=jax.random.key(0))
    optimizer.update(model, grads)
    after = nnx.state(model, nnx.Param)
    moved = jax.tree.map(
        lambda a, b, g: jnp.allclose(a - 0.1 * g, b, atol=1e-6), before, after, grads
    )
    assert all(jax.tree.leaves(moved))


def test_chunks_are_passed_like_the_pytorch_gradcache():
    from gc_jax._flax import call_with_chunk

    def fn(*args, **kwargs):
        return args, kwargs

    x = jnp.ones(2)
    assert call_with_chunk(fn, x) == ((x,), {})
    assert call_with_chunk(fn, [x, x]) == ((x, x), {})
    assert call_with_chunk(fn, {"a": x}) == ((), {"a": x})
    assert call_with_chunk(fn, ([x], {"a": x})) == ((x,), {"a": x})
