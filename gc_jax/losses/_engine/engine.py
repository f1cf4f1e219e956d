"""The one engine: a spec's families of logits, on one device or around a ring.

An :class:`Engine` runs a ``families.Spec`` in tiles of ``block`` rows. Its columns come
in *passes*: a pass visits one side's columns (documents ``y``, queries ``x``, a bank's
``by``/``bx``, or the gathered ``cy``/``cx``) with the families that score against
them. The local form (one device, or the columns gathered; ``axis_name`` None) is the
ring of one device: each family is its own pass, and its one block is visited once.
On a ring (``method="ring"``) each side is one pass around the ``axis_name`` devices
(``ring``'s schedule), each block travelling with its columns' metadata (ids, the
guide's rows, its first row's global index), so the masks of every tile are the dense
form's. A visit sweeps every family of the pass, this device's rows (queries, or
their positive documents) against the block it holds (``blockwise.sweep``).

The backward makes the same passes (``blockwise.backward(into=...)``): the rows'
gradients are added into one buffer per side that stays here, the block's into its
columns' buffer: locally the side's own (the same as the rows' when a family scores a
side against itself), on the ring an accumulator that travels one step behind its
block and comes home after the full circle. Locally the buffers are in the inputs'
dtypes, the first family's written over zeros; a spec of one family writes its
gradients over copies of its inputs instead (no zeros at all). On the ring they are
in the accumulation dtype, summing every device's contributions; the passes, each
pass's last ``ppermute`` and the scalars' ``psum`` are ordered by data dependencies
(``order.after``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses._engine import blockwise as _blockwise
from gc_jax.losses._engine import families as _families
from gc_jax.losses._engine import sweeps as _sweeps
from gc_jax.losses._engine import tiles as _tiles
from gc_jax.losses._engine import vjp as _vjp
from gc_jax.losses._engine.families import Family, Inputs, Spec, targets_of
from gc_jax.losses._engine.masks import Mask
from gc_jax.losses._engine.order import after, after_on_cpu
from gc_jax.losses._engine.precision import accumulation_dtype
from gc_jax.losses._engine.ring import around, around_back
from gc_jax.losses._engine.sides import Sides, is_bank
from gc_jax.losses._engine.tiles import Firsts


class Pass(NamedTuple):
    """The columns one pass visits: the side holding them (``cols``), the side of
    their metadata (``meta``: ``cols`` but for the gathered ones) and the families
    that score against them."""

    cols: str
    meta: str
    families: tuple[Family, ...]


def passes(spec: Spec, sides: Sides, ring: bool) -> tuple[Pass, ...]:
    """The passes of ``spec``: on a ring one per side, in the order of their rings;
    locally one per family, in the spec's order (its gathered columns if any)."""
    if not ring:
        return tuple(Pass(_families.cols_key(f, sides), f.cols, (f,)) for f in spec.families)
    order = ("y", "x", "by", "bx")
    of = lambda side: tuple(f for f in spec.families if f.cols == side)
    return tuple(Pass(s, s, of(s)) for s in order if of(s))


class State(NamedTuple):
    """What the backward adds into: a gradient buffer per side and the scalars' (None
    until the first family's; ``dbias`` stays None without a bias)."""

    grads: Sides
    dscale: Any = None
    dbias: Any = None
    dalpha: Any = None


class Engine(NamedTuple):
    """The engine (a ``vjp.Differentiable``) of ``spec``'s families in tiles of ``block`` rows,
    on the ring of ``axis_name`` (None: one device, or the gathered columns); static,
    hashable. Its inputs are ``families.Inputs``."""

    spec: Spec
    block: int
    axis_name: AxisName | None = None

    def forward(self, inputs: Inputs) -> tuple[jax.Array, tuple]:
        return forward(self, inputs)

    def backward(self, inputs: Inputs, stats: tuple, g: jax.Array) -> Inputs:
        grads, (dscale, dbias), dalpha = backward(self, inputs, stats, g)
        return Inputs(grads, dscale, _families.alpha_cotangent(inputs.meta, dalpha), dbias)

    def tiles(self, fam: Family, inputs: Inputs, here: tuple, own: bool) -> _tiles.Tiles:
        """Family ``fam``'s tiles of this device's rows against the block ``here``
        (``(columns, their metadata)``; ``own``: this device's, holding the targets)."""
        spec, (sides, scale, meta, bias) = self.spec, inputs
        cols, cols_meta = here
        targets = targets_of(fam, meta) if own else None
        mask = None if fam.rule is None else Mask(fam.rule, meta.rows.of(fam.rows), cols_meta)
        bias = jnp.zeros((), scale.dtype) if bias is None else bias
        rows = _families.rows_of(fam, sides, spec.k)
        return _tiles.Tiles(spec.kind, self.block, rows, cols, targets, scale, bias, mask,
                                spec.score)  # fmt: skip


def _here(p: Pass, inputs: Inputs) -> tuple:
    """The block a pass starts from: its columns and their metadata."""
    return inputs.sides.of(p.cols), inputs.meta.cols.of(p.meta)


