"""The encoder's side of a :class:`gc_jax.TokenPacking`: masks, positions and pooling.

A packed chunk holds several rows per *line*. An encoder is exact under packing when
every token attends only to its own row's tokens, counts its position within its
row, and pools each row on its own. Each function here takes the chunk the encoder
receives (a dict batch) and works both packed (the chunk has ``"segment_ids"``) and
unpacked (an ordinary batch: one row per line), so one encoder serves both, and
``gc_jax.testing`` can check it against the unpacked batch.

Examples:
  >>> import jax.numpy as jnp
  >>> from gc_jax import packing
  >>> chunk = {  # one line holding a row of 2 tokens, then a row of 3
  ...     "attention_mask": jnp.array([[1, 1, 1, 1, 1, 0]]),
  ...     "segment_ids": jnp.array([[1, 1, 2, 2, 2, 0]]),
  ...     "position_ids": jnp.array([[0, 1, 0, 1, 2, 0]]),
  ...     "segment_starts": jnp.array([[0, 2]]),
  ... }
  >>> packing.attention_mask(chunk)[0, 0].astype(int)  # [query, key]
  Array([[1, 1, 0, 0, 0, 0],
         [1, 1, 0, 0, 0, 0],
         [0, 0, 1, 1, 1, 0],
         [0, 0, 1, 1, 1, 0],
         [0, 0, 1, 1, 1, 0],
         [0, 0, 0, 0, 0, 0]], dtype=int32)
  >>> hidden = jnp.arange(6.0)[None, :, None]  # [lines, tokens, features]
  >>> packing.mean_pool(hidden, chunk)  # one row per slot: [lines * segments, features]
  Array([[0.5],
         [3. ]], dtype=float32)
  >>> packing.first_token(hidden, chunk)
  Array([[0.],
         [2.]], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gc_jax._chunks.packing import POSITION_IDS, SEGMENT_IDS, SEGMENT_STARTS
from gc_jax._chunks.token_rows import MASK


def is_packed(chunk: Any) -> bool:
    """Whether ``chunk`` is a packed chunk: a dict with ``"segment_ids"`` (False for an
    array or any other batch)."""
    return hasattr(chunk, "keys") and SEGMENT_IDS in chunk


def attention_mask(chunk: Mapping, mask: str = MASK) -> jax.Array:
    """Which keys each query may attend to, ``bool[lines, 1, L, L]`` (heads axis 1).

    Packed: the keys of the query's own row that ``chunk[mask]`` keeps. Unpacked:
    ``chunk[mask]`` as ``[rows, 1, 1, L]``, which broadcasts the same way.
    """
    keep = jnp.asarray(chunk[mask]) != 0
    if not is_packed(chunk):
        return keep[:, None, None, :]
    segment = chunk[SEGMENT_IDS]
    same = segment[:, :, None] == segment[:, None, :]
    return (same & keep[:, None, :] & (segment[:, None, :] > 0))[:, None]


def positions(chunk: Mapping, key: str = "input_ids") -> jax.Array:
    """Each token's position in its row, ``int32[lines, L]``: ``chunk["position_ids"]``
    where it has one, else ``arange(L)`` on every line (of ``chunk[key]``'s shape)."""
    if POSITION_IDS in chunk:
        return jnp.asarray(chunk[POSITION_IDS])
    return jnp.broadcast_to(jnp.arange(chunk[key].shape[1]), chunk[key].shape[:2])


def mean_pool(hidden: jax.Array, chunk: Mapping, mask: str = MASK) -> jax.Array:
    """The mean of ``hidden [lines, L, ...]`` over each row's kept tokens.

    Packed: ``[lines * segments, ...]``, one row per slot; an empty slot (a line with
    fewer rows) repeats the line's first row, so that no output is a zero vector
    (normalised, its gradient would be NaN). Unpacked: ``[rows, ...]``.
    """
    keep = (jnp.asarray(chunk[mask]) != 0).astype(hidden.dtype)
    if not is_packed(chunk):
        keep = keep.reshape(*keep.shape, *[1] * (hidden.ndim - 2))
        return jnp.sum(hidden * keep, axis=1) / jnp.maximum(jnp.sum(keep, axis=1), 1)
    segment = jnp.asarray(chunk[SEGMENT_IDS])
    segments = chunk[SEGMENT_STARTS].shape[1]
    slots = segment[..., None] == jnp.arange(1, segments + 1)  # [lines, L, S]
    empty = ~jnp.any(slots, axis=1, keepdims=True)  # [lines, 1, S]
    slots = slots | (empty & (segment == 1)[..., None])  # an empty slot: the first row
    weights = slots.astype(hidden.dtype) * keep[..., None]
    flat = hidden.reshape(*hidden.shape[:2], -1)
    sums = jnp.einsum("lts,ltf->lsf", weights, flat)
    counts = jnp.maximum(jnp.sum(weights, axis=1), 1)[..., None]
    return (sums / counts).reshape(-1, *hidden.shape[2:])


def first_token(hidden: jax.Array, chunk: Mapping) -> jax.Array:
    """Each row's first token of ``hidden [lines, L, ...]`` (e.g. ``[CLS]`` pooling).

    Packed: ``[lines * segments, ...]``, one row per slot (an empty slot: the line's
    first row's). Unpacked: ``hidden[:, 0]``. A row without tokens is packed alone in
    its line, so its first token is the unpacked row's too.
    """
    if not is_packed(chunk):
        return hidden[:, 0]
    starts = chunk[SEGMENT_STARTS]
    at = starts.reshape(*starts.shape, *[1] * (hidden.ndim - 2))
    return jnp.take_along_axis(hidden, at, axis=1).reshape(-1, *hidden.shape[2:])
