"""Cutting a batch pytree into chunks, and writing per-chunk results back in place.

A batch of ``B`` rows is viewed as ``num_shards`` contiguous shards (``1`` unless the
batch is sharded across devices under plain ``jax.jit``); each shard is cut into
chunks of ``chunk_size`` rows. Chunk ``c`` is the concatenation of every shard's
``c``-th piece, so under sharded ``jit`` every device works on every chunk. With one
shard, chunk ``c`` is simply rows ``c * chunk_size : (c + 1) * chunk_size``.

Chunks are read with ``dynamic_slice`` and written with ``dynamic_update_slice``
inside loops, so neither the inputs nor the cached representations are ever copied
into a stacked ``[num_chunks, chunk, ...]`` layout. The last chunk (the *tail*) is
smaller when the chunk size does not divide the batch; no row is ever padded.

*Narrow leaves* (token ids and masks of 32 or 64 tokens: rows of fewer than 128
elements) are read as whole 128-element lines (:func:`pack`). The TPU compiler lays
out an array it slices by rows with the rows major and pads each row to 128 lanes, so
an ``int32[B, 32]`` batch read chunk by chunk would be copied into a buffer 4x its
size; viewed as ``[B / 4, 128]`` it is copied unpadded. On row-major backends (CPU,
GPU) the view is free: the same bytes, read the same way.

A plan of another kind (``gc_jax._token_chunks.TokenPlan``: chunks cut by a token
budget) cuts itself: :func:`take`, :func:`put`, :func:`rows_of`,
:func:`take_cotangent` and :func:`number` call its methods.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gc_jax import _distributed, _narrow
from gc_jax._base import PyTree


class ChunkPlan(NamedTuple):
    """How one input's batch is cut.

    Attributes:
      batch_size: total rows ``B``.
      num_shards: contiguous shards the rows are spread over (devices, under jit).
      chunk_size: rows of each shard per chunk.
      num_body: number of full chunks before the tail.
      tail_size: rows of each shard in the tail chunk (``1..chunk_size``).
      layout: how the rows lie across devices (``gc_jax._distributed.Layout``).
    """

    batch_size: int
    num_shards: int
    chunk_size: int
    num_body: int
    tail_size: int
    layout: _distributed.Layout = _distributed.SINGLE


def make_plan(
    batch_size: int, chunk_size: int, layout: _distributed.Layout = _distributed.SINGLE
) -> ChunkPlan:
    """Plans the chunks of a batch (sizes are validated by the caller)."""
    num_shards = layout.array_shards
    rows = batch_size // num_shards
    chunk_size = min(chunk_size, rows)
    num_chunks = -(-rows // chunk_size)
    tail = rows - (num_chunks - 1) * chunk_size
    return ChunkPlan(batch_size, num_shards, chunk_size, num_chunks - 1, tail, layout)


def zeros(like: PyTree, plan: ChunkPlan, vma: tuple = ()) -> PyTree:
    """A batch-sized buffer for chunks shaped like ``like``, sharded like the batch.

    ``vma``: the ``shard_map`` axes the chunks written into it vary over.
    """

    def one(r):
        buf = jnp.zeros((plan.batch_size, *r.shape[1:]), r.dtype)
        if vma:
            buf = jax.lax.pcast(buf, vma, to="varying")
        return plan.layout.place(buf)

    return jax.tree.map(one, like)


LANES = 128  # a TPU vector register's minor dimension


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Lines:
    """A narrow batch leaf viewed as whole lines of :data:`LANES` elements.

    Attributes:
      lines: each shard's rows as lines, ``[num_shards, rows // (num_shards *
        per_line), LANES]``, split over the devices like the rows.
      shape: the leaf's own shape ``[rows, ...]``.
    """

    lines: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @property
    def per_line(self) -> int:
        return LANES // math.prod(self.shape[1:])


def _packable(x: jax.Array, plan: ChunkPlan) -> bool:
    """Whether ``x``'s rows are narrower than a line and every chunk is whole lines."""
    width = math.prod(x.shape[1:])
    if x.ndim < 2 or width >= LANES or LANES % width:
        return False
    per_line = LANES // width
    return not (plan.chunk_size % per_line or plan.tail_size % per_line)


def pack(batch: PyTree, plan: ChunkPlan, wrt: tuple[bool, ...]) -> PyTree:
    """``batch`` with its narrow leaves (not differentiated) viewed as :class:`Lines`.

    Only for the chunk reads of :func:`take`; a plan of another kind keeps the batch.
    """
    if not isinstance(plan, ChunkPlan):
        return batch
    leaves, treedef = jax.tree.flatten(batch)

    def one(x, w):
        if w or not _packable(x, plan):
            return x
        rows = _shards(x, plan).reshape(plan.num_shards, -1, math.prod(x.shape[1:]))
        reshape = plan.layout.reshape
        tpu, default = (lambda r: _lines_tpu(r, reshape)), (lambda r: _lines(r, reshape))
        return Lines(jax.lax.platform_dependent(rows, tpu=tpu, default=default), x.shape)

    return treedef.unflatten([one(x, w) for x, w in zip(leaves, wrt, strict=True)])


