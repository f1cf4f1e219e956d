"""Row-wise contrastive losses computed tile by tile, never holding the full logit matrix.

Every query row ``i`` of ``x`` is scored against every row ``j`` of ``ys`` with logit
``z[i, j] = scale * x[i] @ ys[j] + bias``. The logits are visited in
``block_size x block_size`` tiles: a loop over blocks of queries, an inner one over
blocks of ``ys``, so memory is one tile plus ``O((n + m) * d)``, whatever ``n`` and
``m``. Nothing is padded: a last block that would run past the end starts earlier,
and the rows it shares with the block before are masked where they would count twice.

*Online log-sum-exp* (softmax losses): a query row keeps a running maximum ``mx`` and
a running ``se = sum(exp(z - mx))``; a new tile with maximum ``mx'`` rescales
``se`` by ``exp(mx - mx')`` before adding its own terms, and after the last tile
``lse = mx + log(se)``, exactly and stably.

*Custom VJP*: letting autodiff differentiate the scan would save every tile. Instead
the forward saves only the inputs and one statistic per row (the LSE), and the
backward recomputes each tile's logits to form ``dz = g * dloss/dz`` (``softmax - 1
at the target`` for softmax, ``sigmoid(z) - label`` for sigmoid). It sweeps twice:
over query blocks for ``dx``, ``dscale = sum(dz * x @ ys.T)`` and ``dbias = sum(dz)``,
and over key blocks for ``dys``, so that no batch-sized gradient is carried across
blocks. The second sweep writes ``dys`` over ``ys`` (each block is read just before it
is overwritten), so ``ys``'s buffer is reused when nothing else needs it. Gathering
``ys`` across devices happens outside, so its transpose (a reduce-scatter) is left
to JAX; the ring form instead runs :func:`sweep` and the backward once per
block of ``ys`` that reaches the device. The engine (``engine``) builds the tiles of
each family of a loss.

*Precision*: tiles, per-row statistics and per-block gradients are computed in the
*accumulation dtype*, the inputs' dtype widened to at least float32 (the scalars'
dtype). ``x`` and ``ys`` are never cast whole: bfloat16 or float16 rows stay narrow,
each tile's product is accumulated in float32 (``preferred_element_type``), and the
gradients of ``x`` and ``ys`` come back in their own dtypes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gc_jax.losses._engine import sweeps as _sweeps
from gc_jax.losses._engine import tiles as _tiles
from gc_jax.losses._engine.order import zero_after
from gc_jax.losses._engine.scores import Score
from gc_jax.losses._engine.strategies import Rows, Strategy
from gc_jax.losses._engine.tiles import (
    Tiles,
    blocks,
    count,
    first,
    logits,
    loop,
    read_tree,
    sizes,
    write,
)


def sweep(tiles: Tiles, carry: Rows) -> Rows:
    """``carry`` (one running statistic per row of ``x``) updated with every tile of ``ys``.

    A loop over query blocks, an inner one over ``ys``'s blocks. The rows a last,
    overlapping query block shares with the block before keep the values that block
    gave them (they would otherwise count ``ys`` twice). The ring calls this
    once per block of ``ys`` that reaches the device.
    """
    kind, block, x, ys, targets, scale, bias, mask, score = tiles
    n, m = count(x), count(ys)
    bq, bk = sizes(block, n, m)
    rule, rows_meta, cols_meta = mask or (None, None, None)

    def query_block(i, carry, x, targets, ys, rows_meta, cols_meta):
        qs = first(i, bq, n)
        xq, tq = read_tree(x, qs, bq), read_tree(targets, qs, bq)
        rm = read_tree(rows_meta, qs, bq)
        before = read_tree(carry, qs, bq)

        def step(j, rows, ys, cols_meta):
            ks = first(j, bk, m)
            pairs = _pairs(rule, rm, cols_meta, (qs, bq), (ks, bk))
            raw, _ = score.raw(xq, read_tree(ys, ks, bk), scale.dtype)
            z, valid, pos = logits(raw, tq, (ks, j * bk), (scale, bias), pairs)
            return kind.update(rows, z, valid, pos)

        after = loop(step, blocks(m, bk), before, ys, cols_meta)
        own = _tiles.own_rows(qs, bq, i * bq)[:, 0]
        rows = (jnp.where(own, a, b) for a, b in zip(after, before, strict=True))
        return tuple(write(c, r, qs) for c, r in zip(carry, rows, strict=True))

    return loop(query_block, blocks(n, bq), carry, x, targets, ys, rows_meta, cols_meta)


def _pairs(rule, rm, cols_meta, rows: tuple, cols: tuple) -> tuple:
    """``rule``'s pairs of the tile at rows ``(first, count)``, columns likewise: those
    it keeps and those whose logits it boosts (each None when it has none)."""
    if rule is None:
        return None, None
    (qs, bq), (ks, bk) = rows, cols
    cm = read_tree(cols_meta, ks, bk)
    rows, cols = qs + jnp.arange(bq), ks + jnp.arange(bk)
    return rule.keep(rm, cm, rows, cols), rule.boost(rm, cm, rows, cols)


def init(kind: Strategy, x: Any, *others: Any, dtype: Any) -> Rows:
    """``kind.init`` for the rows of ``x`` (a pytree of them), varying like ``x`` and ``others``."""
    return kind.init(_tiles.row_zeros(x, dtype, *others))


def backward(tiles: Tiles, stat: jax.Array, g: jax.Array, into: tuple | None = None) -> tuple:
    """Cotangents ``(dx, dys, dscale, dbias)`` of ``tiles``' rows, columns and scalars for
    per-row cotangents ``g``, tile by tile (and of the hardness strength last, with a
    rule's ``hardness``).

    Two sweeps recompute every tile's ``dz``: one over query blocks sums each block's
    ``dx`` (and the scalars' gradients) over the key blocks, one over key blocks sums
    each block's ``dy`` over the query blocks. A block's gradient is accumulated in
    ``scale``'s dtype and written in its input's dtype: no batch-sized array ever
    exists in a dtype wider than the inputs'. ``dx`` and ``dy`` are the cotangents of
    ``score.leaf(x)`` and ``score.leaf(ys)``.

    ``into``: ``(dx_buf, dy_buf)``, buffers the gradients are *added* to (returned
    updated, in place of ``dx, dy``); ``dy_buf`` None adds ``dy`` to the array under
    the updated ``dx_buf`` (``x`` and ``ys`` are rows of one array). Without it
    ``dx`` and ``dy`` are written over copies of ``x`` and ``ys``.
    """
    sweeps = _sweeps.Sweeps(tiles, stat, g)
    if into is not None:
        return sweeps.add_into(*into)
    # Every row of dx and dy is written, so their buffers start as x and ys (zeros
    # would be one batch-sized broadcast, shared and copied by both). dx needs every
    # row of ys; then dy is written *over* ys, block by block (a last, overlapping
    # block reads rows already holding dy only in columns it masks). The second sweep's
    # block index depends on the first sweep's result, so it provably runs after it
    # and XLA updates ys's buffer in place: the loss backward holds three batch-sized
    # arrays (x, dx, ys/dy), not four.
    x, ys, score = tiles.x, tiles.ys, tiles.score
    dx_buf = _tiles.varying_like(score.leaf(x), x, ys)
    dx, *scalars = sweeps.query_sweep(dx_buf, add=False)
    dy_buf = _tiles.varying_like(score.leaf(ys), x, ys)
    dy = sweeps.key_sweep(dy_buf, zero_after(scalars[0]), add=False)
    return dx, dy, *scalars


def cotangent(score: Score, rows: Any, leaf: jax.Array) -> Any:
    """The cotangent of ``rows`` whose differentiated leaf's is ``leaf`` (None elsewhere)."""
    rest = jax.tree.map(lambda _: None, score.rest(rows))
    return score.join(leaf, rest)
