"""The checks both token kinds share name the class the user wrote.

A ``TokenBudget`` and a ``TokenPacking`` read row lengths and check their arguments
through one module (``gc_jax._chunks.token_rows``); every misuse is reported as the
kind it was made with: ``TokenPacking(...)`` for a packing, never ``TokenBudget(...)``,
and the other way round. Each test runs on both kinds and checks that the message
names that kind and does not name the other.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np
import pytest

import gc_jax
from gc_jax import packing

PADDED = 16
KINDS = {
    "TokenBudget": lambda tokens=64, **kw: gc_jax.TokenBudget(tokens, (8, PADDED), **kw),
    "TokenPacking": lambda tokens=64, **kw: gc_jax.TokenPacking(tokens, 4, **kw),
}
OTHER = {"TokenBudget": "TokenPacking", "TokenPacking": "TokenBudget"}
BAD_LENGTHS = [  # (lengths, what the message says about them)
    (np.ones((2, 3), np.float32), r"must be integer row lengths .*float32"),
    (np.ones((2, 3, 4), int), r"must be integer row lengths .*shape \(2, 3, 4\)"),
    (np.zeros((0,), int), r"must be integer row lengths .*shape \(0,\)"),
    (np.array([3, -1]), r"has lengths from -1 to 3, outside \[0, padded_length=16\]"),
    (np.array([3, PADDED + 1]), r"has lengths from 3 to 17, outside \[0, padded_length=16\]"),
]
BAD_INTS = [0, -3, 1.5, True, "16", None]

kinds = pytest.mark.parametrize("kind", sorted(KINDS))


@contextlib.contextmanager
def raises(kind: str, error: type[Exception], pattern: str):
    """``pytest.raises`` whose message matches ``pattern`` (which names ``kind``) and
    does not name the other kind."""
    with pytest.raises(error, match=pattern) as info:
        yield info
    assert OTHER[kind] not in str(info.value), str(info.value)


def encode(table, batch, key):
    """Exact with and without packing: a mean over each row's token embeddings."""
    return packing.mean_pool(table[batch["input_ids"]], batch)


def text(rows=8, **extra):
    lengths = np.arange(rows) % PADDED + 1
    mask = (np.arange(PADDED) < lengths[:, None]).astype(np.int32)
    ids = (np.arange(rows * PADDED).reshape(rows, PADDED) % 5) * mask
    return {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask), **extra}


# ---------------------------------------------------------------- the constructor


@kinds
@pytest.mark.parametrize("value", BAD_INTS)
def test_tokens_not_a_positive_int(kind, value):
    with raises(kind, TypeError, rf"^{kind}\(tokens=\.\.\.\) must be a positive int, got "):
        KINDS[kind](tokens=value)


@kinds
@pytest.mark.parametrize("value", [3, None, ["attention_mask"]])
def test_lengths_neither_a_key_nor_a_callable(kind, value):
    with raises(kind, TypeError, rf"^{kind}\(lengths=\.\.\.\) must be the key of the attention"):
        KINDS[kind](lengths=value)


# ------------------------------------------------------------- chunk_counts, NumPy


@kinds
@pytest.mark.parametrize(("lengths", "says"), BAD_LENGTHS)
def test_chunk_counts_lengths(kind, lengths, says):
    with raises(kind, ValueError, rf"^{kind}\.chunk_counts\(lengths=\.\.\.\) {says}"):
        KINDS[kind]().chunk_counts(lengths, PADDED)


@kinds
@pytest.mark.parametrize("value", BAD_INTS)
def test_chunk_counts_padded_length(kind, value):
    pattern = rf"^{kind}\.chunk_counts\(padded_length=\.\.\.\) must be a positive int"
    with raises(kind, TypeError, pattern):
        KINDS[kind]().chunk_counts([3, 5], value)


# -------------------------------------------------------------- for_lengths, NumPy


@kinds
@pytest.mark.parametrize(("sample", "says"), BAD_LENGTHS)
def test_for_lengths_sample(kind, sample, says):
    with raises(kind, ValueError, rf"^{kind}\.for_lengths\(sample=\.\.\.\) {says}"):
        getattr(gc_jax, kind).for_lengths(sample, 64, PADDED)


