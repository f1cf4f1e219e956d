"""Scores: what one tile of a blockwise loss computes, and how its gradient flows back.

The tile loops (``blockwise.sweep``, ``sweeps.Sweeps``) and the ring (``engine``) are
written once; a score says how a block of query rows meets a block of key rows. It
fills the five static methods of :class:`Score`: :class:`Dot` (one vector per row,
``x @ y.T``) and :class:`MaxSim` (ColBERT's late interaction over token vectors).

Rows may be pytrees (MaxSim's are token vectors and their mask): the score names the
one leaf that is differentiated (:meth:`Score.leaf`), the rest rides along
(:meth:`Score.rest`) and :meth:`Score.join` puts a block back together. The loops
write gradients into a buffer shaped like that leaf.

Every product is accumulated in ``acc`` (at least float32, ``preferred_element_type``):
bfloat16 rows are never cast whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

EMPTY = -1e9  # the MaxSim score of a document with no token: out of the softmax, as in ST


class Score(Protocol):
    """How a tile of queries ``xq`` against keys ``yk`` is scored and differentiated.

    ``raw`` returns the ``[bq, bk]`` raw scores and a context the gradients reuse;
    ``dx`` and ``dy`` send a ``[bq, bk]`` cotangent ``dz`` of the raw scores back to
    the differentiable leaf of the queries and of the keys, in ``acc``.
    """

    @staticmethod
    def raw(xq: Any, yk: Any, acc: Any) -> tuple[jax.Array, Any]:
        """``(raw scores [bq, bk], context)``."""

    @staticmethod
    def dx(context: Any, xq: Any, yk: Any, dz: jax.Array, acc: Any) -> jax.Array:
        """The cotangent of ``leaf(xq)`` for ``dz``."""

    @staticmethod
    def dy(context: Any, xq: Any, yk: Any, dz: jax.Array, acc: Any) -> jax.Array:
        """The cotangent of ``leaf(yk)`` for ``dz``."""

    @staticmethod
    def leaf(rows: Any) -> Any:
        """The differentiated leaf of ``rows`` (an array, or a ``tiles`` view)."""

    @staticmethod
    def rest(rows: Any) -> Any:
        """What else a block of ``rows`` needs (a pytree of per-row leaves, or None)."""

    @staticmethod
    def join(leaf: Any, rest: Any) -> Any:
        """Rows from their leaf and :meth:`rest`."""


class Dot:
    """One vector per row: ``raw = xq @ yk.T``."""

    @staticmethod
    def raw(xq, yk, acc):
        return jnp.matmul(xq, yk.T, preferred_element_type=acc), None

    @staticmethod
    def dx(context, xq, yk, dz, acc):
        return jnp.matmul(dz, yk, preferred_element_type=acc)

    @staticmethod
    def dy(context, xq, yk, dz, acc):
        return jnp.matmul(dz.T, xq, preferred_element_type=acc)

    @staticmethod
    def leaf(rows):
        return rows

    @staticmethod
    def rest(rows):
        return None

    @staticmethod
    def join(leaf, rest):
        return leaf


class Side(NamedTuple):
    """One side's multi-vector rows: tokens ``[rows, tokens, dim]`` and their bool mask."""

    tokens: jax.Array
    mask: jax.Array


class MaxSim:
    """ColBERT's late interaction over :class:`Side` rows.

    ``raw[i, j] = sum_t qmask[i, t] * max_{s : dmask[j, s]} q[i, t] . d[j, s]``, from the
    ``[bq, bk, T, S]`` token similarities; a document with no token scores ``EMPTY``.
    The gradient sends each query token's cotangent to the document token(s) holding its
    maximum (split evenly between ties, as ``jnp.max`` differentiates).
    """

    @staticmethod
    def raw(xq: Side, yk: Side, acc):
        sims = jnp.einsum("itc,jsc->ijts", xq.tokens, yk.tokens, preferred_element_type=acc)
        sims = jnp.where(yk.mask[None, :, None, :], sims, -jnp.inf)
        best = jnp.max(sims, axis=-1)
        filled = jnp.any(yk.mask, axis=-1)[None, :]
        raw = jnp.where(xq.mask[:, None, :] & filled[..., None], best, 0).sum(axis=-1)
        return jnp.where(filled, raw, EMPTY), (sims, best)

    @staticmethod
    def dx(context, xq, yk, dz, acc):
        w = _weights(xq, yk, *context, dz, acc)
        return jnp.einsum("ijts,jsc->itc", w, yk.tokens, preferred_element_type=acc)

    @staticmethod
    def dy(context, xq, yk, dz, acc):
        w = _weights(xq, yk, *context, dz, acc)
        return jnp.einsum("ijts,itc->jsc", w, xq.tokens, preferred_element_type=acc)

    @staticmethod
    def leaf(rows: Side):
        return rows.tokens

    @staticmethod
    def rest(rows: Side):
        return rows.mask

    @staticmethod
    def join(leaf, rest):
        return Side(leaf, rest)


def _weights(xq: Side, yk: Side, sims, best, dz: jax.Array, acc: Any) -> jax.Array:
    """``w [bq, bk, T, S]``: ``dz [bq, bk]`` sent to each maximum of :meth:`MaxSim.raw`."""
    hit = (sims == best[..., None]) & yk.mask[None, :, None, :] & xq.mask[:, None, :, None]
    ties = jnp.maximum(jnp.sum(hit, axis=-1, keepdims=True), 1).astype(acc)
    return jnp.where(hit, dz[:, :, None, None], 0) / ties
