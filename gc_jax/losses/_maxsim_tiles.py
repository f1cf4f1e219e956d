"""MaxSim (late interaction) scores computed tile by tile, forward and backward.

A tile is a block of ``bq`` queries (``[bq, T, dim]`` and their token mask) against a
block of ``bk`` documents (``[bk, S, dim]`` and theirs). Its scores are::

  raw[i, j] = sum_t qmask[i, t] * max_{s : dmask[j, s]} q[i, t] . d[j, s]

from the ``[bq, bk, T, S]`` token similarities, accumulated in at least float32
(``preferred_element_type``): rows in bfloat16 are never cast whole. A document
with no token scores ``EMPTY`` (-1e9, as sentence-transformers scores it), so that it
takes no part in any softmax.

The loops, the online log-sum-exp and the custom VJP are those of ``_blockwise``
(see there), with :class:`gc_jax.losses._strategies.Softmax` forming each row's
InfoNCE loss; only the tile differs. Its gradient sends each query token's
cotangent to the document token(s) holding its maximum (split evenly between ties,
as ``jnp.max`` differentiates): ``dq = w . d`` and ``dd = w^T . q`` with ``w`` the
``[bq, bk, T, S]`` tile of those weights, recomputed in the backward. Memory: a few
``bq x bk x T x S`` tiles plus the batch-sized inputs and gradients, whatever the
batch size. The ring across devices is in ``_maxsim_ring``.

The block helpers (``read_tree``, ``write``, ``loop``, ``first``, ...) are
``_tiles``', the same for every loss: a block of MaxSim rows is a pytree (tokens and
mask) read leaf by leaf.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gc_jax import _distributed, _narrow
from gc_jax.losses._order import zero_after
from gc_jax.losses._strategies import Softmax
from gc_jax.losses._tiles import blocks, first, loop, own_rows, write, zeros
from gc_jax.losses._tiles import read_tree as read

Scalar = jax.Array


EMPTY = -1e9  # the score of a document with no token: out of the softmax, as in ST


class Side(NamedTuple):
    """One side's rows: token vectors ``[rows, tokens, dim]`` and their bool mask."""

    tokens: jax.Array
    mask: jax.Array


# --- one tile -------------------------------------------------------------------