@kinds
@pytest.mark.parametrize("value", BAD_INTS)
def test_for_lengths_padded_length(kind, value):
    pattern = rf"^{kind}\.for_lengths\(padded_length=\.\.\.\) must be a positive int"
    with raises(kind, TypeError, pattern):
        getattr(gc_jax, kind).for_lengths([3, 5], 64, value)


@kinds
def test_for_lengths_tokens_and_lengths(kind):
    fit = getattr(gc_jax, kind).for_lengths
    with raises(kind, TypeError, rf"^{kind}\(tokens=\.\.\.\) must be a positive int"):
        fit([3, 5], 0, PADDED)
    with raises(kind, ValueError, rf"^{kind}\(tokens=8\) is smaller than one"):
        fit([3, 5], 8, PADDED)
    with raises(kind, TypeError, rf"^{kind}\(lengths=\.\.\.\) must be the key"):
        fit([3, 5], 64, PADDED, lengths=3)


@kinds
def test_for_lengths_min_tokens(kind):
    fit = getattr(gc_jax, kind).for_lengths
    for value in (0, 1.5, "32"):
        with raises(kind, TypeError, rf"^{kind}\.for_lengths\(min_tokens=\.\.\.\) must be a pos"):
            fit([3, 5], 64, PADDED, min_tokens=value)
    assert fit([3, 5, 9, 16, 2], 64, PADDED, min_tokens=128).tokens == 64  # none tried
    assert PADDED <= fit([3, 5, 9, 16, 2], 64, PADDED, min_tokens=1).tokens < 64  # >= a row
    assert fit([16, 16], 64, PADDED, min_tokens=1).tokens == 64  # full rows: none costs less


# ------------------------------------------------------- the lengths, at trace time


TABLE = jnp.arange(10.0).reshape(5, 2)


def encoded(config, batch):
    return gc_jax.chunked_encoder(encode, config)(TABLE, batch)


@kinds
def test_a_missing_mask(kind):
    pattern = rf"^{kind}\(lengths='mask'\) reads each row's length from batch\['mask'\]"
    with raises(kind, ValueError, pattern):
        encoded(KINDS[kind](lengths="mask"), text())


@kinds
def test_a_mask_not_of_rank_2(kind):
    batch = text(mask=jnp.ones((8, PADDED, 1), jnp.int32))
    pattern = rf"^batch\['mask'\], where {kind}\(lengths='mask'\) reads each row's length"
    with raises(kind, ValueError, pattern):
        encoded(KINDS[kind](lengths="mask"), batch)


@kinds
def test_a_lengths_callable_of_the_wrong_shape(kind):
    config = KINDS[kind](lengths=lambda b: b["attention_mask"])
    pattern = rf"^{kind}\(lengths=\.\.\.\) returned \(8, 16\) int32 for batch; .*shape \(8,\)"
    with raises(kind, ValueError, pattern):
        encoded(config, text())


@kinds
def test_a_lengths_callable_and_no_token_leaf(kind):
    config = KINDS[kind](lengths=lambda b: jnp.ones(8, jnp.int32))
    with raises(kind, ValueError, rf"no \[rows, tokens\] leaf for a {kind} to cut by tokens"):
        encoded(config, {"input_ids": jnp.ones((8,), jnp.int32)})


@kinds
def test_tokens_smaller_than_the_padded_length(kind):
    with raises(kind, ValueError, rf"^{kind}\(tokens=8\) is smaller than one"):
        encoded(KINDS[kind](tokens=8), text())


@kinds
def test_a_float_leaf_as_wide_as_the_padded_length_names_the_kind(kind):
    batch = text(dense=jnp.ones((8, PADDED)))
    with pytest.warns(UserWarning, match=rf"batch\['dense'\] .* the {kind} cuts it") as record:
        out = encoded(KINDS[kind](), batch)
    assert not any(OTHER[kind] in str(w.message) for w in record)
    np.testing.assert_allclose(out, encode(TABLE, text(), None), rtol=1e-6)  # the full batch
