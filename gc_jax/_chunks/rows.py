"""An int ``chunk_size``: a batch cut into chunks of rows, results written back in place.

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

:class:`ChunkPlan` is one kind of ``gc_jax._chunks.plan.Plan``; the others cut chunks by
tokens (``gc_jax._chunks.budget.TokenPlan``, ``gc_jax._chunks.lines.PackPlan``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gc_jax import _keys, _layout, _narrow, _validation
from gc_jax._base import PyTree


class ChunkPlan(NamedTuple):
    """How one input's batch is cut into chunks of rows (a :class:`gc_jax._chunks.plan.Plan`).

    Attributes:
      batch_size: total rows ``B``.
      num_shards: contiguous shards the rows are spread over (devices, under jit).
      chunk_size: rows of each shard per chunk.
      num_body: number of full chunks before the tail.
      tail_size: rows of each shard in the tail chunk (``1..chunk_size``).
      layout: how the rows lie across devices (``gc_jax._layout.Layout``).

    A chunk index is a (traced) body index ``0 .. num_body - 1``, or None: the tail.
    """

    batch_size: int
    num_shards: int
    chunk_size: int
    num_body: int
    tail_size: int
    layout: _layout.Layout = _layout.SINGLE

    rows_hint = ""

    @property
    def num_chunks(self) -> int:
        return self.num_body + 1

    def _full_tail(self) -> bool:
        """Whether the last chunk is as large as the others (chunk ``num_body`` is the tail)."""
        return self.tail_size == self.chunk_size

    @property
    def keepable(self) -> int:
        """The most chunks pass 1 can keep the VJPs of: every chunk."""
        return self.num_chunks

    def loops(self, keep: int) -> list[tuple[Callable[[Any], Any], int]]:
        """The chunk loop ``(index of turn j, turns)`` of the chunks not kept: the body
        chunks before the kept ones, and the tail too when it is full-sized and nothing
        is kept (one more turn of the loop). ``keep``: the chunks kept (a bool: 0 or 1)."""
        looped = self.num_body - max(keep - 1, 0) + (not keep and self._full_tail())
        return [(lambda j: j, looped)] if looped else []

    def has_tail(self, keep: int) -> bool:
        """Whether the tail is encoded on its own, after the loop (kept if ``keep``)."""
        return bool(keep) or not self._full_tail()

    def kept(self, keep: int) -> tuple[Callable[[Any], Any], int]:
        """The kept chunks but the tail: ``(index of turn j, turns)``, the last
        ``keep - 1`` body chunks."""
        turns = max(keep - 1, 0)
        return (lambda j: self.num_body - turns + j), turns

    def samples(self) -> list:
        """One chunk index per distinct chunk shape: the tail and, if any, a full chunk."""
        return [None, 0] if self.num_body else [None]

    def rows_of(self, index: Any) -> int:
        """Rows per shard of chunk ``index``."""
        return self.tail_size if index is None else self.chunk_size

    def number(self, index: Any) -> Any:
        """Chunk ``index``'s number in the batch, folded into its key."""
        return self.num_body if index is None else index

    def _span(self, index: jax.Array | None) -> tuple[Any, int]:
        """Start row (within each shard) and rows per shard of chunk ``index``."""
        if index is None:
            return self.num_body * self.chunk_size, self.tail_size
        return index * self.chunk_size, self.chunk_size

    def _shards(self, x: jax.Array) -> jax.Array:
        return x.reshape(self.num_shards, -1, *x.shape[1:])

    def pack(self, batch: PyTree, wrt: tuple[bool, ...]) -> PyTree:
        """``batch`` with its narrow leaves (not differentiated) viewed as :class:`Lines`,
        for the chunk reads of :meth:`take`."""
        leaves, treedef = jax.tree.flatten(batch)

        def one(x, w):
            if w or not _packable(x, self):
                return x
            rows = self._shards(x).reshape(self.num_shards, -1, math.prod(x.shape[1:]))
            reshape = self.layout.reshape
            tpu, default = (lambda r: _lines_tpu(r, reshape)), (lambda r: _lines(r, reshape))
            return Lines(jax.lax.platform_dependent(rows, tpu=tpu, default=default), x.shape)

        return treedef.unflatten([one(x, w) for x, w in zip(leaves, wrt, strict=True)])

    def take(self, tree: PyTree, index: jax.Array | None = None) -> PyTree:
        """Chunk ``index`` of every leaf (a traced body index), or the tail if None."""
        start, size = self._span(index)

        def one(x):
            if isinstance(x, Lines):  # whole lines of every shard: see pack
                piece = jax.lax.dynamic_slice_in_dim(
                    x.lines, start // x.per_line, size // x.per_line, axis=1
                )
                piece = self.layout.reshape(piece, (self.num_shards, size, *x.shape[1:]))
                return piece.reshape(self.num_shards * size, *x.shape[1:])
            piece = jax.lax.dynamic_slice_in_dim(self._shards(x), start, size, axis=1)
            return piece.reshape(self.num_shards * size, *x.shape[1:])

        return jax.tree.map(one, tree, is_leaf=_is_lines)

    def take_cotangent(self, tree: PyTree, index: Any = None) -> PyTree:
        """Chunk ``index`` of a representation gradient."""
        return self.take(tree, index)

    def put(self, buffer: PyTree, chunk: PyTree, index: jax.Array | None = None) -> PyTree:
        """Writes ``chunk`` into the rows of chunk ``index`` (or the tail) of ``buffer``."""
        start, size = self._span(index)

        def write(buf, piece):
            return jax.lax.dynamic_update_slice_in_dim(
                self._shards(buf), piece, start, axis=1
            ).reshape(buf.shape)

        def one(buf, piece):
            piece = piece.reshape(self.num_shards, size, *piece.shape[1:]).astype(buf.dtype)
            if _narrow.is_narrow(buf):  # in place on CPU too (see gc_jax._narrow)
                return _narrow.on_cpu_as_bits(write, buf, piece)
            return write(buf, piece)

        return jax.tree.map(one, buffer, chunk)

    def same_outputs(self, shapes: list[PyTree], name: str) -> PyTree:
        """Checks that the tail and a full chunk (:meth:`samples`' order) give outputs of
        one kind; returns the tail's."""
        if len(shapes) > 1:
            _validation.same_chunk_outputs(shapes[1], shapes[0], name)
        return shapes[0]

    def reference(self, encode, params: PyTree, batch: PyTree, key, trim: bool = True) -> PyTree:
        """The batch encoded chunk by chunk with the chunks' keys, differentiably and
        without a cache (the reference of ``gc_jax.testing``). ``trim``: token plans'."""
        del trim  # row chunks are never trimmed
        chunks = [*range(self.num_body), None]
        key_of = lambda c: _keys.chunk_key(key, self.number(c))
        parts = [encode(params, self.take(batch, c), key_of(c)) for c in chunks]
        return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)


def make_plan(
    batch_size: int, chunk_size: int, layout: _layout.Layout = _layout.SINGLE
) -> ChunkPlan:
    """Plans the chunks of a batch (sizes are validated by the caller)."""
    num_shards = layout.array_shards
    rows = batch_size // num_shards
    chunk_size = min(chunk_size, rows)
    num_chunks = -(-rows // chunk_size)
    tail = rows - (num_chunks - 1) * chunk_size
    return ChunkPlan(batch_size, num_shards, chunk_size, num_chunks - 1, tail, layout)


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
