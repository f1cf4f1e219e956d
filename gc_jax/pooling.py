"""From a decoder's hidden states to embeddings: pooling over the attention mask.

Model libraries (MaxText, Google DeepMind's ``gemma``, Penzai) return per-token hidden
states ``(rows, tokens, width)`` and an attention mask ``(rows, tokens)`` that is 1 on
real tokens. An embedder pools them to one vector per row, optionally through a dense
head, and L2-normalises it (EmbeddingGemma: mean pooling; Qwen3-Embedding: the last
token). Every row is pooled from its own tokens only, so these functions never mix
rows and keep gradient caching exact. Padding may be on either side.

Examples:
  >>> import jax.numpy as jnp
  >>> from gc_jax import pooling
  >>> hidden = jnp.arange(12.0).reshape(2, 3, 2)   # 2 rows, 3 tokens, width 2
  >>> mask = jnp.array([[1, 1, 0], [1, 1, 1]])    # row 0 has one pad token
  >>> pooling.pool(hidden, mask, "mean")
  Array([[1., 2.],
         [8., 9.]], dtype=float32)
  >>> pooling.pool(hidden, mask, "last")
  Array([[ 2.,  3.],
         [10., 11.]], dtype=float32)
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

__all__ = ["embed", "l2_normalize", "pool"]

Pooling = Literal["mean", "first", "last"]
_POOLINGS = ("mean", "first", "last")


def _check(hidden: jax.Array, mask: jax.Array, how: str) -> None:
    if how not in _POOLINGS:
        raise ValueError(f"how must be one of {_POOLINGS}, got {how!r}")
    if hidden.ndim != 3 or mask.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be (rows, tokens, width) and mask (rows, tokens); got hidden "
            f"{hidden.shape} and mask {mask.shape}: pass the attention mask of the "
            "same batch (1 on real tokens)"
        )


def _check_head(head: jax.Array, width: int) -> None:
    shape = tuple(getattr(head, "shape", ()))
    if len(shape) == 2 and shape[0] == width:
        return
    hint = ""
    if len(shape) == 2 and shape[1] == width:
        hint = f" (this one looks transposed: pass head.T, shape {shape[::-1]})"
    raise ValueError(
        f"head must be a (width, dim) projection whose width is hidden's last axis "
        f"({width}); got head of shape {shape}{hint}: pass a ({width}, dim) array, or "
        "head=None to keep the pooled width."
    )


def pool(hidden: jax.Array, mask: jax.Array, how: Pooling = "mean") -> jax.Array:
    """One vector per row from its real tokens.

    Args:
      hidden: ``(rows, tokens, width)`` hidden states.
      mask: ``(rows, tokens)``, nonzero (or True) on real tokens, zero on padding.
      how: ``"mean"``: the mean over real tokens (sums in float32); ``"first"``: the
        first real token; ``"last"``: the last real token (a causal decoder's summary,
        as Qwen3-Embedding), on left- or right-padded rows.

    Returns:
      ``(rows, width)`` in ``hidden``'s dtype. A row with no real token gives zeros
      (``"mean"``) or its first/last position's state.

    Examples:
      >>> import jax.numpy as jnp
      >>> hidden = jnp.arange(6.0).reshape(1, 3, 2)
      >>> pool(hidden, jnp.array([[0, 1, 1]]), "first")   # left padding
      Array([[2., 3.]], dtype=float32)
    """
    _check(hidden, mask, how)
    real = mask.astype(bool)
    if how == "mean":
        weights = real.astype(jnp.float32)[..., None]
        total = jnp.sum(hidden.astype(jnp.float32) * weights, axis=1)
        count = jnp.maximum(jnp.sum(weights, axis=1), 1.0)
        return (total / count).astype(hidden.dtype)
    positions = jnp.arange(mask.shape[1])
    if how == "first":
        index = jnp.argmax(real, axis=1)
    else:
        index = jnp.max(jnp.where(real, positions, -1), axis=1).clip(0)
    return jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """``x`` divided by its L2 norm along the last axis (at least ``eps``).

    As torch's ``F.normalize``: ``x / max(||x||, eps)``, differentiable everywhere. A
    row of zeros (an empty row pooled to zeros) stays zeros with a finite gradient
    (the norm's derivative, undefined at 0, is not taken below ``eps``), so one empty
    row does not make a step's gradients NaN. Computed in float32.

    Examples:
      >>> import jax.numpy as jnp
      >>> l2_normalize(jnp.array([[3.0, 4.0]]))
      Array([[0.6, 0.8]], dtype=float32)
    """
    wide = x.astype(jnp.float32)
    squares = jnp.sum(wide * wide, axis=-1, keepdims=True)
    return (wide * jax.lax.rsqrt(jnp.maximum(squares, jnp.float32(eps) ** 2))).astype(x.dtype)


def embed(
    hidden: jax.Array,
    mask: jax.Array,
    *,
    how: Pooling = "mean",
    head: jax.Array | None = None,
    normalize: bool = True,
) -> jax.Array:
    """Pooled, projected and normalised embeddings: an embedder's last three lines.

    Args:
      hidden: ``(rows, tokens, width)`` hidden states (after the decoder's final norm).
      mask: ``(rows, tokens)``, nonzero on real tokens.
      how: the pooling, as :func:`pool`.
      head: an optional ``(width, dim)`` dense projection applied after pooling.
      normalize: whether to L2-normalise the result (cosine-similarity losses).

    Returns:
      ``(rows, dim)`` embeddings (``dim = width`` without ``head``).

    Examples:
      >>> import jax.numpy as jnp
      >>> hidden = jnp.ones((2, 4, 3))
      >>> embed(hidden, jnp.ones((2, 4)), head=jnp.ones((3, 2))).round(4)
      Array([[0.7071, 0.7071],
             [0.7071, 0.7071]], dtype=float32)
    """
    x = pool(hidden, mask, how)
    if head is not None:
        _check_head(head, hidden.shape[-1])
        x = x @ head
    return l2_normalize(x) if normalize else x
