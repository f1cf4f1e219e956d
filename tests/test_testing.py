"""``gc_jax.testing.assert_matches_full_batch``: it never says yes to rows that mix.

With ``rng`` its full-batch reference is encoded in gc_jax's own chunks (to draw the
same dropout masks), so it cannot see an encoder whose rows depend on each other;
the checker also replaces rows by their neighbours in the same chunks, with the same
keys, and asserts that no other row's output moves (issue 34, item 2).
"""

from __future__ import annotations

import itertools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gc_jax
from gc_jax import testing

ROWS, WIDTH = 8, 3
KEYS = [None, 1]  # no key, then jax.random.key(1)


def key_of(rng):
    return None if rng is None else jax.random.key(rng)


def loss(w, q, d):
    return gc_jax.losses.contrastive_loss(q, d)


def data():
    x = jax.random.normal(jax.random.key(0), (ROWS, WIDTH))
    return jnp.eye(WIDTH), x, jnp.flip(x, axis=0)


def encode(w, x, key):
    return jnp.tanh(x @ w)


def dropout(w, x, key):
    h = jnp.tanh(x @ w)
    return h if key is None else h * jax.random.bernoulli(key, 0.7, h.shape) / 0.7


def batch_norm(w, x, key):  # the docstring's example
    return encode(w, x, key) - encode(w, x, key).mean(0)


def batch_norm_dropout(w, x, key):
    h = dropout(w, x, key)
    return (h - h.mean(0)) / (h.std(0) + 1e-3)


def next_row(w, x, key):  # row r reads row r + 1 of its chunk: one neighbour only
    h = dropout(w, x, key)
    return h + 0.5 * jnp.roll(h, -1, axis=0)


@pytest.mark.parametrize("rng", KEYS)
@pytest.mark.parametrize("chunk_size", [2, 3])
@pytest.mark.parametrize("bad", [batch_norm, batch_norm_dropout, next_row])
def test_rows_that_depend_on_each_other_are_refused_with_a_key_too(bad, chunk_size, rng):
    params, q, d = data()
    mixed = r"Does the model mix rows .* rows depend on each other"
    with pytest.raises(AssertionError, match=mixed):
        testing.assert_matches_full_batch(loss, bad, chunk_size, params, q, d, rng=key_of(rng))


def test_why_the_reference_alone_said_yes():
    """With a key the full-batch reference encodes gc_jax's chunks, so for batch_norm it
    agrees with the cached step (what the checker used to compare), while the batch
    encoded at once differs: only the rows check sees it."""
    params, q, d = data()
    rng = jax.random.key(1)
    cached = jax.jit(gc_jax.cached_value_and_grad(loss, batch_norm, 2))(params, q, d, rng=rng)
    reference = testing.full_batch_value_and_grad(loss, batch_norm, 2)(params, q, d, rng=rng)
    chex.assert_trees_all_close(cached, reference, rtol=1e-5, atol=1e-6)
    whole = jax.value_and_grad(lambda w: loss(w, batch_norm(w, q, None), batch_norm(w, d, None)))
    assert not np.allclose(cached[0], whole(params)[0], rtol=1e-3)


def test_the_message_names_the_rows_and_the_fix():
    params, q, d = data()
    with pytest.raises(AssertionError) as error:
        testing.assert_matches_full_batch(loss, batch_norm, 2, params, q, d, rng=key_of(1))
    message = str(error.value)
    assert message.startswith(
        "gradient caching with chunk_size=2 differs from the full batch. Does the model mix rows"
    )
    assert "encoders[0] does: the outputs of rows 0, 2, 4, 6 of inputs[0]" in message
    assert "LayerNorm" in message and "x - x.mean(0)" in message


def test_one_chunk_for_the_whole_batch_is_still_refused():
    """One chunk holds this small batch, so gradient caching is exact on it; but the rows
    mix, which the real batches, cut into chunks, would not survive."""
    params, q, d = data()
    with pytest.raises(AssertionError, match="rows depend on each other"):
        testing.assert_matches_full_batch(loss, batch_norm, ROWS, params, q, d)


class LinenDropout(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dropout(0.3, deterministic=False)(nn.gelu(nn.Dense(8)(x)))
        return nn.Dense(4)(h)


@pytest.mark.parametrize("rng", KEYS[1:])
@pytest.mark.parametrize("chunk_size", [1, 3, ROWS])
def test_encoders_with_dropout_pass(chunk_size, rng):
    """Row-independent encoders with dropout (a function, a Linen module that raises
    without a key) pass: replaced rows leave the kept rows' masks and outputs as they are."""
    params, q, d = data()
    testing.assert_matches_full_batch(loss, dropout, chunk_size, params, q, d, rng=key_of(rng))
    model = LinenDropout()
    variables = model.init(jax.random.key(2), q)["params"]
    linen = gc_jax.linen_encoder(model)
    testing.assert_matches_full_batch(loss, linen, chunk_size, variables, q, d, rng=key_of(rng))


def test_a_row_independent_encoder_passes_without_a_key():
    params, q, d = data()
    testing.assert_matches_full_batch(loss, encode, 3, params, q, d)
    testing.assert_matches_full_batch(loss, [encode, dropout], [2, 5], params, q, d)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 33])
def test_every_two_rows_are_apart_in_some_trial(rows):
    splits = testing._splits(rows)
    assert len(splits) == 2 * max(rows - 1, 0).bit_length()
    for a, b in itertools.permutations(range(rows), 2):
        assert any(kept[a] and not kept[b] for kept in splits), (a, b)
