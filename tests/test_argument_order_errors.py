"""Named errors for a pooling head of the wrong width and for arguments given in the wrong order."""

import jax
import jax.numpy as jnp
import optax
import pytest

import gc_jax
from gc_jax import pooling
from gc_jax.losses import contrastive_loss


def encode(p, x, key):
    return jnp.tanh(x @ p)


def loss_fn(p, q, d):
    return contrastive_loss(q, d)


PARAMS, BATCH = jnp.eye(4), jnp.linspace(-1, 1, 32).reshape(8, 4)


@pytest.mark.parametrize(
    "head, match",
    [(jnp.ones((5, 2)), r"hidden's last axis \(4\); got head of shape \(5, 2\): pass a \(4, dim\)"),
     (jnp.ones((2, 4)), r"looks transposed: pass head.T, shape \(4, 2\)"),
     (jnp.ones(4), r"got head of shape \(4,\)")],
)  # fmt: skip
def test_embed_names_a_head_of_the_wrong_width(head, match):
    hidden, mask = jnp.ones((2, 3, 4)), jnp.ones((2, 3))
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda h: pooling.embed(h, mask, head=head))(hidden)


def test_encoder_and_loss_swapped_are_named():
    swapped = r"the loss and the encoder look swapped.*write cached_value_and_grad\(loss_fn, encode"
    with pytest.raises(TypeError, match=swapped):
        jax.jit(gc_jax.cached_value_and_grad(encode, loss_fn, 4))(PARAMS, BATCH, BATCH)
    opt = optax.sgd(0.1)
    step = gc_jax.make_train_step(encode, loss_fn, 4, optimizer=opt)
    with pytest.raises(TypeError, match=swapped):
        jax.jit(step)((PARAMS, opt.init(PARAMS)), BATCH, BATCH)


def test_a_loss_that_returns_rows_is_not_taken_for_a_swap():
    """A loss failing for its own reason keeps its own error."""
    bad_loss = lambda p, q, d: contrastive_loss(q, d[:, :2])
    with pytest.raises(Exception) as info:
        jax.jit(gc_jax.cached_value_and_grad(bad_loss, encode, 4))(PARAMS, BATCH, BATCH)
    assert "look swapped" not in str(info.value)


def test_chunk_size_and_encoder_swapped_are_named():
    with pytest.raises(TypeError, match=r"encoders must be callable, got 4 \(int\), while "
                       r"chunk_size is callable: the two look swapped"):  # fmt: skip
        gc_jax.cached_value_and_grad(loss_fn, 4, encode)
    with pytest.raises(TypeError, match=r"write chunked_encoder\(encode, chunk_size\)"):
        gc_jax.chunked_encoder(4, encode)
