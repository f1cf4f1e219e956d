"""``TokenBudget``: ``chunk_size`` counted in tokens, rows grouped into a few bucket lengths.

The config (:class:`TokenBudget`: its buckets, checks, the chunk shapes it compiles and
buckets fitted to a sample), its plan (:class:`TokenPlan`) and :func:`make_plan`.

Bucket ``len_b``'s chunks hold ``tokens // len_b`` rows cut to ``len_b`` tokens (one
compiled chunk shape per bucket). Under ``jax.jit`` the lengths are traced data: each
row's bucket is the shortest that holds it; a stable ``argsort`` by bucket orders the
rows. Each bucket encodes its rows (and those left over from shorter buckets) in full
chunks, and moves the rest up or pads its last chunk, whichever encodes fewer tokens
in all (:mod:`gc_jax._chunks.spans`); its number of chunks is traced, so it runs a
loop with a traced trip count (the passes never differentiate through their loops).
A chunk gathers its rows of that order; a partial chunk repeats its bucket's last row
(*padding rows*: not written, zero cotangent). The cache stays in the batch's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gc_jax import _keys, _layout, _validation
from gc_jax._base import PyTree
from gc_jax._chunks import spans, token_rows
from gc_jax._chunks.token_rows import MASK, BucketChunk


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
    trimmed padding (a masked transformer with mean or first-token pooling). Each
    output is one representation per row, or has a token axis: axis 1 the chunk's
    tokens (token vectors ``[rows, len, dim]``, their mask ``[rows, len]``), cached as
    ``[B, L, ...]``, zero after each row's bucket length; a loss over tokens must then
    use the mask (``gc_jax.losses.maxsim_loss``'s ``q_mask``, ``d_mask``).

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
    lengths: str | Callable[[PyTree], jax.Array] = MASK

    def __post_init__(self):
        kind = type(self).__name__
        token_rows.positive_int(self.tokens, f"{kind}(tokens=...)")
        buckets = token_rows.checked_buckets(self.buckets, kind)
        token_rows.check_lengths_source(self.lengths, kind)
        object.__setattr__(self, "buckets", buckets)

    @classmethod
    def for_lengths(
        cls, sample: Any, tokens: int, padded_length: int, *, max_buckets: int = 5,
        multiple: int = 8, min_saving: float = 0.01, lengths: Any = MASK,
        attention_width: float | None = None, min_tokens: int | None = None,
    ) -> TokenBudget:  # fmt: skip
        """A budget whose buckets encode the fewest tokens (or FLOPs) for batches like ``sample``.

        The buckets (multiples of ``multiple``, and ``padded_length``) are chosen on
        the sample's own lengths, planned as the step plans them: added one at a time
        while one saves at least ``min_saving`` of the tokens encoded, up to
        ``max_buckets``, then each moved to its best place. Each bucket is one more
        compiled chunk shape (compile time grows about linearly with them).

        With ``attention_width`` the buckets minimise the encoder's modelled FLOPs,
        attention included, instead of its tokens: a chunk of ``r`` rows of ``n``
        tokens costs ``r * n * (1 + n / (6 * attention_width))``. Per layer and token,
        a transformer of width ``d`` takes about ``24 d^2`` FLOPs in its dense matmuls
        and ``4 d n`` in attention (scores and weighted values), whose ratio is
        ``n / (6 d)``: long chunks cost more per token than short ones. The step's plan
        is the same either way (for the buckets it has, it encodes the fewest tokens).

        Args:
          sample: row lengths (padding excluded), ``[rows]`` for one batch or
            ``[batches, rows]``, each row a batch as the step sees it (per device under
            ``shard_map`` or a sharded ``jit``): e.g. ``mask.sum(-1)`` of a few batches.
          tokens: the budget, as ``TokenBudget``.
          padded_length: the batches' padded length (the longest bucket).
          max_buckets: at most this many buckets, ``padded_length`` included.
          multiple: every bucket but ``padded_length`` is a multiple of it.
          min_saving: the share of the encoded tokens (or modelled FLOPs) a bucket must
            save to be added.
          lengths: as ``TokenBudget``.
          attention_width: the encoder's width ``d`` (hidden size), to fit the buckets
            to its modelled FLOPs, attention included; ``None`` (default): to its
            tokens. For a feed-forward of width ``f`` other than ``4 d``, pass ``(2 d +
            f) / 6`` (dense ``8 d^2 + 4 d f`` against attention ``4 d n``); any positive
            number: larger weighs attention less.
          min_tokens: ``None`` (default): chunks of ``tokens``. Else the fit also tries
            chunks of ``tokens // 2``, ``tokens // 4``, ... down to ``min_tokens`` (and
            one row of ``padded_length``), fitting buckets to each, and keeps the
            size whose plan is cheapest (a smaller one only where it saves
            ``min_saving``): where a bucket fills about one chunk (a small batch per
            device), its last chunk is mostly padding rows, and smaller chunks waste
            less of it. ``tokens`` stays the most a chunk holds (memory); pass the
            smallest chunk that still keeps the device busy (``min_tokens >= tokens``:
            chunks of ``tokens``, as ``None``).

        Examples:
          >>> import numpy as np, gc_jax
          >>> lengths = np.random.default_rng(0).lognormal(np.log(40), 0.8, (8, 256))
          >>> sample = np.clip(lengths.astype(int), 1, 256)  # 8 batches of 256 rows
          >>> gc_jax.TokenBudget.for_lengths(sample, 4096, padded_length=256).buckets
          (40, 56, 96, 152, 256)
          >>> gc_jax.TokenBudget.for_lengths(sample, 8192, 256).buckets  # fewest tokens
          (48, 112, 256)
          >>> gc_jax.TokenBudget.for_lengths(sample, 8192, 256, attention_width=64).buckets
          (24, 48, 80, 112, 256)
          >>> small = gc_jax.TokenBudget.for_lengths(sample, 8192, 256, min_tokens=1024)
          >>> small.tokens, small.buckets  # smaller chunks: less of each last one empty
          (1024, (24, 48, 88, 136, 256))
        """
        method = f"{cls.__name__}.for_lengths"
        token_rows.check_fit(attention_width, max_buckets, multiple, min_saving, method)
        sample = token_rows.checked_lengths(sample, padded_length, method, "sample", "batches")
        cls(tokens, (padded_length,)).chunk_shapes(padded_length, sample.shape[1])  # checks
        token_rows.check_min_tokens(min_tokens, method)
        fit = lambda cost, starts=(): spans.propose_buckets(
            sample, padded_length, max_buckets, multiple, min_saving, cost, starts
        )

        def at(size: int) -> tuple[float, TokenBudget]:
            tokens_fitted = fit(spans.budget_cost(sample, size))
            buckets, cost = tokens_fitted, spans.budget_cost(sample, size, attention_width)
            if attention_width is not None:  # the tokens' buckets: a start greedy steps miss
                buckets = fit(cost, (tokens_fitted,))
            return cost(buckets), cls(size, buckets, lengths)

        return spans.fit_chunk_tokens(tokens, min_tokens, padded_length, min_saving, at)

    def bucket_lengths(self, padded_length: int) -> tuple[int, ...]:
        """The buckets a batch padded to ``padded_length`` tokens uses (the last is it)."""
        return token_rows.bucket_lengths(self.buckets, padded_length, type(self).__name__)

    def chunk_shapes(self, padded_length: int, rows: int) -> tuple[tuple[int, int], ...]:
        """``(rows, tokens)`` of each bucket's chunks: the shapes compiled, one per bucket.

        Args:
          padded_length: the batch's padded length (axis 1 of its token arrays).
          rows: the batch's rows (per device where ``tokens`` is per device).
        """
        return token_rows.chunk_shapes(self, padded_length, rows, "row")

    def chunk_counts(self, lengths: Any, padded_length: int) -> dict[tuple[int, int], int]:
        """``{(rows, tokens): chunks}``: the chunks of each shape the step encodes.

        The plan the step makes under ``jit`` (each bucket's leftover rows move up or
        fill a partial chunk, whichever encodes fewer tokens), computed here with
        NumPy, e.g. to log the padded share of the tokens a batch encodes.

        Args:
          lengths: each row's length as the step reads it (one past the mask's last
            nonzero position), ``[rows]``; or ``[devices, rows]``, each device's rows
            under ``shard_map`` or a sharded ``jit`` (every device runs the most
            chunks any device needs).
          padded_length: the batch's padded length.

        Examples:
          >>> import gc_jax
          >>> budget = gc_jax.TokenBudget(tokens=64, buckets=(8, 16))
          >>> budget.chunk_counts([3, 5, 16, 2, 7, 12, 4, 8, 1, 6], padded_length=16)
          {(8, 8): 1, (4, 16): 1}
        """
        method = f"{type(self).__name__}.chunk_counts"
        array = token_rows.checked_lengths(lengths, padded_length, method, "lengths", "devices")
        shapes = self.chunk_shapes(padded_length, array.shape[1])
        rows, sizes = tuple(r for r, _ in shapes), tuple(n for _, n in shapes)
        bucket = spans.bucket_of(array, sizes, np)
        _, _, chunks = spans.spans(bucket, rows, sizes, np)
        return {shape: int(c) for shape, c in zip(shapes, chunks.max(axis=0), strict=True)}


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

    num_chunks = None  # known only from the data (pass 1 keeps only the chunks asked for)
    rows_hint = ""

    @property
    def keepable(self) -> int:
        """The most chunks pass 1 can keep: those the last bucket can have."""
        return -(-(self.batch_size // self.num_shards) // self.rows[-1])

    def loops(self, keep: int = 0) -> list[tuple[Callable[[Any], BucketChunk], jax.Array]]:
        """One chunk loop per bucket: ``(index of turn j, traced number of turns)``,
        the last bucket's ``keep`` kept chunks left out (``token_rows.bucket_loops``)."""
        return token_rows.bucket_loops(self.trips, keep)

    def has_tail(self, keep: int = 0) -> bool:
        """False: every chunk is in :meth:`loops` or :meth:`kept`."""
        return False

    def kept(self, keep: int) -> tuple[Callable[[Any], BucketChunk], int]:
        """The kept chunks: the last bucket's last ``keep`` (``token_rows.kept_turns``)."""
        return token_rows.kept_turns(self.trips, keep)

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
        if index.kept:  # a turn before the bucket's first: no row (token_rows.kept_turns)
            valid = valid & (pos >= 0)
            at = jnp.where(pos >= 0, at, jnp.maximum(end - 1, 0))
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
            x = x[:, :length] if self._trimmed(x) else x
            return token_rows.gather(x, rows, self.num_shards)

        return jax.tree.map(one, tree)

    def take_cotangent(self, tree: PyTree, index: BucketChunk) -> PyTree:
        """The chunk's rows of a representation gradient; zero on padding rows."""
        return token_rows.take_rows(tree, *self.where(index), self.num_shards)

    def put(self, buffer: PyTree, chunk: PyTree, index: BucketChunk) -> PyTree:
        """Writes the chunk's real rows (not its padding rows) into ``buffer``, in place.

        A chunk leaf shorter than its buffer along axis 1 (a trimmed sequence leaf)
        fills the leading positions.
        """
        return token_rows.put_rows(buffer, chunk, *self.where(index), self)

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
        about as fast as the cached step (docs/benchmarks/token_budgets.md, "The testing
        reference compiles as fast as the step").
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


def make_plan(batch: PyTree, budget: TokenBudget, name: str,
              layout: _layout.Layout = _layout.SINGLE) -> TokenPlan:  # fmt: skip
    """Plans the bucket chunks of ``batch`` (traced lengths; static shapes)."""
    num_shards = layout.array_shards
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    padded = token_rows.padded_length(batch, budget, name)
    token_rows.warn_float_columns(batch, padded, name, budget)
    shapes = budget.chunk_shapes(padded, batch_size // num_shards)
    rows, lengths = tuple(r for r, _ in shapes), tuple(n for _, n in shapes)
    length = token_rows.row_lengths(batch, budget, name).reshape(num_shards, -1)
    bucket = spans.bucket_of(length, lengths, jnp)
    order = jnp.argsort(bucket, axis=1, stable=True)
    starts, ends, chunks = spans.spans(bucket, rows, lengths, jnp)
    trips = jnp.max(chunks, axis=0)
    return TokenPlan(batch_size, num_shards, padded, lengths, rows, order, starts, ends, trips,
                     layout)  # fmt: skip