def scores(x: Side, y: Side, acc: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``raw [bq, bk]`` MaxSim scores, with the token similarities and their maxima."""
    sims = jnp.einsum("itc,jsc->ijts", x.tokens, y.tokens, preferred_element_type=acc)
    sims = jnp.where(y.mask[None, :, None, :], sims, -jnp.inf)
    best = jnp.max(sims, axis=-1)
    filled = jnp.any(y.mask, axis=-1)[None, :]
    raw = jnp.where(x.mask[:, None, :] & filled[..., None], best, 0).sum(axis=-1)
    return jnp.where(filled, raw, EMPTY), sims, best


def _weights(x: Side, y: Side, sims, best, draw: jax.Array, acc: Any) -> jax.Array:
    """``w [bq, bk, T, S]``: ``draw [bq, bk]`` sent to each maximum of :func:`scores`."""
    hit = (sims == best[..., None]) & y.mask[None, :, None, :] & x.mask[:, None, :, None]
    ties = jnp.maximum(jnp.sum(hit, axis=-1, keepdims=True), 1).astype(acc)
    return jnp.where(hit, draw[:, :, None, None], 0) / ties


def query_grad(w: jax.Array, y: Side, acc: Any) -> jax.Array:
    return jnp.einsum("ijts,jsc->itc", w, y.tokens, preferred_element_type=acc)


def doc_grad(w: jax.Array, x: Side, acc: Any) -> jax.Array:
    return jnp.einsum("ijts,itc->jsc", w, x.tokens, preferred_element_type=acc)


def _logits(raw, targets, start, own, scale):
    """Logits, the columns the tile owns (not the previous block's) and the targets."""
    cols = start + jnp.arange(raw.shape[1])
    valid = (cols >= own)[None, :]
    if targets is None:  # no column is any row's target (another device's block)
        return scale * raw, valid, jnp.zeros_like(valid)
    return scale * raw, valid, valid & (cols[None, :] == targets[:, None])


# --- the loops ------------------------------------------------------------------


def sweep(block: int, x: Side, y: Side, targets, scale: Scalar, carry: tuple) -> tuple:
    """``carry`` (Softmax's running statistics per row of ``x``) updated with all of ``y``.

    As ``_blockwise.sweep``: query blocks outside, document blocks inside; rows a last,
    overlapping query block shares with the block before keep that block's values.
    """
    n, m = len(x.tokens), len(y.tokens)
    bq, bk = min(block, n), min(block, m)
    acc = scale.dtype

    def query_block(i, carry, x, targets, y):
        qs = first(i, bq, n)
        xq, tq = read(x, qs, bq), read(targets, qs, bq)
        before = tuple(read(c, qs, bq) for c in carry)

        def step(j, rows, y):
            ks = first(j, bk, m)
            raw = scores(xq, read(y, ks, bk), acc)[0]
            return Softmax.update(rows, *_logits(raw, tq, ks, j * bk, scale))

        after = loop(step, blocks(m, bk), before, y)
        own = own_rows(qs, bq, i * bq)[:, 0]
        rows = (jnp.where(own, a, b) for a, b in zip(after, before, strict=True))
        return tuple(write(c, r, qs) for c, r in zip(carry, rows, strict=True))

    return loop(query_block, blocks(n, bq), carry, x, targets, y)


def init(x: Side, *others: Any, dtype: Any) -> tuple:
    """Softmax's statistics before any tile, typed like the rows of ``x``."""
    return Softmax.init(zeros(x.tokens[:, 0, 0], dtype, x, *others))


def forward(block, x, y, targets, scale) -> tuple[jax.Array, jax.Array]:
    """Per-row losses and log-sum-exps: one :func:`sweep` over all of ``y``."""
    return Softmax.finish(sweep(block, x, y, targets, scale, init(x, y, dtype=scale.dtype)))


def backward(block, x: Side, y: Side, targets, scale, lse, g):
    """Cotangents of ``x.tokens``, ``y.tokens`` and ``scale``, as ``_blockwise.backward``.

    One sweep over query blocks sums each block's ``dq`` (and ``dscale``) over the
    document blocks; one over document blocks sums each block's ``dd`` over the query
    blocks and writes it over ``y.tokens``'s buffer, block by block.
    """
    n, m = len(x.tokens), len(y.tokens)
    bq, bk = min(block, n), min(block, m)
    nq, nk = blocks(n, bq), blocks(m, bk)
    acc = scale.dtype
    queries = (x, targets, lse, g)

    def read_queries(queries, i):
        qs = first(i, bq, n)
        return read(queries, qs, bq), own_rows(qs, bq, i * bq), qs

    def tile(query, yk, ks, own, keep=True):
        """Raw scores and ``w``: ``d loss / d raw`` (before ``scale``) sent to the maxima.

        ``keep``: ``[bq, 1]``, the query rows whose ``d loss / d raw`` counts."""
        xq, tq, sq, gq = query
        raw, sims, best = scores(xq, yk, acc)
        z, valid, pos = _logits(raw, tq, ks, own, scale)
        dz = jnp.where(keep, gq[:, None] * Softmax.dlogits(z, valid, pos, sq), 0)
        return raw, dz, _weights(xq, yk, sims, best, dz, acc)

    def query_block(i, carry, y, *queries):
        query, own, qs = read_queries(queries, i)

        def step(j, carry, y):
            dxq, dscale = carry
            ks = first(j, bk, m)
            yk = read(y, ks, bk)
            raw, dz, w = tile(query, yk, ks, j * bk)
            dxq = dxq + query_grad(w, yk, acc)
            return dxq, dscale + jnp.where(own, dz * raw, 0).sum()

        dx, dscale = carry
        dxq, dscale = loop(step, nk, (zeros(query[0].tokens, acc, x, y), dscale), y)
        return write(dx, (scale * dxq).astype(dx.dtype), qs), dscale

    def key_grad(j, dy, mask, queries):
        """``dd`` of document block ``j`` (zero in rows of the block before)."""
        ks = first(j, bk, m)
        yk = Side(read(dy, ks, bk), read(mask, ks, bk))  # its own rows still hold y

        def step(i, dyk, *queries):
            query, own, _ = read_queries(queries, i)
            w = tile(query, yk, ks, j * bk, keep=own)[2]  # rows of the block before: there
            return dyk + doc_grad(w, query[0], acc)

        return (scale * loop(step, nq, zeros(yk.tokens, acc, x, y), *queries)).astype(dy.dtype)

    def key_block(j, dy, zero, mask, *queries):
        j = j + zero  # orders this sweep after the first (see _blockwise.backward)
        return write(dy, key_grad(j, dy, mask, queries), j * bk)

    zero = zeros(y.tokens[0, 0, 0], acc, x, y)
    init = (_distributed.vary_like(x.tokens, x, y), zero)
    dx, dscale = loop(query_block, nq, init, y, *queries)
    dy = _distributed.vary_like(y.tokens, x, y)
    dy = loop(key_block, m // bk, dy, zero_after(dscale), y.mask, *queries)
    if m % bk:  # the last block overlaps the one before: only its own rows are written
        own = m % bk
        last = key_grad(nk - 1, dy, y.mask, queries)[bk - own :]
        dy = _narrow.update_in_place(lambda dy: write(dy, last, m - own), dy)
    return dx, dy, dscale


# --- the custom VJP -------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rowwise(block, q, q_mask, d, d_mask, targets, scale):
    return forward(block, Side(q, q_mask), Side(d, d_mask), targets, scale)[0]


def _rowwise_fwd(block, q, q_mask, d, d_mask, targets, scale):
    loss, lse = forward(block, Side(q, q_mask), Side(d, d_mask), targets, scale)
    return loss, (q, q_mask, d, d_mask, targets, scale, lse)


def _rowwise_bwd(block, res, g):
    q, q_mask, d, d_mask, targets, scale, lse = res
    dq, dd, dscale = backward(block, Side(q, q_mask), Side(d, d_mask), targets, scale, lse, g)
    return dq, None, dd, None, None, dscale


_rowwise.defvjp(_rowwise_fwd, _rowwise_bwd)


def rows(x: Side, y: Side, targets: jax.Array, scale: Scalar, block_size: int) -> jax.Array:
    """Per-row InfoNCE losses of MaxSim logits ``scale * raw``, blockwise.

    Args:
      x: queries (``[n, T, dim]`` tokens, ``[n, T]`` bool mask).
      y: documents (``[m, S, dim]`` tokens, ``[m, S]`` bool mask).
      targets: the index into ``y`` of each query's positive, ``[n]`` ints.
      scale: logit multiplier (scalar in the accumulation dtype, differentiable).
      block_size: rows per tile on either side.

    Returns:
      The per-query losses, ``[n]``.
    """
    scale, targets = _distributed.vary_like((scale, targets), x, y)
    return _rowwise(block_size, x.tokens, x.mask, y.tokens, y.mask, targets, scale)
