"""``TokenPacking``: ``chunk_size`` counted in tokens, rows packed into lines of one shape.

The packing itself (its checks, the chunk shape it compiles, and the number of chunks a
batch needs, with NumPy); how a batch is packed under ``jit`` is
``gc_jax._packed_chunks``'s, and the encoder's side of it is :mod:`gc_jax.packing`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from gc_jax import _token_spans
from gc_jax._base import PyTree


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

    Examples:
      >>> import gc_jax
      >>> packing = gc_jax.TokenPacking(tokens=512, segments=4)
      >>> packing.chunk_shape(padded_length=128, rows=256)  # (lines, tokens)
      (4, 128)
      >>> lengths = [100, 20, 30, 128, 60, 40, 8, 70, 90, 120]
      >>> packing.chunk_counts(lengths, padded_length=128)  # 10 rows in 6 lines
      {(4, 128): 2}
    """

    tokens: int
    segments: int
    lengths: str | Callable[[PyTree], jax.Array] = "attention_mask"

    def __post_init__(self):
        for name in ("tokens", "segments"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value <= 0:
                raise TypeError(f"TokenPacking {name} must be a positive int, got {value!r}.")
        if self.segments < 2:
            raise ValueError(
                f"TokenPacking segments must be at least 2 (rows per line), got "
                f"{self.segments}; one row per line is not packing: use an int chunk_size "
                "or a gc_jax.TokenBudget."
            )
        if not (isinstance(self.lengths, str) or callable(self.lengths)):
            raise TypeError(
                "TokenPacking lengths must be the key of the attention mask in a dict batch "
                f"(a str) or a callable lengths(batch) -> int[rows], got {self.lengths!r}."
            )
        object.__setattr__(self, "tokens", int(self.tokens))
        object.__setattr__(self, "segments", int(self.segments))

    @classmethod
    def for_lengths(
        cls, sample: Any, tokens: int, padded_length: int, *, lengths: Any = "attention_mask"
    ) -> TokenPacking:
        """A packing whose ``segments`` never limits the lines of batches like ``sample``.

        ``segments`` is the most rows any line holds when the sample's batches are
        packed without a limit (at least 2): with it, they are packed into the same
        lines as without one; fewer may need more lines, more only adds empty output
        slots (each slot is one output row).

        Args:
          sample: row lengths (padding excluded), ``[rows]`` for one batch or
            ``[batches, rows]``, each row a batch as the step sees it (per device under
            ``shard_map`` or a sharded ``jit``): e.g. ``mask.sum(-1)`` of a few batches.
          tokens: as ``TokenPacking``.
          padded_length: the batches' padded length (the line length).
          lengths: as ``TokenPacking``.

        Examples:
          >>> import numpy as np, gc_jax
          >>> lengths = np.random.default_rng(0).lognormal(np.log(40), 0.8, (8, 256))
          >>> sample = np.clip(lengths.astype(int), 1, 256)  # 8 batches of 256 rows
          >>> gc_jax.TokenPacking.for_lengths(sample, 4096, padded_length=256).segments
          9
        """
        what = "TokenPacking.for_lengths sample"
        array = _token_spans.checked_lengths(sample, padded_length, what, "batches")
        cls(tokens, 2, lengths).chunk_shape(padded_length, array.shape[1])  # checks
        most = max(len(line) for row in array for line in pack_lines(row, padded_length,
                                                                      padded_length))  # fmt: skip
        return cls(tokens, max(most, 2), lengths)

    def chunk_shape(self, padded_length: int, rows: int) -> tuple[int, int]:
        """``(lines, tokens)`` of every chunk: the one shape compiled.

        Args:
          padded_length: the batch's padded length (axis 1 of its token arrays).
          rows: the batch's rows (per device where ``tokens`` is per device).
        """
        if self.tokens < padded_length:
            raise ValueError(
                f"TokenPacking(tokens={self.tokens}) is smaller than one line of the batch's "
                f"padded length ({padded_length} tokens); pass tokens of at least "
                f"{padded_length}, e.g. tokens={padded_length * 16} for chunks of 16 lines."
            )
        return min(self.tokens // padded_length, rows), padded_length

    def chunk_counts(self, lengths: Any, padded_length: int) -> dict[tuple[int, int], int]:
        """``{(lines, tokens): chunks}``: the chunks the step encodes, computed with NumPy.

        Args:
          lengths: each row's length (one past the mask's last nonzero position),
            ``[rows]``; or ``[devices, rows]`` (every device runs the most chunks any
            device needs).
          padded_length: the batch's padded length.
        """
        array = _token_spans.checked_lengths(lengths, padded_length, "TokenPacking.chunk_counts "
                                             "lengths", "devices")  # fmt: skip
        shape = self.chunk_shape(padded_length, array.shape[1])
        lines = max(len(pack_lines(row, padded_length, self.segments)) for row in array)
        return {shape: -(-lines // shape[0])}


def pack_lines(lengths: Any, line_length: int, segments: int) -> list[list[int]]:
    """The lines of one device's rows, with NumPy: each line's rows, as positions in the
    rows sorted longest first (a row of length 0 takes a line of its own).

    A line takes the longest row left, then the shortest rows left while they fit and
    it has fewer than ``segments`` rows (the shortest left not fitting, none does).
    """
    ordered = np.asarray(lengths)
    ordered = np.sort(np.where(ordered > 0, ordered, line_length), kind="stable")[::-1]
    front, back, lines = 0, len(ordered) - 1, []
    while front <= back:
        lines.append([front])
        used, front = int(ordered[front]), front + 1
        while front <= back and len(lines[-1]) < segments and used + ordered[back] <= line_length:
            lines[-1].append(back)
            used, back = used + int(ordered[back]), back - 1
    return lines
