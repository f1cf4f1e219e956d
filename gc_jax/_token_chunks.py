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

import dataclasses
import itertools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gc_jax import _distributed, _narrow, _token_spans, _validation
from gc_jax._base import PyTree

_MASK = "attention_mask"  # read with a lengths() callable too, where the batch has it


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """Chunks of at most ``tokens`` tokens, trimmed to a few bucket lengths.

    Pass it as ``chunk_size`` (to ``cached_value_and_grad``, ``make_train_step`` or
    ``chunked_encoder``) for an input that is a batch of padded token sequences.

    Attributes:
      tokens: rows x padded length of every chunk (per device under ``shard_map`` or
        a sharded ``jit``, like ``chunk_size``). At least the batch's padded length.
      buckets: increasing padded lengths, e.g. ``(32, 64, 128, 256)``. A batch padded
        to ``L`` tokens uses the buckets shorter than ``L`` and ``L`` itself, so rows
        never lose a token; ``L`` larger than every bucket is an error (add ``L``).
      lengths: where each row's length comes from: the key of the attention mask in
        a dict batch (default ``"attention_mask"``; the length is one past the last
        nonzero position, so any mask is exact, left padding included, though only
        trailing padding is trimmed), or ``lengths(batch) -> int[rows]``, which must
        count every token the encoder may attend to (where a dict batch also has an
        ``"attention_mask"``, the larger of the two lengths is used, so an undercount
        never trims a token). A float leaf ``[rows, L]`` is trimmed too, with a
        warning: check that its padding positions carry nothing.

    Which leaves are trimmed: every leaf of rank 2 or more whose axis 1 is the padded
    length ``L`` (token ids, masks, token types, position ids, per-token features);
    other leaves are taken whole. The encoder's output must not depend on the
    trimmed padding (a masked transformer with mean or first-token pooling) and must
    have no token axis (one representation per row).

    Each bucket is one more chunk shape to compile (its forward, and its forward and
    backward), so compile time grows about linearly with the buckets; inputs whose
    buckets give equal chunk shapes share their kernels. :meth:`for_lengths` picks a
    few buckets that save most for a sample of lengths.

    Examples:
      >>> import gc_jax
      >>> budget = gc_jax.TokenBudget(tokens=2048, buckets=(32, 64, 128))
      >>> budget.chunk_shapes(padded_length=128, rows=512)  # (rows, tokens) per bucket
      ((64, 32), (32, 64), (16, 128))
      >>> budget.chunk_shapes(padded_length=48, rows=512)  # 48 is the longest bucket
      ((64, 32), (42, 48))
    """

    tokens: int
    buckets: tuple[int, ...]
    lengths: str | Callable[[PyTree], jax.Array] = "attention_mask"

    def __post_init__(self):
        _positive("tokens", self.tokens)
        buckets = tuple(self.buckets) if isinstance(self.buckets, tuple | list) else None
        if not buckets:
            raise TypeError(
                f"TokenBudget buckets must be a non-empty tuple of increasing padded lengths, "
                f"e.g. (32, 64, 128, 256), got {self.buckets!r}."
            )
        for i, b in enumerate(buckets):
            _positive(f"buckets[{i}]", b)
        if any(a >= b for a, b in itertools.pairwise(buckets)):
            raise ValueError(
                f"TokenBudget buckets must increase strictly, got {buckets}; pass them "
                f"sorted without repeats, e.g. {tuple(sorted(set(buckets)))}."
            )
        if not (isinstance(self.lengths, str) or callable(self.lengths)):
            raise TypeError(
                "TokenBudget lengths must be the key of the attention mask in a dict batch "
                f"(a str) or a callable lengths(batch) -> int[rows], got {self.lengths!r}."
            )
        object.__setattr__(self, "buckets", tuple(int(b) for b in buckets))

    @classmethod
    def for_lengths(
        cls, sample: Any, tokens: int, padded_length: int, *, max_buckets: int = 5,
        multiple: int = 8, min_saving: float = 0.01, lengths: Any = _MASK,
    ) -> TokenBudget:  # fmt: skip
        """A budget whose buckets encode the fewest tokens for batches like ``sample``.

        The buckets (multiples of ``multiple``, and ``padded_length``) are chosen on
        the sample's own lengths, planned as the step plans them: added one at a time
        while one saves at least ``min_saving`` of the tokens encoded, up to
        ``max_buckets``, then each moved to its best place. Each bucket is one more
        compiled chunk shape (compile time grows about linearly with them).

        Args:
          sample: row lengths (padding excluded), ``[rows]`` for one batch or
            ``[batches, rows]``, each row a batch as the step sees it (per device under
            ``shard_map`` or a sharded ``jit``): e.g. ``mask.sum(-1)`` of a few batches.
          tokens: the budget, as ``TokenBudget``.
          padded_length: the batches' padded length (the longest bucket).
          max_buckets: at most this many buckets, ``padded_length`` included.
          multiple: every bucket but ``padded_length`` is a multiple of it.
          min_saving: the share of the encoded tokens a bucket must save to be added.
          lengths: as ``TokenBudget``.

        Examples:
          >>> import numpy as np, gc_jax
          >>> lengths = np.random.default_rng(0).lognormal(np.log(40), 0.8, (8, 256))
          >>> sample = np.clip(lengths.astype(int), 1, 256)  # 8 batches of 256 rows
          >>> gc_jax.TokenBudget.for_lengths(sample, 4096, padded_length=256).buckets
          (40, 56, 96, 152, 256)
        """
        sample = _token_spans.checked_sample(sample, padded_length, max_buckets, multiple,
                                             min_saving)  # fmt: skip
        cls(tokens, (padded_length,)).chunk_shapes(padded_length, sample.shape[1])  # checks
        buckets = _token_spans.propose_buckets(
            sample, tokens, padded_length, max_buckets, multiple, min_saving
        )
        return cls(tokens, buckets, lengths)

    def bucket_lengths(self, padded_length: int) -> tuple[int, ...]:
        """The buckets a batch padded to ``padded_length`` tokens uses (the last is it)."""
        if padded_length > self.buckets[-1]:
            raise ValueError(
                f"the batch is padded to {padded_length} tokens but the largest bucket of "
                f"TokenBudget(buckets={self.buckets}) is {self.buckets[-1]}: rows may be "
                f"longer than every bucket. Add {padded_length} to buckets, or pad and "
                f"truncate the batch to at most {self.buckets[-1]} tokens."
            )
        return (*(b for b in self.buckets if b < padded_length), padded_length)

    def chunk_shapes(self, padded_length: int, rows: int) -> tuple[tuple[int, int], ...]:
        """``(rows, tokens)`` of each bucket's chunks: the shapes compiled, one per bucket.

        Args:
          padded_length: the batch's padded length (axis 1 of its token arrays).
          rows: the batch's rows (per device where ``tokens`` is per device).
        """
        if self.tokens < padded_length:
            raise ValueError(
                f"TokenBudget(tokens={self.tokens}) is smaller than one row of the longest "
                f"bucket ({padded_length} tokens, the batch's padded length); pass tokens of "
                f"at least {padded_length}, e.g. tokens={padded_length * 16} for chunks of "
                f"16 rows of {padded_length} tokens."
            )
        return tuple((min(self.tokens // n, rows), n) for n in self.bucket_lengths(padded_length))


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value <= 0:
        raise TypeError(f"TokenBudget {name} must be a positive int, got {value!r}.")


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
      layout: how the rows lie across devices (``gc_jax._distributed.Layout``).
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
    layout: _distributed.Layout = _distributed.SINGLE

    def loops(self) -> list[tuple[Callable[[Any], BucketChunk], jax.Array]]:
        """One chunk loop per bucket: ``(index of turn j, traced number of turns)``."""
        return [(lambda j, b=b: BucketChunk(b, j), self.trips[b]) for b in range(len(self.rows))]

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
        # Padding rows repeat the row before the span's end, which fits the bucket (no
        # row is cut short, whose encoding could be NaN); at the start, the shortest.
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
        rows, valid = self.where(index)
        valid = valid.reshape(-1)

        def one(g):
            piece = _gather(g, rows, self.num_shards)
            return jnp.where(valid.reshape(-1, *[1] * (g.ndim - 1)), piece, jnp.zeros_like(piece))

        return jax.tree.map(one, tree)

    def put(self, buffer: PyTree, chunk: PyTree, index: BucketChunk) -> PyTree:
        """Writes the chunk's real rows (not its padding rows) into ``buffer``, in place.

        A chunk leaf shorter than its buffer along axis 1 (a trimmed sequence leaf)
        fills the leading positions.
        """
        rows, valid = self.where(index)
        rows = jnp.where(valid, rows, self.batch_size // self.num_shards)  # dropped
        shard = jnp.zeros_like(rows) + jnp.arange(self.num_shards)[:, None]  # typed as rows
        reshape = self.layout.reshape  # the shards stay split over the devices

        def write(buf, piece):
            bufs = reshape(buf, (self.num_shards, buf.shape[0] // self.num_shards, *buf.shape[1:]))
            piece = reshape(piece, (*rows.shape, *piece.shape[1:]))
            out = self.layout.shards_sharding  # explicit axes: say it (JAX cannot infer it)
            if piece.ndim >= 3 and piece.shape[2] != bufs.shape[2]:
                at = bufs.at[shard, rows, : piece.shape[2]]
            else:
                at = bufs.at[shard, rows]
            bufs = at.set(piece, mode="drop", out_sharding=out)
            return reshape(bufs, buf.shape)

        def one(buf, piece):
            piece = piece.astype(buf.dtype)
            if _narrow.is_narrow(buf):  # in place on CPU too (see gc_jax._narrow)
                return _narrow.on_cpu_as_bits(write, buf, piece)
            return write(buf, piece)

        return jax.tree.map(one, buffer, chunk)

    def same_outputs(self, shapes: list[PyTree], name: str) -> PyTree:
        """Checks that every bucket's chunk gives outputs of one kind; returns the first."""
        first = shapes[0]
        for b, other in enumerate(shapes[1:], 1):
            if found := _validation.first_mismatch(first, other):
                where, x, y = found
                raise ValueError(
                    f"{name} returned {where} of shape {tuple(x.shape)} ({x.dtype}) for a "
                    f"chunk of {self.rows[0]} rows x {self.lengths[0]} tokens but "
                    f"{tuple(y.shape)} ({y.dtype}) for {self.rows[b]} rows x "
                    f"{self.lengths[b]} tokens; with a TokenBudget the encoder must "
                    "return one representation per row whose shape does not depend on "
                    "the sequence length (pool over the tokens)."
                )
        return first


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
              layout: _distributed.Layout = _distributed.SINGLE) -> TokenPlan:  # fmt: skip
    """Plans the bucket chunks of ``batch`` (traced lengths; static shapes)."""
    num_shards = layout.array_shards
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    padded = padded_length(batch, budget, name)
    _warn_float_columns(
        batch, padded, name, budget.lengths if isinstance(budget.lengths, str) else _MASK
    )
    shapes = budget.chunk_shapes(padded, batch_size // num_shards)
    rows, lengths = tuple(r for r, _ in shapes), tuple(n for _, n in shapes)
    length = row_lengths(batch, budget, name).reshape(num_shards, -1)
    bucket = _token_spans.bucket_of(length, lengths, jnp)
    order = jnp.argsort(bucket, axis=1, stable=True)
    starts, ends, chunks = _token_spans.spans(bucket, rows, lengths, jnp)
    trips = jnp.max(chunks, axis=0)
    return TokenPlan(batch_size, num_shards, padded, lengths, rows, order, starts, ends, trips,
                     layout)  # fmt: skip


def _warn_float_columns(batch: PyTree, padded: int, name: str, mask: str) -> None:
    """Warns about float ``[rows, padded]`` leaves (but the mask): trimmed like tokens,
    which is wrong for a dense feature that merely has ``padded`` columns."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if jax.tree_util.keystr(path) == f"[{mask!r}]":
            continue
        if x.ndim == 2 and x.shape[1] == padded and jnp.issubdtype(x.dtype, jnp.floating):
            warnings.warn(
                f"{name}{jax.tree_util.keystr(path)} is a float [rows, {padded}] leaf: the "
                f"TokenBudget trims it to each bucket's length like token ids, as a "
                "per-token feature. If it is a dense feature of that width, the trim drops "
                "columns and gradient caching is not exact: reshape it (e.g. [rows, 1, "
                f"{padded}]) or pass it outside the token batch.",
                stacklevel=4,
            )
