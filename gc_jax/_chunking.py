"""Splitting a batch pytree into chunks and putting per-chunk results back together.

A batch of ``B`` rows is cut into ``num_shards`` contiguous shards (``1`` unless the
batch is sharded across devices under plain ``jax.jit``); each shard is cut into
chunks of ``chunk_size`` rows. Chunk ``c`` is the concatenation of every shard's
``c``-th piece, so under sharded ``jit`` every device works on every chunk. With one
shard, chunk ``c`` is simply rows ``c * chunk_size : (c + 1) * chunk_size``.

The chunks are returned as a *body* stacked on a new leading axis (for ``lax.map``
and ``lax.scan``) and a *tail*: the last chunk, which is smaller when the chunk size
does not divide the batch. The tail is kept apart so that no row is ever padded and
so that its forward activations can stay live between the two passes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any


class ChunkPlan(NamedTuple):
    """How one input's batch is cut.

    Attributes:
      batch_size: total rows ``B``.
      num_shards: contiguous shards the rows are spread over (devices, under jit).
      chunk_size: rows of each shard per chunk.
      num_body: number of full chunks stacked in the body.
      tail_size: rows of each shard in the tail chunk (``1..chunk_size``).
    """

    batch_size: int
    num_shards: int
    chunk_size: int
    num_body: int
    tail_size: int

    @property
    def num_chunks(self) -> int:
        return self.num_body + 1


def make_plan(batch_size: int, chunk_size: int, num_shards: int = 1) -> ChunkPlan:
    """Plans the chunks of a batch (sizes are validated by the caller)."""
    rows = batch_size // num_shards
    chunk_size = min(chunk_size, rows)
    num_chunks = -(-rows // chunk_size)
    tail = rows - (num_chunks - 1) * chunk_size
    return ChunkPlan(batch_size, num_shards, chunk_size, num_chunks - 1, tail)


def split(tree: PyTree, plan: ChunkPlan) -> tuple[PyTree, PyTree]:
    """Cuts every leaf of ``tree`` into ``(body, tail)`` following ``plan``.

    Body leaves have shape ``[num_body, num_shards * chunk_size, ...]``; tail leaves
    ``[num_shards * tail_size, ...]``.
    """
    s, c, n = plan.num_shards, plan.chunk_size, plan.num_body

    def body(x):
        x = x.reshape(s, -1, *x.shape[1:])[:, : n * c]
        x = jnp.swapaxes(x.reshape(s, n, c, *x.shape[2:]), 0, 1)
        return x.reshape(n, s * c, *x.shape[3:])

    def tail(x):
        x = x.reshape(s, -1, *x.shape[1:])[:, n * c :]
        return x.reshape(s * plan.tail_size, *x.shape[2:])

    return jax.tree.map(body, tree), jax.tree.map(tail, tree)


def merge(body: PyTree, tail: PyTree, plan: ChunkPlan) -> PyTree:
    """Inverse of :func:`split`: puts per-chunk rows back in batch order."""
    s, c, n = plan.num_shards, plan.chunk_size, plan.num_body

    def join(b, t):
        b = b.reshape(n, s, c, *b.shape[2:])
        b = jnp.swapaxes(b, 0, 1).reshape(s, n * c, *b.shape[3:])
        t = t.reshape(s, plan.tail_size, *t.shape[1:])
        return jnp.concatenate([b, t], axis=1).reshape(plan.batch_size, *t.shape[2:])

    return jax.tree.map(join, body, tail)


def chunk_key(rng: jax.Array | None, input_index: int, chunk_index) -> jax.Array | None:
    """The key chunk ``chunk_index`` of input ``input_index`` gets, in both passes."""
    if rng is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(rng, input_index), chunk_index)
