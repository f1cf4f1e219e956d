"""Rows without tokens pool to zeros with finite gradients, so a step with empty rows trains.

``pooling.l2_normalize`` is ``x / max(||x||, eps)`` as torch's ``F.normalize``, its
gradient finite at a zero row; every form is exact against ``jax.value_and_grad`` of
the full batch under ``jit``, with row-count chunks and with a ``TokenBudget`` whose
rows include zero-length ones.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gc_jax
from gc_jax import packing, pooling
from gc_jax.losses import contrastive_loss

ROWS, TOKENS, VOCAB, WIDTH = 8, 8, 32, 6
LENGTHS = [8, 0, 3, 5, 0, 1, 8, 2]  # two empty rows
TOL = {"rtol": 1e-5, "atol": 1e-6}


def params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"table": jax.random.normal(k1, (VOCAB, WIDTH)),
            "head": jax.random.normal(k2, (WIDTH, 4)) / 3}  # fmt: skip


def tokens(seed):
    ids = jax.random.randint(jax.random.key(seed), (ROWS, TOKENS), 1, VOCAB)
    mask = (np.arange(TOKENS)[None] < np.array(LENGTHS)[:, None]).astype(np.int32)
    return {"input_ids": ids * mask, "attention_mask": jnp.asarray(mask)}


def encode(p, batch, key):
    hidden = p["table"][batch["input_ids"]]
    return pooling.embed(hidden, batch["attention_mask"], head=p["head"])


def loss_fn(p, q, d):
    return contrastive_loss(q, d, temperature=0.1)


def full_batch(p, q, d):
    return jax.value_and_grad(lambda p: loss_fn(p, encode(p, q, None), encode(p, d, None)))(p)


def test_l2_normalize_of_a_zero_row_has_torchs_gradient():
    """Below ``eps`` the norm is clamped, so the derivative is ``1/eps`` (torch's)."""
    v = jnp.array([[1.0, -2.0, 0.5]])
    grad = jax.grad(lambda x: jnp.vdot(pooling.l2_normalize(x, eps=1e-3), v))(jnp.zeros((1, 3)))
    chex.assert_trees_all_close(grad, v / 1e-3, rtol=1e-6)
    x = jnp.array([[3.0, 4.0], [0.0, 0.0]])
    chex.assert_trees_all_close(pooling.l2_normalize(x), jnp.array([[0.6, 0.8], [0.0, 0.0]]))
    jac = jax.jacfwd(pooling.l2_normalize)(jnp.array([3.0, 4.0]))
    want = (jnp.eye(2) - jnp.outer(jnp.array([0.6, 0.8]), jnp.array([0.6, 0.8]))) / 5
    chex.assert_trees_all_close(jac, want, rtol=1e-6)


def test_every_pooling_of_an_empty_row_has_finite_gradients():
    hidden = jax.random.normal(jax.random.key(1), (2, 4, 3))
    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0]])
    for how in ("mean", "first", "last"):
        grad = jax.grad(lambda h, how=how: pooling.embed(h, mask, how=how).sum())(hidden)
        assert bool(jnp.all(jnp.isfinite(grad))), how
    pooled = lambda h: pooling.l2_normalize(packing.mean_pool(h, {"attention_mask": mask}))
    assert bool(jnp.all(jnp.isfinite(jax.grad(lambda h: pooled(h).sum())(hidden))))


@pytest.mark.parametrize("chunk", [3, gc_jax.TokenBudget(tokens=16, buckets=(2, 4, 8))],
                         ids=["rows", "token_budget"])  # fmt: skip
def test_cached_value_and_grad_with_empty_rows_is_exact_and_finite(chunk):
    p, q, d = params(), tokens(1), tokens(2)
    want = jax.jit(full_batch)(p, q, d)
    got = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, chunk))(p, q, d)
    chex.assert_trees_all_close(got, want, **TOL)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))


@pytest.mark.parametrize("chunk", [3, gc_jax.TokenBudget(tokens=16, buckets=(2, 4, 8))],
                         ids=["rows", "token_budget"])  # fmt: skip
def test_make_train_step_with_empty_rows_applies_the_update(chunk):
    p, q, d = params(), tokens(1), tokens(2)
    loss, grads = jax.jit(full_batch)(p, q, d)
    step = jax.jit(gc_jax.make_train_step(loss_fn, encode, chunk, optimizer=optax.sgd(0.5)))
    (new, _), metrics = step((p, optax.sgd(0.5).init(p)), q, d)
    assert bool(metrics["is_finite"])
    want = jax.tree.map(lambda w, g: w - 0.5 * g, p, grads)
    chex.assert_trees_all_close(new, want, **TOL)
    chex.assert_trees_all_close(metrics["loss"], loss, **TOL)