def forward(engine: Engine, inputs: Inputs) -> tuple[jax.Array, tuple]:
    """Per-query losses and each group's statistic (its log-sum-exp), tile by tile."""
    spec, (sides, scale, _, _) = engine.spec, inputs
    carries = (_blockwise.init(spec.kind, sides.x, sides.y, dtype=scale.dtype),) * spec.groups
    ring = engine.axis_name is not None
    for n, p in enumerate(passes(spec, sides, ring)):

        def visit(here, carries, own, p=p):
            carries = list(carries)
            for fam in p.families:
                tiles = engine.tiles(fam, inputs, here, own)
                carries[fam.group] = _blockwise.sweep(tiles, carries[fam.group])
            return tuple(carries)

        here = _here(p, inputs)
        if n and ring:  # the second ring starts once the first is done
            here = after(here, carries)
        carries = around(visit, here, carries, engine.axis_name)
    losses, stats = zip(*(spec.kind.finish(c) for c in carries), strict=True)
    return _families.mean(losses), stats


def backward(engine: Engine, inputs: Inputs, stats: tuple, g: jax.Array) -> tuple:
    """Cotangents of the sides, of ``(scale, bias)`` (the bias's None without one) and
    of the hardness strength (None without hardness)."""
    spec, sides = engine.spec, inputs.sides
    g, ring = g / spec.groups, engine.axis_name is not None
    if not ring and len(spec.families) == 1 and not is_bank(spec.families[0].cols):
        return _written_over(engine, inputs, stats, g)
    state = State(_ring_buffers(spec, inputs) if ring else Sides())
    all_passes, args = passes(spec, sides, ring), (engine, inputs, stats, g)
    for n, p in enumerate(all_passes):
        here = _here(p, inputs)
        if ring:
            here = _ordered(here, state, stats, n, (spec, all_passes))
        else:
            state = state._replace(grads=_local_buffers(state.grads, p, sides))
        if is_bank(p.cols):  # a bank's columns: constants, the rows' sweep alone
            state = around(functools.partial(_bank_visit, p, args), here, state, engine.axis_name)
            continue
        start = _start(engine, p, inputs) if ring else _local_start(p, state)
        visit = functools.partial(_visit, p, args)
        home, state = around_back(visit, here, start, state, engine.axis_name)
        state = _home(state, p, home, ring)
    return _finish(engine, inputs, state)


def _visit(p: Pass, args: tuple, here: tuple, col_acc: Any, state: State, own: bool):
    """One block's gradients: every family of pass ``p`` adds its rows' into their
    buffer and the block's into ``col_acc`` (None: the rows' buffer holds the columns)."""
    engine, inputs, stats, g = args
    for fam in p.families:
        tiles = engine.tiles(fam, inputs, here, own)
        into = (_row_buffer(fam, state, engine.spec.k), col_acc)
        buf, col_acc, *more = _blockwise.backward(tiles, stats[fam.group], g, into)
        state = _add(fam, state, buf, more, inputs.bias is not None)
    return col_acc, state


def _bank_visit(p: Pass, args: tuple, here: tuple, state: State, own: bool) -> State:
    """One block of a bank's: the rows' gradients alone (its columns are constants)."""
    engine, inputs, stats, g = args
    for fam in p.families:
        tiles = engine.tiles(fam, inputs, here, own)  # a bank's: no target
        sweeps = _sweeps.Sweeps(tiles, stats[fam.group], g)
        buf, *more = sweeps.query_sweep(_row_buffer(fam, state, engine.spec.k), add=True)
        state = _add(fam, state, buf, more, inputs.bias is not None)
    return state


def _row_buffer(fam: Family, state: State, k: int) -> Any:
    """The buffer ``fam``'s rows' gradients are added to: ``x``'s, or the positives' rows
    of ``y``'s."""
    return state.grads.x if fam.rows == "x" else Firsts(state.grads.y, k)


def _add(fam: Family, state: State, buf: Any, more: tuple, bias: bool) -> State:
    """``state`` with ``fam``'s rows' buffer ``buf`` put back and its scalars'
    gradients ``more = (dscale, dbias[, dalpha])`` added."""
    ds, db, *da = more
    grads = state.grads.put("x", buf) if fam.rows == "x" else state.grads.put("y", buf.array)
    dbias = _plus(state.dbias, db) if bias else None
    return State(grads, _plus(state.dscale, ds), dbias, _families.add_alpha(state.dalpha, da))


def _plus(total: Any, more: jax.Array) -> jax.Array:
    return more if total is None else total + more


def _written_over(engine: Engine, inputs: Inputs, stats: tuple, g: jax.Array) -> tuple:
    """One family on one device: its gradients written over copies of its rows and
    columns (``blockwise.backward`` without ``into``), no buffer of zeros."""
    spec, sides = engine.spec, inputs.sides
    (fam,) = spec.families
    p = passes(spec, sides, False)[0]
    tiles = engine.tiles(fam, inputs, _here(p, inputs), True)
    dx, dcols, ds, db, *da = _blockwise.backward(tiles, stats[0], g)
    grads = Sides().put("x", dx).put(p.cols, dcols)
    dbias = None if inputs.bias is None else db
    dalpha = da[0] if da else None
    return _families.cotangents(spec.score, sides, grads), (ds, dbias), dalpha


