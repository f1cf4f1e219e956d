"""``TokenBudget``: ``chunk_size`` counted in tokens, for batches of padded sequences.

The budget itself (its buckets, checks, the chunk shapes it compiles, and buckets fitted
to a sample of lengths); how a batch is cut by it is ``gc_jax._token_chunks``'s.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from gc_jax import _token_spans
from gc_jax._base import PyTree

MASK = "attention_mask"  # the default key of a dict batch's attention mask


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
        multiple: int = 8, min_saving: float = 0.01, lengths: Any = MASK,
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
        what = "TokenBudget.chunk_counts lengths"
        array = _token_spans.checked_lengths(lengths, padded_length, what, "devices")
        shapes = self.chunk_shapes(padded_length, array.shape[1])
        rows, sizes = tuple(r for r, _ in shapes), tuple(n for _, n in shapes)
        bucket = _token_spans.bucket_of(array, sizes, np)
        _, _, chunks = _token_spans.spans(bucket, rows, sizes, np)
        return {shape: int(c) for shape, c in zip(shapes, chunks.max(axis=0), strict=True)}


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value <= 0:
        raise TypeError(f"TokenBudget {name} must be a positive int, got {value!r}.")
