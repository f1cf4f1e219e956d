"""Chunks cut by a token budget: rows grouped by length into buckets, trimmed of padding.

A :class:`TokenBudget` replaces ``chunk_size`` for batches of padded token sequences:
bucket ``len_b``'s chunks hold ``tokens // len_b`` rows cut to ``len_b`` tokens (one
compiled chunk shape per bucket). Under ``jax.jit`` the lengths are traced data: each
row's bucket is the shortest that holds it; a stable ``argsort`` by bucket orders the
rows. Each bucket encodes its rows (and those left over from shorter buckets) in full
chunks, and moves the rest up or pads its last chunk, whichever encodes fewer tokens
in all (:mod:`gc_jax._token_spans`); its number of chunks is traced, so it runs a
loop with a traced trip count (the passes never differentiate through their loops).
A chunk gathers its rows of that order; a partial chunk repeats its bucket's last row
(*padding rows*: not written, zero cotangent). The cache stays in the batch's order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gc_jax import _keys, _layout, _narrow, _token_spans, _validation
from gc_jax._base import PyTree
from gc_jax._token_budget import MASK as _MASK  # read with a lengths() callable too
from gc_jax._token_budget import TokenBudget


class BucketChunk(NamedTuple):
    """Chunk ``turn`` (traced) of bucket ``bucket`` (static)."""

    bucket: int
    turn: Any


class TokenPlan(NamedTuple):
    """How one batch is cut by a token budget (``order``, ``starts``, ... are traced).

    Attributes:
      batch_size: total rows ``B``.
      num_shards: contiguous shards the rows are spread over (devices, under jit);
        each shard is planned on its own.
      padded: the batch's padded length ``L`` (trimmed leaves have axis 1 of size ``L``).
      lengths: each bucket's padded length (the last is ``L``).
      rows: rows per shard of each bucket's chunks.
      order: ``[S, B / S]``: the rows of each shard, stably sorted by bucket.
      starts: ``[S, buckets]``: where each bucket's chunks start in ``order``.
      ends: ``[S, buckets]``: where they end (every row before it fits the bucket).
      trips: ``[buckets]``: chunks of each bucket (the most any shard needs).
      layout: how the rows lie across devices (``gc_jax._layout.Layout``).
    """

    batch_size: int
    num_shards: int
    padded: int
    lengths: tuple[int, ...]
    rows: tuple[int, ...]
    order: jax.Array
    starts: jax.Array
    ends: jax.Array
    trips: jax.Array
    layout: _layout.Layout = _layout.SINGLE

    num_chunks = None  # known only from the data: pass 1 keeps no chunk's VJP
    rows_hint = ""

    def loops(
        self, keep_tail: bool = False
    ) -> list[tuple[Callable[[Any], BucketChunk], jax.Array]]:
        """One chunk loop per bucket: ``(index of turn j, traced number of turns)``."""
        del keep_tail  # no chunk is kept (num_chunks is None)
        return [(lambda j, b=b: BucketChunk(b, j), self.trips[b]) for b in range(len(self.rows))]

    def has_tail(self, keep_tail: bool = False) -> bool:
        """False: every chunk is in :meth:`loops`."""
        return False

    def pack(self, batch: PyTree, wrt: tuple[bool, ...]) -> PyTree:
        """``batch`` as it is: chunks are gathered row by row, never sliced as lines."""
        return batch

    def samples(self) -> list[BucketChunk]:
        """A chunk of every bucket (for the output shapes)."""
        return [BucketChunk(b, 0) for b in range(len(self.rows))]

    def number(self, index: BucketChunk) -> jax.Array:
        """The chunk's number in the batch (its key is ``fold_in(rng, number)``)."""
        return jnp.sum(self.trips[: index.bucket]) + index.turn

    def rows_of(self, index: BucketChunk) -> int:
        return self.rows[index.bucket]

    def where(self, index: BucketChunk) -> tuple[jax.Array, jax.Array]:
        """``[S, rows]`` row numbers (within each shard) of the chunk, and which are real."""
        b, size = index.bucket, self.rows[index.bucket]
        pos = index.turn * size + jnp.arange(size)
        at = self.starts[:, b : b + 1] + pos[None, :]
        end = self.ends[:, b : b + 1]
        valid = at < end
        # Padding rows repeat the span's last row, which fits the bucket (so no row is
        # cut short, whose encoding could be NaN); where the span is empty, the
        # shard's shortest row.
        at = jnp.minimum(at, jnp.maximum(end - 1, 0))
        return jnp.take_along_axis(self.order, at, axis=1), valid

    def _trimmed(self, x: jax.Array) -> bool:
        return x.ndim >= 2 and x.shape[1] == self.padded

    def take(self, tree: PyTree, index: BucketChunk) -> PyTree:
        """The chunk's rows of every leaf, sequence leaves cut to the bucket's length."""
        rows, _ = self.where(index)
        length = self.lengths[index.bucket]

        def one(x):  # trimmed before the gather: only the bucket's tokens are read
            return _gather(x[:, :length] if self._trimmed(x) else x, rows, self.num_shards)

        return jax.tree.map(one, tree)

    def take_cotangent(self, tree: PyTree, index: BucketChunk) -> PyTree:
        """The chunk's rows of a representation gradient; zero on padding rows."""
        return take_rows(tree, *self.where(index), self.num_shards)

    def put(self, buffer: PyTree, chunk: PyTree, index: BucketChunk) -> PyTree:
        """Writes the chunk's real rows (not its padding rows) into ``buffer``, in place.

        A chunk leaf shorter than its buffer along axis 1 (a trimmed sequence leaf)
        fills the leading positions.
        """
        return put_rows(buffer, chunk, *self.where(index), self)

    def same_outputs(self, shapes: list[PyTree], name: str) -> PyTree:
        """Checks that every bucket's chunk gives outputs of one kind; returns the first.

        A leaf whose axis 1 is each bucket's length (token vectors, a token mask) has
        a token axis: its cache is ``[B, L, ...]``, zero after each row's bucket length.
        """
        shapes = _token_outputs(shapes, self.lengths)
        first = shapes[0]
        for b, other in enumerate(shapes[1:], 1):
            if found := _validation.first_mismatch(first, other):
                where, x, y = found
                raise ValueError(
                    f"{name} returned {where} of shape {tuple(x.shape)} ({x.dtype}) for a "
                    f"chunk of {self.rows[0]} rows x {self.lengths[0]} tokens but "
                    f"{tuple(y.shape)} ({y.dtype}) for {self.rows[b]} rows x "
                    f"{self.lengths[b]} tokens; with a TokenBudget every output must be "
                    "one representation per row whose shape does not depend on the "
                    "sequence length (pool over the tokens), or have the chunk's tokens "
                    "as axis 1 (token vectors, their mask)."
                )
        return first

    def reference(self, encode, params: PyTree, batch: PyTree, key, trim: bool = True) -> PyTree:
        """Every chunk this plan can cut (its rows, trimmed length and key; the lengths are
        traced, so a bucket's unused turns are encoded too and write no row), scattered
        back to the batch's order, differentiably (the reference of ``gc_jax.testing``;
        one shard). ``trim=False``: the same chunks and keys at the padded length, and
        outputs with a token axis cut to the bucket's length, as the cache holds them.

        One ``lax.scan`` per bucket: its turns compile once, so the reference compiles
        about as fast as the cached step (unrolled, a 6-bucket budget at 64 rows took 18x).
        """
        plan = self if trim else self._replace(lengths=(self.padded,) * len(self.lengths))

        def encoded(plan, bucket, turn):
            chunk = BucketChunk(bucket, turn)
            return encode(params, plan.take(batch, chunk), _keys.chunk_key(key, plan.number(chunk)))

        buckets = range(len(self.rows))
        shapes = [jax.eval_shape(lambda b=b: encoded(self, b, jnp.int32(0))) for b in buckets]
        tokens = _token_leaves(shapes, self.lengths)
        out = jax.tree.map(
            lambda r: jnp.zeros((self.batch_size, *r.shape[1:]), r.dtype),
            self.same_outputs(shapes, "encode"),
        )
        for bucket, size in enumerate(plan.rows):

            def turn(out, t, bucket=bucket):
                reps = encoded(plan, bucket, t)
                if not trim and tokens:
                    leaves, treedef = jax.tree.flatten(reps)
                    cut = lambda r, tok: r[:, : self.lengths[bucket]] if tok else r
                    reps = treedef.unflatten(map(cut, leaves, tokens))
                rows, valid = plan.where(BucketChunk(bucket, t))
                rows = jnp.where(valid, rows, plan.batch_size).reshape(-1)  # invalid: dropped
                at = lambda o, r: o.at[rows, : r.shape[1]] if r.ndim > 1 else o.at[rows]
                put = lambda o, r: at(o, r).set(r.astype(o.dtype), mode="drop")
                return jax.tree.map(put, out, reps), None

            out, _ = jax.lax.scan(turn, out, jnp.arange(-(-plan.batch_size // size)))
        return out


def _token_leaves(shapes: list[PyTree], lengths: tuple[int, ...]) -> list[bool] | None:
    """Which output leaves (in ``jax.tree.leaves`` order) have a token axis: axis 1 is
    each bucket's length. None with one bucket, or where the buckets' outputs differ
    in structure."""
    flat = [jax.tree.flatten(s) for s in shapes]
    if len(flat) < 2 or len({treedef for _, treedef in flat}) > 1:
        return None

    def has_tokens(i):
        pairs = zip(flat, lengths, strict=True)
        return all(len(v[i].shape) > 1 and v[i].shape[1] == n for (v, _), n in pairs)

    return [has_tokens(i) for i in range(len(flat[0][0]))]


def _token_outputs(shapes: list[PyTree], lengths: tuple[int, ...]) -> list[PyTree]:
    """Each bucket's output shapes, leaves with a token axis (axis 1 is each bucket's
    length) widened to the padded length ``lengths[-1]``, where their cache is."""
    tokens = _token_leaves(shapes, lengths)
    if tokens is None:  # one bucket: nothing trimmed; else same_outputs says what differs
        return shapes
    flat = [jax.tree.flatten(s) for s in shapes]
    widen = lambda r: jax.ShapeDtypeStruct((r.shape[0], lengths[-1], *r.shape[2:]), r.dtype)
    return [
        treedef.unflatten([widen(r) if t else r for r, t in zip(v, tokens, strict=True)])
        for v, treedef in flat
    ]


def take_rows(tree: PyTree, rows: jax.Array, valid: jax.Array, num_shards: int) -> PyTree:
    """Rows ``rows[s]`` of each shard ``s`` of every leaf, zero where not ``valid``."""
    valid = valid.reshape(-1)

    def one(g):
        piece = _gather(g, rows, num_shards)
        return jnp.where(valid.reshape(-1, *[1] * (g.ndim - 1)), piece, jnp.zeros_like(piece))

    return jax.tree.map(one, tree)


def put_rows(buffer: PyTree, chunk: PyTree, rows: jax.Array, valid: jax.Array, plan) -> PyTree:
    """``buffer`` with the chunk's rows written at ``rows[s]`` of each shard ``s`` (of
    ``plan.num_shards``), in place; rows not ``valid`` are dropped. A chunk leaf shorter
    than its buffer along axis 1 fills the leading positions."""
    num_shards, layout = plan.num_shards, plan.layout
    rows = jnp.where(valid, rows, plan.batch_size // num_shards)  # dropped
    shard = jnp.zeros_like(rows) + jnp.arange(num_shards)[:, None]  # typed as rows

    def write(buf, piece):
        bufs = layout.reshape(buf, (num_shards, buf.shape[0] // num_shards, *buf.shape[1:]))
        piece = layout.reshape(piece, (*rows.shape, *piece.shape[1:]))
        out = layout.shards_sharding  # explicit axes: say it (JAX cannot infer it)
        if piece.ndim >= 3 and piece.shape[2] != bufs.shape[2]:
            at = bufs.at[shard, rows, : piece.shape[2]]
        else:
            at = bufs.at[shard, rows]
        bufs = at.set(piece, mode="drop", out_sharding=out)
        return layout.reshape(bufs, buf.shape)

    def one(buf, piece):
        piece = piece.astype(buf.dtype)
        if _narrow.is_narrow(buf):  # in place on CPU too (see gc_jax._narrow)
            return _narrow.on_cpu_as_bits(write, buf, piece)
        return write(buf, piece)

    return jax.tree.map(one, buffer, chunk)


def _gather(x: jax.Array, rows: jax.Array, num_shards: int) -> jax.Array:
    """Rows ``rows[s]`` of each shard ``s`` of ``x``, as one ``[S * rows, ...]`` array."""
    xs = x.reshape(num_shards, -1, *x.shape[1:])
    piece = jnp.take_along_axis(xs, rows.reshape(*rows.shape, *[1] * (x.ndim - 1)), axis=1)
    return piece.reshape(-1, *x.shape[1:])


def row_lengths(batch: PyTree, budget: TokenBudget, name: str) -> jax.Array:
    """Each row's length: one past its mask's last nonzero position, or ``budget.lengths``."""
    if callable(budget.lengths):
        lengths = jnp.asarray(budget.lengths(batch))
        rows = jax.tree.leaves(batch)[0].shape[0]
        if lengths.shape != (rows,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(
                f"TokenBudget lengths({name}) returned {lengths.shape} {lengths.dtype}; it "
                f"must return one integer length per row (shape ({rows},))."
            )
        if hasattr(batch, "keys") and _MASK in batch and getattr(batch[_MASK], "ndim", 0) == 2:
            # Never trim what the mask says is a token: a lengths() that undercounts
            # (left padding, holes) would silently change the encoder's outputs.
            lengths = jnp.maximum(lengths, _mask_lengths(batch[_MASK]))
        return lengths
    return _mask_lengths(_mask(batch, budget.lengths, name))


def _mask_lengths(mask: jax.Array) -> jax.Array:
    """One past each row's last nonzero mask position."""
    positions = jnp.arange(1, mask.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(mask != 0, positions, 0), axis=1)


def _mask(batch: PyTree, key: str, name: str) -> jax.Array:
    if not hasattr(batch, "keys") or key not in batch:
        keys = sorted(map(str, batch.keys())) if hasattr(batch, "keys") else None
        got = f"a dict with keys {keys}" if keys is not None else type(batch).__name__
        raise ValueError(
            f"TokenBudget(lengths={key!r}) reads each row's length from {name}[{key!r}], but "
            f"{name} is {got}; pass lengths='<key of the attention mask>' or a callable "
            "lengths(batch) -> int[rows]."
        )
    mask = batch[key]
    if getattr(mask, "ndim", None) != 2:
        raise ValueError(
            f"{name}[{key!r}] must be a [rows, padded length] attention mask, got shape "
            f"{getattr(mask, 'shape', None)}."
        )
    return mask


def padded_length(batch: PyTree, budget: TokenBudget, name: str) -> int:
    """The batch's padded length: axis 1 of its mask, else of its first rank-2 leaf."""
    if not callable(budget.lengths):
        return int(_mask(batch, budget.lengths, name).shape[1])
    for x in jax.tree.leaves(batch):
        if x.ndim >= 2:
            return int(x.shape[1])
    raise ValueError(f"{name} has no [rows, tokens] leaf for a TokenBudget to trim.")


def make_plan(batch: PyTree, budget: TokenBudget, name: str,
              layout: _layout.Layout = _layout.SINGLE) -> TokenPlan:  # fmt: skip
    """Plans the bucket chunks of ``batch`` (traced lengths; static shapes)."""
    num_shards = layout.array_shards
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    padded = padded_length(batch, budget, name)
    warn_float_columns(batch, padded, name, budget)
    shapes = budget.chunk_shapes(padded, batch_size // num_shards)
    rows, lengths = tuple(r for r, _ in shapes), tuple(n for _, n in shapes)
    length = row_lengths(batch, budget, name).reshape(num_shards, -1)
    bucket = _token_spans.bucket_of(length, lengths, jnp)
    order = jnp.argsort(bucket, axis=1, stable=True)
    starts, ends, chunks = _token_spans.spans(bucket, rows, lengths, jnp)
    trips = jnp.max(chunks, axis=0)
    return TokenPlan(batch_size, num_shards, padded, lengths, rows, order, starts, ends, trips,
                     layout)  # fmt: skip


def warn_float_columns(batch: PyTree, padded: int, name: str, chunking: Any) -> None:
    """Warns about float ``[rows, padded]`` leaves (but the mask): trimmed like tokens by
    a ``TokenBudget`` or ``TokenPacking``, which is wrong for a dense feature that
    merely has ``padded`` columns."""
    mask = chunking.lengths if isinstance(chunking.lengths, str) else _MASK
    kind = type(chunking).__name__
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if jax.tree_util.keystr(path) == f"[{mask!r}]":
            continue
        if x.ndim == 2 and x.shape[1] == padded and jnp.issubdtype(x.dtype, jnp.floating):
            warnings.warn(
                f"{name}{jax.tree_util.keystr(path)} is a float [rows, {padded}] leaf: the "
                f"{kind} cuts it to each row's tokens like token ids, as a "
                "per-token feature. If it is a dense feature of that width, the trim drops "
                "columns and gradient caching is not exact: reshape it (e.g. [rows, 1, "
                f"{padded}]) or pass it outside the token batch.",
                stacklevel=4,
            )
