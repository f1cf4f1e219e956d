"""Second order through a ``TokenBudget`` or ``TokenPacking``: refused by name (issue 34).

A token chunk size cuts the batch into as many chunks as the data says, a loop JAX
cannot differentiate in reverse mode: a gradient of the gradients, or a gradient of a
step's loss, raises naming the chunk size and the integer ``chunk_size`` that can;
forward mode over it still works.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import gc_jax
from gc_jax import packing

TOL = {"rtol": 2e-5, "atol": 2e-6}


def loss_fn(params, q, d):
    return gc_jax.losses.contrastive_loss(q, d, temperature=0.5)


def texts(seed: int, rows: int = 8, padded: int = 16) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    lengths = jax.random.randint(k1, (rows, 1), 2, padded + 1)
    mask = (jnp.arange(padded) < lengths).astype(jnp.int32)
    ids = jax.random.randint(k2, (rows, padded), 1, 50) * mask
    return {"input_ids": ids, "attention_mask": mask}


def mean_encode(params, batch, key):  # per row: works with a TokenBudget
    mask = batch["attention_mask"][..., None]
    h = jnp.tanh(params["embed"][batch["input_ids"]] @ params["w"])
    return (h * mask).sum(1) / mask.sum(1)


def packed_encode(params, batch, key):  # reads the packing keys: works with a TokenPacking
    return packing.mean_pool(jnp.tanh(params["embed"][batch["input_ids"]] @ params["w"]), batch)


PARAMS = {"embed": jax.random.normal(jax.random.key(0), (50, 4)), "w": jnp.eye(4) / 2}
BY_TOKENS = {
    "budget": (mean_encode, gc_jax.TokenBudget(tokens=32, buckets=(8, 16))),
    "packing": (packed_encode, gc_jax.TokenPacking(tokens=32, segments=4)),
}


def grads_sum(grad_fn):
    """A scalar of the gradients: what a gradient of a gradient differentiates."""
    return lambda p: sum(jnp.sum(g) for g in jax.tree.leaves(grad_fn(p)[1]))


@pytest.mark.parametrize("kind", ["budget", "packing"])
def test_second_order_through_tokens_names_the_chunk_size(kind):
    encode, chunk_size = BY_TOKENS[kind]
    q, d = texts(1), texts(2)
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, encode, chunk_size)
    name = type(chunk_size).__name__
    match = rf"inputs\[0\] was differentiated twice.*{name}.*integer chunk_size"
    with pytest.raises(ValueError, match=match):  # a gradient of the gradients
        jax.jit(jax.grad(grads_sum(lambda p: grad_fn(p, q, d))))(PARAMS)
    with pytest.raises(ValueError, match=match):  # a gradient of the loss, outside jit
        jax.grad(lambda p: jax.jit(grad_fn)(p, q, d)[0])(PARAMS)


def test_a_meta_gradient_through_make_train_step_names_the_budget():
    encode, budget = BY_TOKENS["budget"]
    q, d = texts(1), texts(2)
    tx = optax.sgd(0.1)
    step = gc_jax.make_train_step(loss_fn, encode, budget, optimizer=tx)
    after = lambda p: step((p, tx.init(p)), q, d)[0][0]["w"].sum()
    with pytest.raises(ValueError, match=r"differentiated twice.*TokenBudget"):
        jax.jit(jax.grad(after))(PARAMS)


def test_forward_mode_over_a_budget_still_works():
    """Only reverse mode is refused: jax.jacfwd of the gradient is the integer chunk's."""
    encode, budget = BY_TOKENS["budget"]
    q, d = texts(1), texts(2)
    of = lambda size: jax.jit(
        jax.jacfwd(lambda w: gc_jax.cached_value_and_grad(loss_fn, encode, size)(
            {**PARAMS, "w": w}, q, d)[1]["w"])
    )(PARAMS["w"])  # fmt: skip
    chex.assert_trees_all_close(of(budget), of(3), **TOL)


def test_chunked_encoder_names_a_packing_too():
    encode, packed = BY_TOKENS["packing"]
    q = texts(1)
    enc = gc_jax.chunked_encoder(encode, packed)
    inner = jax.grad(lambda p: enc(p, q).sum())
    with pytest.raises(ValueError, match=r"chunked_encoder.*twice.*TokenPacking.*integer"):
        jax.jit(jax.grad(lambda p: inner(p)["w"].sum()))(PARAMS)
