"""Ids of texts from their tokens, for the false-negative masks: :func:`text_ids`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_SEEDS = (0x9E3779B9, 0x85EBCA77)  # one per word of the id
_TOKEN, _POSITION = 0xCC9E2D51, 0x1B873593


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every input bit flips about half the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def text_ids(input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
    """An id per row naming its text: equal token sequences, equal ids (jittable).

    Each row's id hashes the tokens its ``attention_mask`` keeps, in order, and how
    many there are: padding, on either side and of any length, does not change it.
    Pass the ids as ``contrastive_loss(..., query_ids=, doc_ids=)`` so that
    duplicates in a batch are not counted as each other's negatives, with no
    bookkeeping. The id has two 32-bit words (64 bits): two different texts share it
    with probability about ``2**-64`` per pair, ``1e-10`` for a batch of 65,536.

    Args:
      input_ids: integer tokens, ``[rows, length]``.
      attention_mask: ``[rows, length]``, nonzero (or True) where a token is real;
        None: every token is.

    Returns:
      ``uint32`` ids, ``[rows, 2]``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import text_ids
      >>> tokens = jnp.array([[7, 8, 9, 0], [0, 7, 8, 9], [7, 8, 0, 0], [9, 8, 7, 0]])
      >>> mask = tokens != 0  # right, left and no padding
      >>> ids = text_ids(tokens, mask)
      >>> ids.shape, ids.dtype
      ((4, 2), dtype('uint32'))
      >>> same = lambda a, b: bool((ids[a] == ids[b]).all())
      >>> same(0, 1), same(0, 2), same(0, 3)
      (True, False, False)
    """
    if getattr(input_ids, "ndim", None) != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise TypeError(
            "input_ids must be an integer [rows, length] array of tokens, got "
            f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} of shape "
            f"{getattr(input_ids, 'shape', None)}."
        )
    if attention_mask is None:
        keep = jnp.ones(input_ids.shape, bool)
    elif getattr(attention_mask, "shape", None) != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {input_ids.shape}, got "
            f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}."
        )
    else:
        keep = attention_mask.astype(bool)
    tokens = input_ids.astype(jnp.uint32)
    position = (jnp.cumsum(keep, axis=1) - 1).astype(jnp.uint32)  # among kept tokens
    length = jnp.sum(keep, axis=1).astype(jnp.uint32)
    words = []
    for seed in _SEEDS:
        h = _mix(tokens * jnp.uint32(_TOKEN) + _mix(position + jnp.uint32(seed)))
        h = _mix(h + jnp.uint32(seed) * _POSITION)
        total = jnp.sum(jnp.where(keep, h, jnp.uint32(0)), axis=1, dtype=jnp.uint32)
        words.append(_mix(total ^ _mix(length + jnp.uint32(seed))))
    return jnp.stack(words, axis=1)