def _lines(x: jax.Array, reshape) -> jax.Array:
    """Each shard's rows ``[shards, n, w]`` as ``[shards, n // per_line, LANES]``: a free
    reshape of a row-major array (``reshape``: the layout's, keeping the shards split)."""
    return reshape(x, (x.shape[0], x.shape[1] * x.shape[2] // LANES, LANES))


def _lines_tpu(x: jax.Array, reshape) -> jax.Array:
    """:func:`_lines`, written from the transpose for the TPU compiler.

    A TPU keeps a narrow ``[rows, w]`` array rows-minor (``w`` would be padded to 128
    lanes otherwise). ``x.reshape`` would make the compiler copy it into a rows-major,
    padded buffer first (4x the array for ``w = 32``) and reshape that; from the
    transpose (a free view of that layout) it writes the lines directly.
    """
    shards, rows, width = x.shape
    per_line = LANES // width
    split = reshape(jnp.swapaxes(x, 1, 2), (shards, width, rows // per_line, per_line))
    return reshape(split.transpose(0, 2, 3, 1), (shards, rows // per_line, LANES))


def _is_lines(x: Any) -> bool:
    return isinstance(x, Lines)


def _shards(x: jax.Array, plan: ChunkPlan) -> jax.Array:
    return x.reshape(plan.num_shards, -1, *x.shape[1:])


def _span(plan: ChunkPlan, index: jax.Array | None) -> tuple[Any, int]:
    """Start row (within each shard) and rows per shard of chunk ``index``; None: the tail."""
    if index is None:
        return plan.num_body * plan.chunk_size, plan.tail_size
    return index * plan.chunk_size, plan.chunk_size


def samples(plan: ChunkPlan) -> list:
    """One chunk index per distinct chunk shape: the tail and, if any, a full chunk."""
    if not isinstance(plan, ChunkPlan):  # one per bucket (gc_jax._token_chunks)
        return plan.samples()
    return [None, 0] if plan.num_body else [None]


def rows_of(plan: ChunkPlan, index: Any) -> int:
    """Rows per shard of chunk ``index`` (None: the tail)."""
    if not isinstance(plan, ChunkPlan):  # another plan (gc_jax._token_chunks) cuts itself
        return plan.rows_of(index)
    return plan.tail_size if index is None else plan.chunk_size


def take(tree: PyTree, plan: ChunkPlan, index: jax.Array | None = None) -> PyTree:
    """Chunk ``index`` of every leaf (a traced body index), or the tail if None."""
    if not isinstance(plan, ChunkPlan):
        return plan.take(tree, index)
    start, size = _span(plan, index)

    def one(x):
        if isinstance(x, Lines):  # whole lines of every shard: see pack
            piece = jax.lax.dynamic_slice_in_dim(
                x.lines, start // x.per_line, size // x.per_line, axis=1
            )
            piece = plan.layout.reshape(piece, (plan.num_shards, size, *x.shape[1:]))
            return piece.reshape(plan.num_shards * size, *x.shape[1:])
        piece = jax.lax.dynamic_slice_in_dim(_shards(x, plan), start, size, axis=1)
        return piece.reshape(plan.num_shards * size, *x.shape[1:])

    return jax.tree.map(one, tree, is_leaf=_is_lines)


def put(buffer: PyTree, chunk: PyTree, plan: ChunkPlan, index: jax.Array | None = None) -> PyTree:
    """Writes ``chunk`` into the rows of chunk ``index`` (or the tail) of ``buffer``."""
    if not isinstance(plan, ChunkPlan):
        return plan.put(buffer, chunk, index)
    start, size = _span(plan, index)

    def write(buf, piece):
        return jax.lax.dynamic_update_slice_in_dim(
            _shards(buf, plan), piece, start, axis=1
        ).reshape(buf.shape)

    def one(buf, piece):
        piece = piece.reshape(plan.num_shards, size, *piece.shape[1:]).astype(buf.dtype)
        if _narrow.is_narrow(buf):  # in place on CPU too (see gc_jax._narrow)
            return _narrow.on_cpu_as_bits(write, buf, piece)
        return write(buf, piece)

    return jax.tree.map(one, buffer, chunk)


def take_cotangent(tree: PyTree, plan: ChunkPlan, index: Any = None) -> PyTree:
    """Chunk ``index`` of a representation gradient (zero on a plan's padding rows)."""
    if not isinstance(plan, ChunkPlan):
        return plan.take_cotangent(tree, index)
    return take(tree, plan, index)


def number(plan: ChunkPlan, index: Any) -> Any:
    """Chunk ``index``'s number in the batch, folded into its key (the tail: ``num_body``)."""
    if not isinstance(plan, ChunkPlan):
        return plan.number(index)
    return plan.num_body if index is None else index


def input_key(rng: jax.Array | None, input_index: int) -> jax.Array | None:
    """The key of input ``input_index``'s chunks: ``fold_in(rng, input_index)``; None stays None."""
    return None if rng is None else jax.random.fold_in(rng, input_index)


def chunk_key(rng: jax.Array | None, chunk_index) -> jax.Array | None:
    """The key chunk ``chunk_index`` of an input with key ``rng`` gets, in both passes."""
    return None if rng is None else jax.random.fold_in(rng, chunk_index)
