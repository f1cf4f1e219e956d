"""The specs of ``_families`` across devices on a ring (``method="ring"``).

On ``_ring``'s schedule every device keeps its rows; the columns travel. Each side whose
rows are some family's columns (documents ``y``, then queries ``x`` when a family
scores against queries) makes one pass around the ring, each block with its
metadata (ids, the guide's rows, its first row's global index), so the masks of
every tile are the dense form's. At each step every family with those columns
sweeps this device's rows (queries, or their positive documents) against the block
it holds, updating the rows' running log-sum-exps (``_blockwise.sweep``).

The backward makes the same passes: the rows' gradients are added into buffers
that stay here, each block's into an accumulator that travels one step behind it
and comes home after the full circle (``_blockwise.backward(into=...)``). The two
passes, and each pass's last ``ppermute`` and the scalars' ``psum``, are ordered by
data dependencies (``_order.after``); the schedule is ``_ring``'s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses._engine import blockwise as _blockwise
from gc_jax.losses._engine import families as _families
from gc_jax.losses._engine import sweeps as _sweeps
from gc_jax.losses._engine import tiles as _tiles
from gc_jax.losses._engine import vjp as _vjp
from gc_jax.losses._engine.families import Inputs, Spec, targets_of
from gc_jax.losses._engine.masks import Mask, Sides
from gc_jax.losses._engine.order import after, after_on_cpu
from gc_jax.losses._engine.ring import around, around_back
from gc_jax.losses._engine.tiles import Firsts


def _passes(spec: Spec) -> tuple[str, ...]:
    """The sides whose blocks travel, in the order of their rings."""
    sides = ("y", "x", "by", "bx")
    return tuple(s for s in sides if any(f.cols == s for f in spec.families))


def _rows(fam, sides: Sides, k: int) -> Any:
    return sides.x if fam.rows == "x" else Firsts(sides.y, k)


class RingPlan(NamedTuple):
    """The engine (``_vjp.Engine``) of ``spec``'s families on the ring of ``axis_name``
    in tiles of ``block`` rows (static, hashable); its inputs are ``_families.Inputs``."""

    spec: Spec
    block: int
    axis_name: AxisName

    def forward(self, inputs: Inputs) -> tuple[jax.Array, tuple]:
        return _forward(self, inputs)

    def backward(self, inputs: Inputs, stats: tuple, g: jax.Array) -> Inputs:
        one = _one_pass(self.spec)
        grads, scalars, dalpha = (_backward_one if one else _backward)(self, inputs, stats, g)
        return Inputs(grads, *scalars[:1], _families.alpha_cotangent(inputs.meta, dalpha),
                      scalars[1])  # fmt: skip

    def tiles(self, fam, inputs: Inputs, here: tuple, own: bool) -> _blockwise.Tiles:
        """Family ``fam``'s tiles of this device's rows against the block ``here``
        (``(columns, their metadata)``; ``own``: this device's, holding the targets)."""
        spec, (sides, scale, meta, bias) = self.spec, inputs
        reps, cols_meta = here
        targets = targets_of(fam, meta) if own else None
        mask = None if fam.rule is None else Mask(fam.rule, meta.rows.of(fam.rows), cols_meta)
        bias = jnp.zeros((), scale.dtype) if bias is None else bias
        rows = _rows(fam, sides, spec.k)
        return _blockwise.Tiles(spec.kind, self.block, rows, reps, targets, scale, bias, mask,
                                spec.score)  # fmt: skip


def _one_pass(spec: Spec) -> bool:
    """Whether ``spec`` is one family of queries against documents (one ring, whose
    backward needs no buffer for the documents but the one that travels)."""
    return len(spec.families) == 1 and spec.families[0][:2] == ("x", "y")


def _forward(plan: RingPlan, inputs: Inputs) -> tuple[jax.Array, tuple]:
    spec, (sides, scale, meta, _) = plan.spec, inputs
    kind = spec.kind
    carries = (_blockwise.init(kind, sides.x, sides.y, dtype=scale.dtype),) * spec.groups
    for n, side in enumerate(_passes(spec)):

        def visit(here, carries, own, side=side):
            carries = list(carries)
            for fam in (f for f in spec.families if f.cols == side):
                tiles = plan.tiles(fam, inputs, here, own)
                carries[fam.group] = _blockwise.sweep(tiles, carries[fam.group])
            return tuple(carries)

        here = (sides.of(side), meta.cols.of(side))
        if n:  # the second ring starts once the first is done
            here = after(here, carries)
        carries = around(visit, here, carries, plan.axis_name)
    losses, stats = zip(*(kind.finish(c) for c in carries), strict=True)
    return _families.mean(losses), stats


def _backward_one(plan: RingPlan, inputs: Inputs, stats: tuple, g: jax.Array):
    """The backward of one family of queries ``x`` against documents ``y``: ``dx`` and
    the scalars' gradients stay here, ``dy`` travels one step behind its block and
    comes home after the full circle."""
    spec, (sides, scale, meta, bias) = plan.spec, inputs
    (fam,), score, acc = spec.families, spec.score, scale.dtype
    x, ys, g = sides.x, sides.y, g / spec.groups
    boosts = fam.rule is not None and fam.rule.hardness is not None

    def visit(here, behind, grads, own):  # both sweeps add into the buffers they carry
        dx, *scalars = grads
        tiles = plan.tiles(fam, inputs, here, own)
        dx, behind, *more = _blockwise.backward(tiles, stats[0], g, into=(dx, behind))
        return behind, (dx, *(a + b for a, b in zip(scalars, more, strict=True)))

    zero = _tiles.scalar_zero(x, acc, ys)
    start = _tiles.zeros(score.leaf(ys), acc, x, ys)
    grads = (_tiles.zeros(score.leaf(x), acc, x, ys), zero, zero) + ((zero,) if boosts else ())
    here = (ys, meta.cols.of("y"))
    dys, grads = around_back(visit, here, start, grads, plan.axis_name)
    dx, dscale, dbias, *dalpha = after(grads, dys)  # every ppermute before the psum
    dx = dx.astype(score.leaf(x).dtype)
    dys = dys.astype(score.leaf(ys).dtype)
    grads = _families.cotangents(score, sides, Sides(x=dx, y=dys))
    dbias = None if bias is None else dbias
    return grads, (dscale, dbias), dalpha[0] if dalpha else None


def _add(fam, state: tuple, buf: Any, more: tuple) -> tuple:
    """``state = (dx, dy, dscale[, dalpha])`` with family ``fam``'s rows' gradient buffer
    ``buf`` put back and its scalars' gradients ``more = (ds, dbias[, da])`` added."""
    dx, dy, dscale, *dalpha = state
    ds, _, *da = more
    dx, dy = (buf, dy) if fam.rows == "x" else (dx, buf.array)
    dalpha = [a + b for a, b in zip(dalpha, da, strict=False)] if da else dalpha
    return dx, dy, dscale + ds, *dalpha


def _backward(plan: RingPlan, inputs: Inputs, stats: tuple, g: jax.Array):
    """The backward of several families (``inputs.bias`` None: no bias)."""
    spec, (sides, scale, meta, _) = plan.spec, inputs
    acc = scale.dtype
    zero, g = jnp.zeros((), acc), g / spec.groups
    x, y = sides.x, sides.y
    boosts = any(f.rule.hardness is not None for f in spec.families)
    state = (_tiles.zeros(x, acc, x, y), _tiles.zeros(y, acc, x, y), zero)
    state += (zero,) if boosts else ()  # the hardness strength's gradient
    buffer = lambda fam, state: state[0] if fam.rows == "x" else Firsts(state[1], spec.k)
    passes = _passes(spec)
    for n, side in enumerate(passes):

        def visit(here, col_acc, state, own, side=side):
            for fam in (f for f in spec.families if f.cols == side):
                tiles = plan.tiles(fam, inputs, here, own)
                into = (buffer(fam, state), col_acc)
                buf, col_acc, *more = _blockwise.backward(tiles, stats[fam.group], g, into)
                state = _add(fam, state, buf, more)
            return col_acc, state

        def bank_visit(here, state, own, side=side):  # the rows' gradients alone
            for fam in (f for f in spec.families if f.cols == side):
                tiles = plan.tiles(fam, inputs, here, own)  # a bank's: no target
                sweeps = _sweeps.Sweeps(tiles, stats[fam.group], g)
                buf, *more = sweeps.query_sweep(buffer(fam, state), add=True)
                state = _add(fam, state, buf, more)
            return state

        here = (sides.of(side), meta.cols.of(side))
        if n:  # the next ring starts once the one before is done (its gradient home)
            here = after(here, state)
        elif spec.groups > 1 and len(passes) > 1:
            # With a partition function per direction the first ring needs only its own
            # group's statistic, and would run beside the forward's later rings
            # (independent collectives, see ``_order``): it waits for every group's.
            here = after_on_cpu(here, stats)
        if side.startswith("b"):  # a bank's blocks travel for the rows' gradient alone
            state = around(bank_visit, here, state, plan.axis_name)
            continue
        start = _tiles.zeros(sides.of(side), acc, x, y)
        home, state = around_back(visit, here, start, state, plan.axis_name)
        dx, dy, *scalars = state
        state = (dx + home, dy, *scalars) if side == "x" else (dx, dy + home, *scalars)
    dx, dy, dscale, *dalpha = state
    dx, dscale, dalpha = after((dx, dscale, dalpha), dy)  # every ppermute before the psums
    dscale, dalpha = after((dscale, dalpha), dx)
    grads = Sides(x=dx.astype(x.dtype), y=dy.astype(y.dtype))  # a bank's columns: no gradient
    return grads, (dscale, None), dalpha[0] if dalpha else None


def call(plan: RingPlan, inputs: Inputs) -> jax.Array:
    """Per-query losses of this device's rows against every device's, on the ring.

    ``inputs``: this device's sides (its bank's too: their blocks travel like ``y``'s)
    and their metadata, the targets indexing this device's own block. The scalars are
    cast to the accumulation dtype; they and the metadata vary like the rows.
    """
    sides, scale, meta, bias = inputs
    leaf = plan.spec.score.leaf
    scalars = (scale,) if bias is None else (scale, bias)
    acc = _blockwise.accumulation_dtype(leaf(sides.x), leaf(sides.y), *scalars)
    scalars = tuple(None if v is None else jnp.asarray(v, acc) for v in (scale, bias))
    (scale, bias), meta = _tiles.varying_like((scalars, meta), sides.x, sides.y)
    return _vjp.rowwise(plan, Inputs(sides, scale, meta, bias))
