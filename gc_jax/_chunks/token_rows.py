"""The rows of a padded token batch, as both token kinds read, check and move them.

A :class:`gc_jax.TokenBudget` (:mod:`gc_jax._chunks.budget`) and a
:class:`gc_jax.TokenPacking` (:mod:`gc_jax._chunks.lines`) both take each row's length
from the batch (``lengths=``: the key of its attention mask, or a callable), check the
same arguments, and gather and write rows by traced index. Every message names the
class the user wrote (``type(config).__name__``), so a packing's error never speaks of
a budget.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gc_jax import _narrow
from gc_jax._base import PyTree

MASK = "attention_mask"
"""The default key of a dict batch's attention mask (``lengths=``, ``gc_jax.packing``)."""


# ------------------------------------------------------------------------------ checks


def positive_int(value: Any, where: str) -> int:
    """``value`` as an int, or a TypeError saying ``where`` (e.g. ``"TokenPacking(tokens=...)"``)
    takes a positive int."""
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value <= 0:
        raise TypeError(f"{where} must be a positive int, got {value!r}.")
    return int(value)


def check_lengths_source(lengths: Any, kind: str) -> None:
    """``lengths=`` of a ``kind`` (the class's name): a mask key or a callable."""
    if not (isinstance(lengths, str) or callable(lengths)):
        raise TypeError(
            f"{kind}(lengths=...) must be the key of the attention mask in a dict batch "
            f"(a str) or a callable lengths(batch) -> int[rows], got {lengths!r}."
        )


def checked_lengths(lengths: Any, padded_length: Any, method: str, argument: str,
                    leading: str) -> np.ndarray:  # fmt: skip
    """``lengths`` as ``int[leading, rows]`` within ``[0, padded_length]``, or raises
    naming ``method`` (e.g. ``"TokenPacking.chunk_counts"``) and its ``argument``."""
    padded_length = positive_int(padded_length, f"{method}(padded_length=...)")
    what = f"{method}({argument}=...)"
    array = np.asarray(lengths)
    array = array[None] if array.ndim == 1 else array
    if array.ndim != 2 or not array.size or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{what} must be integer row lengths [rows] or [{leading}, rows], e.g. "
            f"mask.sum(-1), got {array.dtype} of shape {np.shape(lengths)}."
        )
    if array.min() < 0 or array.max() > padded_length:
        raise ValueError(
            f"{what} has lengths from {array.min()} to {array.max()}, outside [0, "
            f"padded_length={padded_length}]; pass each row's tokens (padding excluded) "
            "and the batch's padded length."
        )
    return array


def checked_buckets(buckets: Any, kind: str) -> tuple[int, ...]:
    """``buckets=`` of a ``kind``: a non-empty tuple of strictly increasing positive ints."""
    found = tuple(buckets) if isinstance(buckets, tuple | list) else None
    if not found:
        raise TypeError(
            f"{kind}(buckets=...) must be a non-empty tuple of increasing padded lengths, "
            f"e.g. (32, 64, 128, 256), got {buckets!r}."
        )
    for i, b in enumerate(found):
        positive_int(b, f"{kind}(buckets=...) buckets[{i}]")
    if any(a >= b for a, b in itertools.pairwise(found)):
        raise ValueError(
            f"{kind}(buckets=...) must increase strictly, got {found}; pass them "
            f"sorted without repeats, e.g. {tuple(sorted(set(found)))}."
        )
    return tuple(int(b) for b in found)


