"""``TokenPacking``: ``chunk_size`` counted in tokens, rows packed into lines.

The config (:class:`TokenPacking`: checks, chunk shapes, chunks and lines a batch
needs with NumPy, :meth:`TokenPacking.for_lengths`'s fit), its plan (:class:`PackPlan`)
and :func:`make_plan`; the encoder's side of it is :mod:`gc_jax.packing`.

Under ``jax.jit`` the lengths are traced data. Each row goes to its bucket, the
shortest line length that holds it (one bucket, ``L``, without ``buckets``). For each
bucket, each shard's rows of the bucket are sorted longest first (a stable
``argsort``) and placed by one ``lax.scan`` over them: a line takes the longest row
left, then the shortest rows left while they fit and it holds fewer than
``segments`` rows (:mod:`~gc_jax._chunks.placement` does the same with NumPy). A
line's rows are consecutive in the order of placement, so a bucket's plan is a few ``[rows]``
arrays: that order, the lengths in it, their running sum and where each line starts.
Chunk ``c`` of a bucket holds its lines ``c * lines .. (c + 1) * lines - 1``; their
token gather is computed when the chunk is taken. The number of chunks is traced, so
the passes run one loop per bucket with a traced trip count (as for a
``TokenBudget``). The cache stays in the batch's order; an output row per *slot* (a
line's ``k``-th row) is written to its row.
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
from gc_jax._chunks.placement import lines_by_bucket, pack_lines
from gc_jax._chunks.token_rows import MASK, BucketChunk

SEGMENT_IDS, POSITION_IDS, SEGMENT_STARTS = "segment_ids", "position_ids", "segment_starts"
"""The keys a packed chunk adds for the encoder (:mod:`gc_jax.packing` reads them)."""


@dataclasses.dataclass(frozen=True)
class TokenPacking:
    """Chunks of ``tokens`` tokens, each row's tokens packed next to other rows'.

    Pass it as ``chunk_size`` (to ``cached_value_and_grad``, ``make_train_step``,
    ``chunked_encoder`` or ``GradCache``) for an input that is a dict batch of padded
    token sequences, encoded by an encoder that reads the packing keys (below).

    Every chunk is ``tokens // L`` *lines* of ``L`` tokens, ``L`` the batch's padded
    length: one chunk shape, so the step compiles the encoder once (as with an int
    ``chunk_size``), yet encodes almost no padding. Rows are sorted by length
    (longest first) and packed next-fit: a line takes rows until the next does not fit
    or it holds ``segments`` rows. A row is never split, and never cut: its tokens are
    those before one past its mask's last nonzero position. A row without tokens takes
    a line of its own, ``L`` tokens, as the batch holds it unpacked (its tokens attend
    to no key, so e.g. its first token's output depends on all ``L`` of them).

    What the encoder receives: every ``[rows, L, ...]`` leaf packed to
    ``[lines, L, ...]`` (zero where no row lies), every other leaf taken per *slot*
    (``[lines * segments, ...]``), and three more keys:

    * ``"segment_ids"``, ``int32[lines, L]``: ``k + 1`` on the tokens of the line's
      ``k``-th row, 0 on padding. A token must attend only to its own row's tokens;
    * ``"position_ids"``, ``int32[lines, L]``: each token's position in its row (kept
      from the batch where it has a ``"position_ids"`` leaf);
    * ``"segment_starts"``, ``int32[lines, segments]``: where each slot's row starts
      (0 for an empty slot).

    It must return one output row per slot, ``[lines * segments, ...]`` (slot ``k`` of
    line ``r`` at ``r * segments + k``), and the ordinary ``[rows, ...]`` for a batch
    without these keys. Empty slots (a line with fewer rows) are not written and get
    a zero gradient, but must not be zero vectors where the output is normalised (the
    gradient of a norm at zero is NaN): the helpers pool them as the line's first
    row, and a chunk's lines past the data repeat a real line. :mod:`gc_jax.packing` does both
    (``attention_mask``, ``mean_pool``, ``first_token``); ``gc_jax.testing``
    checks an encoder against the unpacked batch.

    Attributes:
      tokens: lines x padded length of every chunk (per device under ``shard_map`` or
        a sharded ``jit``, like ``chunk_size``); at least the padded length.
      segments: the most rows a line holds (at least 2): the encoder's output has
        ``segments`` slots per line. About ``L`` over the median row length packs
        lines full; more slots cost output rows, not tokens.
      lengths: where each row's length comes from, as ``TokenBudget``: the key of the
        attention mask (default), or ``lengths(batch) -> int[rows]``.
      buckets: ``None`` (default): every line is ``L`` tokens. Or increasing line
        lengths, as ``TokenBudget``'s buckets (a batch padded to ``L`` uses those
        shorter than ``L``, and ``L``): each row is packed into lines of the shortest
        bucket that holds it, one chunk shape (``tokens // n`` lines of ``n``) and one
        chunk loop per bucket. With dense attention over each line, short rows then
        spend less on attention to other rows; :meth:`for_lengths` with
        ``attention_width`` fits them.

    Examples:
      >>> import gc_jax
      >>> packing = gc_jax.TokenPacking(tokens=512, segments=4)
      >>> packing.chunk_shapes(padded_length=128, rows=256)  # (lines, tokens)
      ((4, 128),)
      >>> lengths = [100, 20, 30, 128, 60, 40, 8, 70, 90, 120]
      >>> packing.chunk_counts(lengths, padded_length=128)  # 10 rows in 6 lines
      {(4, 128): 2}
      >>> bucketed = gc_jax.TokenPacking(tokens=512, segments=4, buckets=(32, 64, 128))
      >>> bucketed.chunk_counts(lengths, padded_length=128)  # 9 lines of 32, 64 or 128
      {(10, 32): 1, (8, 64): 1, (4, 128): 2}
    """

    tokens: int
    segments: int
    lengths: str | Callable[[PyTree], jax.Array] = MASK
    buckets: tuple[int, ...] | None = None

    def __post_init__(self):
        kind = type(self).__name__
        for name in ("tokens", "segments"):
            token_rows.positive_int(getattr(self, name), f"{kind}({name}=...)")
        if self.segments < 2:
            raise ValueError(
                f"{kind}(segments=...) must be at least 2 (rows per line), got "
                f"{self.segments}; one row per line is not packing: use an int chunk_size "
                "or a gc_jax.TokenBudget."
            )
        token_rows.check_lengths_source(self.lengths, kind)
        object.__setattr__(self, "tokens", int(self.tokens))
        object.__setattr__(self, "segments", int(self.segments))
        if self.buckets is not None:
            object.__setattr__(self, "buckets", token_rows.checked_buckets(self.buckets, kind))

    @classmethod
    def for_lengths(
        cls, sample: Any, tokens: int, padded_length: int, *, lengths: Any = MASK,
        attention_width: float | None = None, max_buckets: int = 5, multiple: int = 8,
        min_saving: float = 0.01, min_tokens: int | None = None,
    ) -> TokenPacking:  # fmt: skip
        """A packing for batches like ``sample``: its line lengths and ``segments``.

        Without ``attention_width``, every line is ``padded_length`` tokens (``buckets``
        None): the fewest tokens. With it, ``buckets`` are fitted to the encoder's
        modelled FLOPs, attention included, as ``TokenBudget.for_lengths`` fits its
        buckets: a line of ``n`` tokens costs ``n * (1 + n / (6 * attention_width))``
        with dense attention over the line, so short rows packed into short lines
        spend less on attention to other rows than in lines of ``padded_length``.

        ``segments`` is then the most rows any line holds when the sample's batches
        are packed without a limit (at least 2): with it, they are packed into the same
        lines as without one; fewer may need more lines, more only adds empty output
        slots (each slot is one output row).

        Args:
          sample: row lengths (padding excluded), ``[rows]`` for one batch or
            ``[batches, rows]``, each row a batch as the step sees it (per device under
            ``shard_map`` or a sharded ``jit``): e.g. ``mask.sum(-1)`` of a few batches.
          tokens: as ``TokenPacking``.
          padded_length: the batches' padded length (the longest line).
          lengths: as ``TokenPacking``.
          attention_width: the encoder's width ``d``, as ``TokenBudget.for_lengths``;
            ``None`` (default): one line length.
          max_buckets: at most this many line lengths, ``padded_length`` included
            (each is one more compiled chunk shape).
          multiple: every line length but ``padded_length`` is a multiple of it.
          min_saving: the share of the modelled FLOPs a line length must save to be
            added.
          min_tokens: ``None`` (default): chunks of ``tokens``. Else the fit also tries
            chunks of ``tokens // 2``, ``tokens // 4``, ... down to ``min_tokens`` (and
            one line of ``padded_length``), and keeps the size whose chunks cost least
            (tokens, or the modelled FLOPs with ``attention_width``; a smaller size
            only where it saves ``min_saving``), as ``TokenBudget.for_lengths``: where
            a line length fills about one chunk, its last chunk is mostly empty lines.

        Examples:
          >>> import numpy as np, gc_jax
          >>> lengths = np.random.default_rng(0).lognormal(np.log(40), 0.8, (8, 256))
          >>> sample = np.clip(lengths.astype(int), 1, 256)  # 8 batches of 256 rows
          >>> gc_jax.TokenPacking.for_lengths(sample, 4096, padded_length=256).segments
          9
          >>> packing = gc_jax.TokenPacking.for_lengths(sample, 4096, 256, attention_width=32)
          >>> packing.buckets, packing.segments
          ((40, 256), 4)
          >>> gc_jax.TokenPacking.for_lengths(sample, 8192, 256, min_tokens=1024).tokens
          1024
        """
        method = f"{cls.__name__}.for_lengths"
        array = token_rows.checked_lengths(sample, padded_length, method, "sample", "batches")
        cls(tokens, 2, lengths).chunk_shapes(padded_length, array.shape[1])  # checks
        token_rows.check_fit(attention_width, max_buckets, multiple, min_saving, method)
        token_rows.check_min_tokens(min_tokens, method)

        def at(size: int) -> tuple[float, tuple[int, tuple[int, ...] | None]]:
            cost, buckets = _lines_cost(array, size, padded_length, attention_width), None
            if attention_width is not None:
                found = spans.propose_buckets(array, padded_length, max_buckets, multiple,
                                              min_saving, cost)  # fmt: skip
                buckets = found if len(found) > 1 else None
            return cost(buckets or (padded_length,)), (size, buckets)

        size, buckets = spans.fit_chunk_tokens(tokens, min_tokens, padded_length, min_saving, at)
        widths = (padded_length,) if buckets is None else buckets
        most = max(len(line) for row in array for b in lines_by_bucket(row, widths) for line in b)
        return cls(size, max(most, 2), lengths, buckets)

    def bucket_lengths(self, padded_length: int) -> tuple[int, ...]:
        """The line lengths a batch padded to ``padded_length`` tokens uses (the last is
        it): ``buckets`` shorter than it, and it."""
        if self.buckets is None:
            return (padded_length,)
        return token_rows.bucket_lengths(self.buckets, padded_length, type(self).__name__)

    def chunk_shapes(self, padded_length: int, rows: int) -> tuple[tuple[int, int], ...]:
        """``(lines, tokens)`` of each line length's chunks: the shapes compiled.

        Args:
          padded_length: the batch's padded length (axis 1 of its token arrays).
          rows: the batch's rows (per device where ``tokens`` is per device).
        """
        return token_rows.chunk_shapes(self, padded_length, rows, "line")

    def chunk_counts(self, lengths: Any, padded_length: int) -> dict[tuple[int, int], int]:
        """``{(lines, tokens): chunks}``: the chunks the step encodes, computed with NumPy.

        Args:
          lengths: each row's length (one past the mask's last nonzero position),
            ``[rows]``; or ``[devices, rows]`` (every device runs the most chunks any
            device needs).
          padded_length: the batch's padded length.
        """
        method = f"{type(self).__name__}.chunk_counts"
        array = token_rows.checked_lengths(lengths, padded_length, method, "lengths", "devices")
        shapes = self.chunk_shapes(padded_length, array.shape[1])
        widths = tuple(n for _, n in shapes)
        lines = np.array(
            [[len(b) for b in lines_by_bucket(row, widths, self.segments)] for row in array]
        ).max(axis=0)
        return {shape: int(-(-k // shape[0])) for shape, k in zip(shapes, lines, strict=True)}

    def lines(self, lengths: Any, padded_length: int) -> dict[int, list[list[int]]]:
        """``{line length: lines}``, each line the indices of its rows in ``lengths`` (one
        device's ``[rows]``) in the order the step places them, computed with NumPy.

        >>> TokenPacking(tokens=64, segments=3).lines([10, 30, 5, 16, 0, 12], 32)
        {32: [[4], [1], [3, 2, 0], [5]]}
        """
        if np.ndim(lengths) != 1:
            raise ValueError(
                f"TokenPacking.lines(lengths=...) takes [rows], got {np.shape(lengths)}."
            )
        array = token_rows.checked_lengths(
            lengths, padded_length, "TokenPacking.lines", "lengths", "rows"
        )[0]
        widths = tuple(n for _, n in self.chunk_shapes(padded_length, array.size))
        rows = np.where(array > 0, array, widths[-1])
        bucket, out = spans.bucket_of(rows, widths, np), {}
        for c, n in enumerate(widths):  # each bucket's rows, longest first (a stable sort)
            mine = np.flatnonzero(bucket == c)
            order = mine[np.argsort(-rows[mine], kind="stable")]
            out[n] = [order[line].tolist() for line in pack_lines(rows[mine], n, self.segments)]
        return out


def _lines_cost(sample: np.ndarray, tokens: int, padded_length: int,
                attention_width: float | None):  # fmt: skip
    """``cost(widths)``: the mean modelled FLOPs (``spans.chunk_costs``; tokens where
    ``attention_width`` is None) of the chunks of packed lines the step encodes for the
    batches of ``sample``, rows packed without a limit. The cost of each line length's
    span of lengths is kept: the fit tries the same spans many times."""
    rows, kept = sample.shape[1], {}
    sample = np.where(sample > 0, sample, padded_length)  # a row without tokens: a line

    def span(low: int, n: int) -> float:
        if (low, n) not in kept:
            lines = min(tokens // n, rows)
            inside = (sample > low) & (sample <= n)
            rows_in = [r[k] for r, k in zip(sample, inside, strict=True)]
            count = np.array([len(pack_lines(r, n, n)) for r in rows_in])
            chunk = spans.chunk_costs((lines,), (n,), attention_width)[0]
            kept[low, n] = float((-(-count // lines)).mean() * chunk)
        return kept[low, n]

    return lambda widths: sum(map(span, (0, *widths[:-1]), widths))


class Lines(NamedTuple):
    """Where chunk ``c``'s lines take their tokens and rows (one shard; traced)."""

    rows: jax.Array  # [lines, segments]: each slot's row in the batch (within the shard)
    valid: jax.Array  # [lines, segments]: which slots hold a row
    starts: jax.Array  # [lines, segments]: where each slot's row starts in its line
    source: jax.Array  # [lines, L]: each token's place in the shard's [rows * L] tokens
    segment: jax.Array  # [lines, L]: k + 1 on the k-th slot's tokens, 0 on padding
    position: jax.Array  # [lines, L]: each token's position in its row


class PackPlan(NamedTuple):
    """How one batch is packed (a :class:`gc_jax._chunks.plan.Plan`; the arrays are traced).

    Each row goes to the shortest line length that holds it (its *bucket*; one with
    ``buckets`` None); each bucket's rows are packed into lines of its length, and its
    chunks run in a loop of their own. Arrays have a leading axis of buckets ``C``.

    Attributes:
      batch_size: total rows ``B``.
      num_shards: contiguous shards the rows are spread over (devices, under jit);
        each is packed on its own.
      padded: the batch's padded length ``L``.
      lengths: each bucket's line length (the last is ``L``).
      lines: lines per shard of each bucket's chunks.
      segments: slots per line.
      order: ``[C, S, B / S]``: each shard's rows, the bucket's first, in the order
        they are placed in its lines.
      sizes: ``[C, S, B / S]``: their lengths (at least 1) in that order.
      before: ``[C, S, B / S + 1]``: the tokens of the rows before each, in that order.
      first: ``[C, S, B / S + 1]``: where each line starts in the order (``B / S``
        past the last line).
      used: ``[C, S]``: lines of each bucket and shard.
      trips: ``[C]``: chunks of each bucket (the most any shard needs).
      layout: how the rows lie across devices (``gc_jax._layout.Layout``).
    """

    batch_size: int
    num_shards: int
    padded: int
    lengths: tuple[int, ...]
    lines: tuple[int, ...]
    segments: int
    order: jax.Array
    sizes: jax.Array
    before: jax.Array
    first: jax.Array
    used: jax.Array
    trips: jax.Array
    layout: _layout.Layout = _layout.SINGLE

    num_chunks = None  # known only from the data (pass 1 keeps only the chunks asked for)
    rows_hint = (
        "; with a TokenPacking the encoder returns one row per slot, [lines * segments, "
        "...] (see gc_jax.packing.mean_pool)"
    )

    @property
    def keepable(self) -> int:
        """The most chunks pass 1 can keep: those the last bucket can have."""
        return -(-(self.batch_size // self.num_shards) // self.lines[-1])

    def loops(self, keep: int = 0) -> list:
        """One chunk loop per bucket: ``(index of turn j, traced number of turns)``,
        the last bucket's ``keep`` kept chunks left out (``token_rows.bucket_loops``)."""
        return token_rows.bucket_loops(self.trips, keep)

    def has_tail(self, keep: int = 0) -> bool:
        return False

    def kept(self, keep: int) -> tuple:
        """The kept chunks: the last bucket's last ``keep`` (``token_rows.kept_turns``)."""
        return token_rows.kept_turns(self.trips, keep)

    def pack(self, batch: PyTree, wrt: tuple[bool, ...]) -> PyTree:
        if any(wrt):
            raise ValueError(
                "a TokenPacking batch cannot be differentiated (its leaves are packed "
                "token by token); differentiate the parameters only, or pass an int "
                "chunk_size or a gc_jax.TokenBudget for this input."
            )
        return batch

    def samples(self) -> list[BucketChunk]:
        """A chunk of every bucket (for the output shapes)."""
        return [BucketChunk(c, 0) for c in range(len(self.lines))]

    def number(self, index: BucketChunk) -> jax.Array:
        """The chunk's number in the batch (its key is ``fold_in(rng, number)``)."""
        return jnp.sum(self.trips[: index.bucket]) + index.turn

    def rows_of(self, index: BucketChunk) -> int:
        """Output rows per shard of a chunk: one per slot."""
        return self.lines[index.bucket] * self.segments

    def where(self, index: BucketChunk) -> Lines:
        """Chunk ``index``'s lines, each shard's (leading axis: shards)."""
        c = index.bucket
        lines = lambda *a: self._lines(index, self.lengths[c], self.lines[c], *a)
        return jax.vmap(lines)(self.order[c], self.sizes[c], self.before[c], self.first[c],
                               self.used[c])  # fmt: skip

    def _lines(self, index, length, count, order, sizes, before, first, used) -> Lines:
        n = order.shape[0]
        line = index.turn * count + jnp.arange(count)
        in_data = line < used
        if index.kept:  # a turn before the bucket's first: no row (token_rows.kept_turns)
            in_data, line = in_data & (line >= 0), jnp.maximum(line, 0)
        # A line past the data repeats the last line, whose slots are not written (so no
        # line is empty, whose pooled output, normalised, has a NaN gradient); a shard
        # with no line of this bucket has one made up (see make_plan).
        line = jnp.minimum(line, jnp.maximum(used, 1) - 1)
        start, end = first[line], first[line + 1]
        at = start[:, None] + jnp.arange(self.segments)  # [lines, segments]
        filled = at < end[:, None]
        valid = filled & in_data[:, None]
        at = jnp.minimum(at, n - 1)
        offset = jnp.where(filled, before[at] - before[start][:, None], length)
        tokens = jnp.arange(length)
        slot = jnp.sum(offset[:, None, :] <= tokens[None, :, None], axis=-1) - 1  # [lines, n]
        slot = jnp.maximum(slot, 0)
        take = lambda a: jnp.take_along_axis(a, slot, axis=1)
        within = tokens[None, :] - take(offset)
        token = (within >= 0) & (within < take(sizes[at]))  # a row's token, not padding
        row = order[at]
        source = take(row) * self.padded + jnp.clip(within, 0, length - 1)
        return Lines(
            row, valid, jnp.where(filled, offset, 0), source,
            jnp.where(token, slot + 1, 0), jnp.where(token, within, 0),
        )  # fmt: skip

    def _trimmed(self, x: jax.Array) -> bool:
        return x.ndim >= 2 and x.shape[1] == self.padded

    def take(self, tree: PyTree, index: BucketChunk) -> PyTree:
        """The chunk: token leaves packed into lines, other leaves per slot, and the
        packing keys (``segment_ids``, ``position_ids``, ``segment_starts``)."""
        lines = self.where(index)
        real = lines.segment > 0
        shards, n = self.num_shards, self.batch_size // self.num_shards
        count, length = self.lines[index.bucket], self.lengths[index.bucket]

        def one(x):
            if not self._trimmed(x):
                return token_rows.take_rows(x, *self._slots(lines), shards)
            reshape = self.layout.reshape  # the shards stay split over the devices
            flat = reshape(x, (shards, n * self.padded, *x.shape[2:]))
            at = lines.source.reshape(shards, -1, *[1] * (x.ndim - 2))
            piece = jnp.take_along_axis(flat, at, axis=1)
            piece = reshape(piece, (shards * count, length, *x.shape[2:]))
            keep = real.reshape(-1, length, *[1] * (x.ndim - 2))
            return jnp.where(keep, piece, jnp.zeros_like(piece))

        chunk = dict(jax.tree.map(one, tree))
        lined = (shards * count,)
        flat = lambda a: self.layout.reshape(a, (*lined, *a.shape[2:])).astype(jnp.int32)
        chunk[SEGMENT_IDS] = flat(lines.segment)
        chunk.setdefault(POSITION_IDS, flat(lines.position))
        chunk[SEGMENT_STARTS] = flat(lines.starts)
        return chunk

    def take_cotangent(self, tree: PyTree, index: BucketChunk) -> PyTree:
        """The chunk's slots of a representation gradient; zero on empty slots."""
        lines = self.where(index)
        return token_rows.take_rows(tree, *self._slots(lines), self.num_shards)

    def _slots(self, lines: Lines) -> tuple[jax.Array, jax.Array]:
        return (lines.rows.reshape(self.num_shards, -1), lines.valid.reshape(self.num_shards, -1))

    def put(self, buffer: PyTree, chunk: PyTree, index: BucketChunk) -> PyTree:
        """Writes the chunk's slots (not its empty ones) to their rows of ``buffer``."""
        return token_rows.put_rows(buffer, chunk, *self._slots(self.where(index)), self)

    def same_outputs(self, shapes: list[PyTree], name: str) -> PyTree:
        """Checks that every bucket's chunk gives outputs of one shape; returns the first."""
        for c, other in enumerate(shapes[1:], 1):
            if found := _validation.first_mismatch(shapes[0], other):
                where, x, y = found
                raise ValueError(
                    f"{name} returned {where} of shape {tuple(x.shape)} ({x.dtype}) for "
                    f"lines of {self.lengths[0]} tokens but {tuple(y.shape)} ({y.dtype}) for "
                    f"lines of {self.lengths[c]} tokens; with a TokenPacking every output is "
                    "one representation per slot, [lines * segments, ...], whose shape does "
                    "not depend on the line's length (pool each row, gc_jax.packing.mean_pool)."
                )
        return shapes[0]

    def reference(self, encode, params: PyTree, batch: PyTree, key, trim: bool = True) -> PyTree:
        """``trim``: every chunk this plan can cut (with its key; a chunk past the data's
        lines writes no row), scattered back to the batch's order, differentiably (the
        reference of ``gc_jax.testing``; one shard). Not ``trim``: the batch unpacked,
        ``encode(params, batch, key)``, as the encoder sees it without a packing."""
        if not trim:
            return encode(params, batch, key)

        def encoded(chunk):
            return encode(params, self.take(batch, chunk), _keys.chunk_key(key, self.number(chunk)))

        shapes = [jax.eval_shape(lambda c=c: encoded(c)) for c in self.samples()]
        zeros = lambda r: jnp.zeros((self.batch_size, *r.shape[1:]), r.dtype)
        out = jax.tree.map(zeros, self.same_outputs(shapes, "encode"))
        for c, count in enumerate(self.lines):

            def turn(out, t, c=c):
                rows, valid = self._slots(self.where(BucketChunk(c, t)))
                rows = jnp.where(valid, rows, self.batch_size).reshape(-1)  # empty: dropped
                put = lambda o, r: o.at[rows].set(r.astype(o.dtype), mode="drop")
                return jax.tree.map(put, out, encoded(BucketChunk(c, t))), None

            out, _ = jax.lax.scan(turn, out, jnp.arange(-(-self.batch_size // count)))
        return out


def _place(sizes: jax.Array, line_length: Any, segments: int, count: jax.Array):
    """Lines of a shard's first ``count`` rows, ``sizes`` their lengths longest first (as
    :func:`~gc_jax._chunks.placement.pack_lines`, by one ``lax.scan`` over the rows).

    Returns:
      ``(placed, first)``: ``placed[i]``, the position in ``sizes`` of the ``i``-th
      row placed (``i`` itself from ``count`` on); ``first[k]``, where line ``k``
      starts among the placed rows (``[n + 1]``, ``n`` past the last line).
    """
    n = sizes.shape[0]

    def step(carry, i):
        front, back, used, slots = carry
        back_size = sizes[jnp.maximum(back, 0)]
        more = (slots > 0) & (slots < segments) & (used + back_size <= line_length)
        at = jnp.where(more, back, front)
        moved = (
            front + (~more), back - more, jnp.where(more, used, 0) + sizes[at],
            jnp.where(more, slots, 0) + 1,
        )  # fmt: skip
        live = i < count
        carry = jax.tree.map(lambda a, b: jnp.where(live, a, b), moved, carry)
        return carry, (jnp.where(live, at, i), live & ~more)

    zero = sizes[0] * 0  # typed like the rows (varying over a shard_map axis)
    carry = (zero, zero + count - 1, zero, zero)
    _, (placed, new) = jax.lax.scan(step, carry, jnp.arange(n, dtype=zero.dtype))
    line = jnp.cumsum(new) - 1
    at = jnp.where(new, line, n + 1)  # a line's first row; the others are dropped
    first = jnp.full((n + 1,), n, jnp.int32).at[at].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    return placed, first


def _bucket_lines(length, bucket, c, width, segments):
    """Bucket ``c``'s lines of ``width`` tokens, every shard's: ``order, sizes, before,
    first, used`` (see :class:`PackPlan`). The bucket's rows come first, longest first,
    then the others, shortest first: a shard without rows of the bucket gets one made-up
    line holding its shortest row (cut to ``width``; nothing of it is written), so that
    no line is empty."""
    mine = bucket == c
    order = jnp.argsort(jnp.where(mine, -length, length + width), axis=1, stable=True)
    sizes = jnp.take_along_axis(length, order, axis=1)
    count = jnp.sum(mine, axis=1).astype(sizes.dtype)
    placed, first = jax.vmap(lambda s, k: _place(s, width, segments, k))(sizes, count)
    order = jnp.take_along_axis(order, placed, axis=1)
    sizes = jnp.take_along_axis(sizes, placed, axis=1)
    before = jnp.concatenate([jnp.zeros_like(sizes[:, :1]), jnp.cumsum(sizes, axis=1)], axis=1)
    used = jnp.sum(first < order.shape[1], axis=1)
    # The last line ends at the bucket's last row (the other buckets' rows follow it).
    first = jnp.where(jnp.arange(first.shape[1]) == used[:, None], count[:, None], first)
    made_up = jnp.where((used == 0)[:, None], jnp.arange(2), first[:, :2])
    return order, sizes, before, first.at[:, :2].set(made_up), used


def make_plan(batch: PyTree, packing: TokenPacking, name: str,
              layout: _layout.Layout = _layout.SINGLE) -> PackPlan:  # fmt: skip
    """Packs ``batch`` (traced lengths; static shapes)."""
    if not hasattr(batch, "keys"):
        raise TypeError(
            f"a TokenPacking packs a dict batch of token arrays, but {name} is a "
            f"{type(batch).__name__}; pass a dict such as {{'input_ids': ..., "
            "'attention_mask': ...}."
        )
    if SEGMENT_IDS in batch or SEGMENT_STARTS in batch:
        raise ValueError(
            f"{name} already has a {SEGMENT_IDS!r} or {SEGMENT_STARTS!r} key, which a "
            "TokenPacking adds to every chunk; pass the batch unpacked, one row per sequence."
        )
    num_shards = layout.array_shards
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    padded = token_rows.padded_length(batch, packing, name)
    token_rows.warn_float_columns(batch, padded, name, packing)
    shapes = packing.chunk_shapes(padded, batch_size // num_shards)
    lines, widths = tuple(r for r, _ in shapes), tuple(n for _, n in shapes)
    length = token_rows.row_lengths(batch, packing, name).reshape(num_shards, -1)
    # A row without tokens takes a line of its own, as the unpacked batch encodes it: its
    # tokens attend to no key, so e.g. its first token's output depends on all L of them.
    length = jnp.where(length > 0, length, padded).astype(jnp.int32)
    bucket = spans.bucket_of(length, widths, jnp)
    arrays = [_bucket_lines(length, bucket, c, n, packing.segments) for c, n in enumerate(widths)]
    order, sizes, before, first, used = (jnp.stack(a) for a in zip(*arrays, strict=True))
    trips = jnp.max(-(-used // jnp.asarray(lines)[:, None]), axis=1)
    return PackPlan(batch_size, num_shards, padded, widths, lines, packing.segments, order,
                    sizes, before, first, used, trips, layout)  # fmt: skip