def _local_buffers(grads: Sides, p: Pass, sides: Sides) -> Sides:
    """``grads`` with a buffer (zeros) for each side the pass's family adds into."""
    (fam,) = p.families
    keys = ("y" if fam.rows == "p" else "x",) + (() if is_bank(p.cols) else (p.cols,))
    for key in keys:
        if grads.of(key) is None:
            grads = grads.put(key, _families.zeros_of(sides.of(key), *sides))
    return grads


def _same(p: Pass) -> bool:
    """Whether the pass's rows and columns are rows of one array."""
    return ("y" if p.families[0].rows == "p" else "x") == p.cols


def _local_start(p: Pass, state: State) -> Any:
    """The local column buffer: the side's own (None: the rows' holds the columns)."""
    return None if _same(p) else state.grads.of(p.cols)


def _ring_buffers(spec: Spec, inputs: Inputs) -> Sides:
    """The ring's buffers of the rows' gradients, in the accumulation dtype: ``x``'s,
    and ``y``'s where a family's rows are the positive documents."""
    (x, y), acc, leaf = (inputs.sides.x, inputs.sides.y), inputs.scale.dtype, spec.score.leaf
    dy = _tiles.zeros(leaf(y), acc, x, y) if any(f.rows == "p" for f in spec.families) else None
    return Sides(x=_tiles.zeros(leaf(x), acc, x, y), y=dy)


def _start(engine: Engine, p: Pass, inputs: Inputs) -> jax.Array:
    """The accumulator that travels with a ring's first block: zeros."""
    x, y = inputs.sides.x, inputs.sides.y
    leaf = engine.spec.score.leaf(inputs.sides.of(p.cols))
    return _tiles.zeros(leaf, inputs.scale.dtype, x, y)


def _ordered(here: tuple, state: State, stats: tuple, n: int, spec_passes: tuple) -> tuple:
    """The ring's block ``here``, ordered: the next ring starts once the one before is
    done (its gradient home)."""
    spec, all_passes = spec_passes
    if n:
        return after(here, state)
    if spec.groups > 1 and len(all_passes) > 1:
        # With a partition function per direction the first ring needs only its own
        # group's statistic, and would run beside the forward's later rings
        # (independent collectives, see ``order``): it waits for every group's.
        return after_on_cpu(here, stats)
    return here


def _home(state: State, p: Pass, home: Any, ring: bool) -> State:
    """``state`` with the pass's column gradient ``home`` put in its side's buffer
    (added on the ring, where the rows' gradients are there already)."""
    if not ring:
        return state if _same(p) else state._replace(grads=state.grads.put(p.cols, home))
    mine = state.grads.of(p.cols)
    return state._replace(grads=state.grads.put(p.cols, home if mine is None else mine + home))


def _finish(engine: Engine, inputs: Inputs, state: State) -> tuple:
    """The cotangents from ``state``: on the ring ordered after every ``ppermute`` (the
    scalars' ``psum`` follows) and cast to the inputs' dtypes."""
    spec, sides = engine.spec, inputs.sides
    grads, dscale, dbias, dalpha = state
    if engine.axis_name is not None:
        dx, dscale, dbias, dalpha = after((grads.x, dscale, dbias, dalpha), grads.y)
        if len(spec.families) > 1:
            dscale, dalpha = after((dscale, dalpha), dx)
        leaf = spec.score.leaf
        grads = Sides(x=dx.astype(leaf(sides.x).dtype), y=grads.y.astype(leaf(sides.y).dtype))
    return _families.cotangents(spec.score, sides, grads), (dscale, dbias), dalpha


def call(engine: Engine, inputs: Inputs) -> jax.Array:
    """Per-query losses of this device's rows against every device's columns.

    ``inputs``: this device's sides and their metadata (locally, in the gather form, the
    gathered columns ``cx``/``cy`` too; on the ring, its bank's, whose blocks travel
    like ``y``'s), the targets indexing the columns as the metadata does. The scalars
    are cast to the accumulation dtype, varying like the rows; on the ring the metadata
    too (its blocks travel).
    """
    sides, scale, meta, bias = inputs
    arrays = [v for v in sides if v is not None]
    if engine.axis_name is not None:
        arrays = [sides.x, sides.y]
    scalars = (scale,) if bias is None else (scale, bias)
    acc = accumulation_dtype(*(engine.spec.score.leaf(v) for v in arrays), *scalars)
    scalars = tuple(None if v is None else jnp.asarray(v, acc) for v in (scale, bias))
    if engine.axis_name is not None:
        (scale, bias), meta = _tiles.varying_like((scalars, meta), *arrays)
    else:
        scale, bias = _tiles.varying_like(scalars, *arrays)
        if meta.rows.x is not None and meta.rows.x.alpha is not None:  # differentiated
            meta = _families.vary_alpha(meta, *arrays)
    return _vjp.rowwise(engine, Inputs(sides, scale, meta, bias))