def check_fit(attention_width: Any, max_buckets: Any, multiple: Any, min_saving: Any,
              method: str) -> None:  # fmt: skip
    """The arguments of a ``for_lengths`` that fits buckets (``method``, e.g.
    ``"TokenBudget.for_lengths"``): ``attention_width`` None or a positive finite
    number, ``max_buckets`` and ``multiple`` positive ints, ``min_saving`` a share."""
    where, width = f"{method}(attention_width=...)", attention_width
    if width is not None and (
        not isinstance(width, int | float | np.integer | np.floating) or isinstance(width, bool)
    ):
        raise TypeError(
            f"{where} must be the encoder's width (a positive number, e.g. its hidden size "
            f"768) or None, got {width!r} of type {type(width).__name__}."
        )
    if width is not None and not (np.isfinite(width) and width > 0):
        raise ValueError(
            f"{where} must be a positive finite width, e.g. the encoder's hidden size 768, "
            f"got {width!r}; pass None to fit the buckets to the tokens alone."
        )
    for name, value in (("max_buckets", max_buckets), ("multiple", multiple)):
        positive_int(value, f"{method}({name}=...)")
    if not isinstance(min_saving, int | float) or not 0 <= min_saving < 1:
        raise ValueError(f"{method}(min_saving=...) must be a share in [0, 1), got {min_saving!r}.")


def check_min_tokens(min_tokens: Any, method: str) -> None:
    """``min_tokens`` of a ``for_lengths`` (``method``): None, or a positive int (the
    smallest chunk the fit may choose; at least ``tokens`` keeps chunks of ``tokens``)."""
    if min_tokens is not None:
        positive_int(min_tokens, f"{method}(min_tokens=...)")


def bucket_lengths(buckets: tuple[int, ...], padded_length: int, kind: str) -> tuple[int, ...]:
    """The buckets a batch padded to ``padded_length`` tokens uses (the last is it), or
    a ValueError where a row may be longer than every bucket of the ``kind``."""
    if padded_length > buckets[-1]:
        raise ValueError(
            f"the batch is padded to {padded_length} tokens but the largest bucket of "
            f"{kind}(buckets={buckets}) is {buckets[-1]}: rows may be longer than every "
            f"bucket. Add {padded_length} to buckets, or pad and truncate the batch to at "
            f"most {buckets[-1]} tokens."
        )
    return (*(b for b in buckets if b < padded_length), padded_length)


