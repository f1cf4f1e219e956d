"""The backward of the blockwise losses: two sweeps over one loss's tiles.

The sweep over query blocks forms each block's gradient (and the scalars') from every
key block; the sweep over key blocks forms each key block's gradient from every query
block, so no batch-sized gradient is carried across blocks. Each either writes its
gradients (over copies of the inputs: ``blockwise.backward``) or adds them into
buffers that several families share (``engine``).
"""

from __future__ import annotations

import jax.numpy as jnp

from gc_jax import _narrow
from gc_jax.losses._engine import tiles as _tiles
from gc_jax.losses._engine.tiles import (
    Firsts,
    around,
    blocks,
    count,
    first,
    logits,
    loop,
    read,
    read_tree,
    rows_in,
    sizes,
    update,
    write,
)


class Sweeps:
    """The two sweeps of ``blockwise.backward`` over one loss's tiles
    (``tiles.Tiles``), given the forward's per-row statistic ``stat`` and the
    per-row cotangents ``g``.

    ``score`` (``scores``) scores a tile and sends its ``dz`` back to the rows: the
    gradients are those of ``score.leaf(x)`` and ``score.leaf(ys)``, the buffers
    shaped like them.
    """

    def __init__(self, tiles, stat, g):
        kind, block, x, ys, targets, scale, bias, mask, score = tiles
        self.kind, self.x, self.ys, self.scale, self.bias = kind, x, ys, scale, bias
        self.score, self.n, self.m = score, count(x), count(ys)
        self.bq, self.bk = sizes(block, self.n, self.m)
        self.rule, rows_meta, self.cols_meta = mask or (None, None, None)
        self.rows = (x, targets, stat, g, rows_meta)
        # A rule with hardness boosts some logits by ``alpha * raw``: its gradient too.
        self.boosts = self.rule is not None and self.rule.hardness is not None

    def read_rows(self, rows, i):
        qs = first(i, self.bq, self.n)
        return read_tree(rows, qs, self.bq), _tiles.own_rows(qs, self.bq, i * self.bq), qs

    def tile_grad(self, row, qs, yk, ks, own, cm):
        """A tile's raw scores, what its score keeps for the gradients, ``dz`` and the
        pairs its rule boosts (None without hardness): a block of queries against keys
        from ``ks``."""
        xq, tq, sq, gq, rm = row
        keep = boost = None
        if self.rule is not None:
            keep = self.rule.keep(rm, cm, *self.positions(qs, ks))
            boost = self.rule.boost(rm, cm, *self.positions(qs, ks))
        raw, scored = self.score.raw(xq, yk, self.scale.dtype)
        z, valid, pos = logits(raw, tq, (ks, own), (self.scale, self.bias), (keep, boost))
        dz = gq[:, None] * self.kind.dlogits(z, valid, pos, sq)
        return raw, scored, dz, None if boost is None else boost[0]

    def scalar_grads(self, scalars, dz, raw, boosted):
        """``(dscale, dbias[, dalpha])`` plus one tile's: ``dalpha`` (with hardness) sums
        ``dz * raw`` over the boosted pairs, whose logits gain ``alpha * raw``."""
        dscale, dbias, *dalpha = scalars
        out = (dscale + (dz * raw).sum(), dbias + dz.sum())
        if boosted is None:
            return out
        return (*out, dalpha[0] + jnp.where(boosted, dz * raw, 0).sum())

    def positions(self, qs, ks):
        return qs + jnp.arange(self.bq), ks + jnp.arange(self.bk)

    def query_sweep(self, dx, add):
        """``dx`` with each query block's gradient written (or added), and the scalars':
        ``(dx, dscale, dbias)``, and ``dalpha`` last with a rule's hardness.

        Adding, the block's current rows (for :class:`Firsts`, their slab) are read
        before its loop over keys and carried through it, so that they are a buffer of
        their own: a read fused into the block's update would keep XLA:CPU from
        updating a narrow-float buffer in place (a copy of the whole buffer per block).
        """
        acc, bq, bk, m, scale = self.scale.dtype, self.bq, self.bk, self.m, self.scale

        def query_block(i, carry, ys, cols_meta, *rows):
            row, own, qs = self.read_rows(rows, i)

            def step(j, carry, ys, cols_meta):
                dxq, scalars, *context = carry
                ks = first(j, bk, m)
                yk = read_tree(ys, ks, bk)
                cm = read_tree(cols_meta, ks, bk)
                raw, scored, dz, boosted = self.tile_grad(row, qs, yk, ks, j * bk, cm)
                grad = self.score.dx(scored, row[0], yk, dz, acc)
                # Adding: rows of the previous block hold their share already.
                keep = own.reshape(own.shape + (1,) * (grad.ndim - 2))  # [bq, 1, ...]
                dxq = dxq + (jnp.where(keep, scale * grad, 0) if add else grad)
                dz = jnp.where(own, dz, 0)  # rows of the previous block: summed there
                # The context made to depend on the loop (else XLA forwards it past the
                # loop and fuses its read into the update again): it adds zero.
                context = [
                    c + jnp.where(dxq[0, 0] > jnp.inf, 1, 0).astype(c.dtype) for c in context
                ]
                return dxq, self.scalar_grads(scalars, dz, raw, boosted), *context

            dx, scalars = carry
            if add:
                context = around(dx, qs, bq)
                init = (rows_in(dx, context).astype(acc), scalars, context)
            else:
                init = (_tiles.zeros(self.score.leaf(row[0]), acc, self.x, ys), scalars)
            dxq, scalars, *context = loop(step, blocks(m, bk), init, ys, cols_meta)
            if not add:
                return write(dx, (scale * dxq).astype(dx.dtype), qs), scalars
            return update(dx, dxq.astype(dx.dtype), qs, context[0]), scalars

        zero = _tiles.scalar_zero(self.ys, acc, self.x)
        init = (dx, (zero,) * (3 if self.boosts else 2))
        dx, scalars = loop(query_block, blocks(self.n, bq), init, self.ys, self.cols_meta,
                           *self.rows)  # fmt: skip
        return dx, *scalars

    def key_grad(self, j, yk, cols_meta, rows, init=None):
        """``dy`` of key block ``j`` (``[bk, d]``, zero in rows of the block before), or
        ``init`` plus it (``init``: read before the loop, as in :meth:`query_sweep`)."""
        acc, ks, scale = self.scale.dtype, first(j, self.bk, self.m), self.scale
        cm = read_tree(cols_meta, ks, self.bk)

        adding = init is not None

        def step(i, dyk, *rows):
            row, own, qs = self.read_rows(rows, i)
            _, scored, dz, _ = self.tile_grad(row, qs, yk, ks, j * self.bk, cm)
            grad = self.score.dy(scored, row[0], yk, jnp.where(own, dz, 0), acc)
            return dyk + (scale * grad if adding else grad)

        if adding:
            return loop(step, blocks(self.n, self.bq), init, *rows)
        init = _tiles.zeros(self.score.leaf(yk), acc, self.x, self.ys)
        return scale * loop(step, blocks(self.n, self.bq), init, *rows)

    def key_sweep(self, dy, zero, add):
        """``dy`` with each key block's gradient written over ``ys``'s rows (or added).

        Written over: each block of ``ys``'s differentiated leaf is read from ``dy`` just
        before it is overwritten, and that leaf itself is not read (so its buffer can
        become ``dy``'s).
        """
        bk, m, acc, score = self.bk, self.m, self.scale.dtype, self.score
        leaf, rest = score.leaf(self.ys) if add else None, score.rest(self.ys)

        def keys(dy, leaf, rest, start):
            rows = read(dy if leaf is None else leaf, start, bk)
            return score.join(rows, read_tree(rest, start, bk))

        def key_block(j, dy, zero, leaf, rest, cols_meta, *rows):
            j = j + zero  # ``zero`` is 0 and orders this sweep after the first
            init = read(dy, j * bk, bk).astype(acc) if add else None
            dyk = self.key_grad(j, keys(dy, leaf, rest, j * bk), cols_meta, rows, init)
            return write(dy, dyk.astype(dy.dtype), j * bk)

        dy = loop(key_block, m // bk, dy, zero, leaf, rest, self.cols_meta, *self.rows)
        if m % bk:  # the last block overlaps the one before: only its own rows are written
            own = m % bk
            yk = keys(dy, leaf, rest, m - bk)
            last = self.key_grad(blocks(m, bk) - 1, yk, self.cols_meta, self.rows)[bk - own :]
            if add:
                last = last + read(dy, m - own, own).astype(acc)
            last = last.astype(dy.dtype)
            dy = _narrow.update_in_place(lambda dy: write(dy, last, m - own), dy)
        return dy

    def add_into(self, dx_buf, dy_buf):
        """Adds both sweeps' gradients into the buffers: ``(dx_buf, dy_buf, dscale, dbias)``
        (and ``dalpha`` last, with a rule's hardness)."""
        dx_buf, *scalars = self.query_sweep(dx_buf, add=True)
        zero = jnp.zeros((), jnp.int32)
        if dy_buf is None:  # the keys are rows of the array under dx_buf
            if isinstance(dx_buf, Firsts):
                under = self.key_sweep(dx_buf.array, zero, add=True)
                return Firsts(under, dx_buf.k), None, *scalars
            return self.key_sweep(dx_buf, zero, add=True), None, *scalars
        return dx_buf, self.key_sweep(dy_buf, zero, add=True), *scalars
