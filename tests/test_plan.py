"""gc_jax._chunks.plan: both kinds of chunk plan keep the protocol the passes rely on.

Whatever a plan's kind, its loops and its tail visit every row exactly once: writing
each chunk's rows (``take`` then ``put``) rebuilds the batch, and ``take_cotangent``
and ``put`` agree on which rows a chunk owns. The factory checks ``chunk_size`` and
derives the keys as documented.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gc_jax
from gc_jax import _keys
from gc_jax._chunks import plan as _plan

ROWS, PADDED = 37, 16


def token_batch(seed: int = 0) -> dict:
    lengths = jax.random.randint(jax.random.key(seed), (ROWS,), 1, PADDED + 1)
    mask = (jnp.arange(PADDED) < lengths[:, None]).astype(jnp.int32)
    ids = (jnp.arange(ROWS * PADDED).reshape(ROWS, PADDED) % 97 + 1) * mask
    return {"input_ids": ids, "attention_mask": mask, "row": jnp.arange(ROWS, dtype=jnp.float32)}


CHUNK_SIZES = [1, 5, 37, 64, gc_jax.TokenBudget(tokens=64, buckets=(4, 8, 16)),
               gc_jax.TokenBudget(tokens=16, buckets=(2, 16))]  # fmt: skip


def visit_every_chunk(plan: _plan.Plan, batch, keep_tail: bool):
    """Each chunk's ``row`` leaf written back through the protocol, and how often each
    row was written (a count per row, through ``take_cotangent`` of ones)."""
    rows = jnp.zeros(ROWS)
    seen = jnp.zeros(ROWS)
    ones = jnp.ones(ROWS)

    def write(carry, c):
        rows, seen = carry
        rows = plan.put(rows, plan.take(batch, c)["row"], c)
        seen = plan.put(seen, plan.take(seen, c) + plan.take_cotangent(ones, c), c)
        return rows, seen

    for index, turns in plan.loops(keep_tail):
        body = lambda j, carry, index=index: write(carry, index(j))
        rows, seen = jax.lax.fori_loop(0, turns, body, (rows, seen))
    index, turns = plan.kept(keep_tail)  # a token plan keeps its last bucket's last chunk
    for j in range(turns):
        rows, seen = write((rows, seen), index(j))
    if plan.has_tail(keep_tail):
        rows, seen = write((rows, seen), None)
    return rows, seen


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES, ids=str)
@pytest.mark.parametrize("keep_tail", [False, True])
def test_every_row_is_visited_once(chunk_size, keep_tail):
    batch = token_batch()

    @jax.jit
    def run(batch):
        planned = _plan.make(batch, chunk_size, name="batch")
        plan = planned.plan
        return visit_every_chunk(plan, plan.pack(planned.batch, (False,) * 3), keep_tail)

    rows, seen = run(batch)
    chex.assert_trees_all_equal(rows, batch["row"])
    chex.assert_trees_all_equal(seen, jnp.ones(ROWS))


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES, ids=str)
def test_the_reference_encodes_every_row_as_the_passes_do(chunk_size):
    """``Plan.reference`` (gc_jax.testing's) against the cached encoder, with keys."""
    batch = token_batch(1)
    encode = lambda p, x, key: x["row"][:, None] * p + jax.random.uniform(key, (len(x["row"]), 1))
    planned = _plan.make(batch, chunk_size, rng=jax.random.key(2), index=1, name="batch")
    want = jax.jit(lambda b: planned.plan.reference(encode, 1.0, b, planned.key))(batch)
    key = _keys.input_key(jax.random.key(2), 1)
    got = jax.jit(gc_jax.chunked_encoder(encode, chunk_size))(1.0, batch, key)
    chex.assert_trees_all_close(got, want, rtol=1e-6)


def test_num_chunks_is_static_only_for_rows():
    batch = token_batch()
    assert _plan.make(batch, 10).plan.num_chunks == 4
    assert _plan.make(batch, CHUNK_SIZES[-1]).plan.num_chunks is None


def test_keys():
    rng = jax.random.key(0)
    assert _plan.make(token_batch(), 8).key is None
    same = _plan.make(token_batch(), 8, rng=rng).key  # one input: the key as given
    assert np.array_equal(jax.random.key_data(same), jax.random.key_data(rng))
    second = _plan.make(token_batch(), 8, rng=rng, index=1).key
    want = jax.random.fold_in(rng, 1)
    assert np.array_equal(jax.random.key_data(second), jax.random.key_data(want))


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, "chunk_size must be a positive int"),
        (2.0, TypeError, "chunk_size must be a positive int"),
        ([], ValueError, "chunk_size is an empty sequence"),
        ([4, "8"], TypeError, r"chunk_size\[1\] must be a positive int"),
    ],
)
def test_check_names_the_argument(value, error, match):
    with pytest.raises(error, match=match):
        _plan.check_all(value)


def test_by_tokens():
    assert _plan.by_tokens(CHUNK_SIZES[-1]) and not _plan.by_tokens(8)
    assert _plan.check_all((8, CHUNK_SIZES[-1])) == (8, CHUNK_SIZES[-1])