def chunk_shapes(config: Any, padded_length: int, rows: int, unit: str) -> tuple:
    """``(min(tokens // n, rows), n)`` for each of ``config``'s bucket lengths ``n``
    (a budget's or a packing's), or a ValueError where ``config.tokens`` does not hold
    one ``unit`` (a row, a line) of ``padded_length`` tokens."""
    if config.tokens < padded_length:
        raise ValueError(
            f"{type(config).__name__}(tokens={config.tokens}) is smaller than one {unit} of "
            f"the batch's padded length ({padded_length} tokens); pass tokens of at least "
            f"{padded_length}, e.g. tokens={padded_length * 16} for chunks of 16 {unit}s."
        )
    widths = config.bucket_lengths(padded_length)
    return tuple((min(config.tokens // n, rows), n) for n in widths)


class BucketChunk(NamedTuple):
    """Chunk ``turn`` (traced) of bucket ``bucket`` (static): a budget's or a packing's
    chunk index (a packing's buckets are its line lengths)."""

    bucket: int
    turn: Any
    kept: bool = False  # a kept chunk: its turn may be negative (then it has no row)


def bucket_loops(trips: jax.Array, keep: int) -> list:
    """One chunk loop per bucket, ``(index of turn j, traced turns)``; the last bucket's
    runs ``keep`` turns fewer: its last ``keep`` chunks are kept (:func:`kept_turns`)."""
    last = trips.shape[0] - 1
    turns = lambda b: jnp.maximum(trips[b] - keep, 0) if keep and b == last else trips[b]
    return [(lambda j, b=b: BucketChunk(b, j), turns(b)) for b in range(last + 1)]


def kept_turns(trips: jax.Array, keep: int) -> tuple[Any, int]:
    """The kept chunks, ``(index of turn j, turns)``: the last bucket's last ``keep``.

    Where the bucket has fewer chunks, the first are turns before its first (negative):
    encoded, they write no row and get a zero cotangent, so the step stays exact.
    """
    last = trips.shape[0] - 1
    return (lambda j: BucketChunk(last, trips[last] - keep + j, True)), keep


# ------------------------------------------------------------------ lengths, in a trace


def row_lengths(batch: PyTree, config: Any, name: str) -> jax.Array:
    """Each row's length: one past its mask's last nonzero position, or ``config.lengths``
    (``config``: a ``TokenBudget`` or ``TokenPacking``; ``name``: the batch's, in errors)."""
    if callable(config.lengths):
        lengths = jnp.asarray(config.lengths(batch))
        rows = jax.tree.leaves(batch)[0].shape[0]
        if lengths.shape != (rows,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(
                f"{type(config).__name__}(lengths=...) returned {lengths.shape} "
                f"{lengths.dtype} for {name}; it must return one integer length per row "
                f"(shape ({rows},))."
            )
        if hasattr(batch, "keys") and MASK in batch and getattr(batch[MASK], "ndim", 0) == 2:
            # Never trim what the mask says is a token: a lengths() that undercounts
            # (left padding, holes) would silently change the encoder's outputs.
            lengths = jnp.maximum(lengths, _mask_lengths(batch[MASK]))
        return lengths
    return _mask_lengths(_mask(batch, config, name))


def _mask_lengths(mask: jax.Array) -> jax.Array:
    """One past each row's last nonzero mask position."""
    positions = jnp.arange(1, mask.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(mask != 0, positions, 0), axis=1)


def _mask(batch: PyTree, config: Any, name: str) -> jax.Array:
    """``batch[config.lengths]``, the attention mask, or raises naming the config."""
    key, call = config.lengths, f"{type(config).__name__}(lengths={config.lengths!r})"
    if not hasattr(batch, "keys") or key not in batch:
        keys = sorted(map(str, batch.keys())) if hasattr(batch, "keys") else None
        got = f"a dict with keys {keys}" if keys is not None else type(batch).__name__
        raise ValueError(
            f"{call} reads each row's length from {name}[{key!r}], but {name} is {got}; "
            "pass lengths='<key of the attention mask>' or a callable "
            "lengths(batch) -> int[rows]."
        )
    mask = batch[key]
    if getattr(mask, "ndim", None) != 2:
        raise ValueError(
            f"{name}[{key!r}], where {call} reads each row's length, must be a [rows, "
            f"padded length] attention mask, got shape {getattr(mask, 'shape', None)}."
        )
    return mask


def padded_length(batch: PyTree, config: Any, name: str) -> int:
    """The batch's padded length: axis 1 of its mask, else of its first rank-2 leaf."""
    if not callable(config.lengths):
        return int(_mask(batch, config, name).shape[1])
    for x in jax.tree.leaves(batch):
        if x.ndim >= 2:
            return int(x.shape[1])
    raise ValueError(
        f"{name} has no [rows, tokens] leaf for a {type(config).__name__} to cut by tokens."
    )


def warn_float_columns(batch: PyTree, padded: int, name: str, config: Any) -> None:
    """Warns about float ``[rows, padded]`` leaves (but the mask): trimmed like tokens by
    a ``TokenBudget`` or ``TokenPacking``, which is wrong for a dense feature that
    merely has ``padded`` columns."""
    mask = config.lengths if isinstance(config.lengths, str) else MASK
    kind = type(config).__name__
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


# ------------------------------------------------------------- rows, by traced index


def take_rows(tree: PyTree, rows: jax.Array, valid: jax.Array, num_shards: int) -> PyTree:
    """Rows ``rows[s]`` of each shard ``s`` of every leaf, zero where not ``valid``."""
    valid = valid.reshape(-1)

    def one(g):
        piece = gather(g, rows, num_shards)
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


def gather(x: jax.Array, rows: jax.Array, num_shards: int) -> jax.Array:
    """Rows ``rows[s]`` of each shard ``s`` of ``x``, as one ``[S * rows, ...]`` array."""
    xs = x.reshape(num_shards, -1, *x.shape[1:])
    piece = jnp.take_along_axis(xs, rows.reshape(*rows.shape, *[1] * (x.ndim - 1)), axis=1)
    return piece.reshape(-1, *x.shape[1:])
