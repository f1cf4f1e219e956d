"""The one engine: a spec's families of logits, on one device or around a ring.

An :class:`Engine` runs a ``families.Spec`` in tiles of ``block`` rows. Its columns come
in *passes*: a pass visits one side's columns (documents ``y``, queries ``x``, a bank's
``by``/``bx``, or the gathered ``cy``/``cx``) with the families that score against
them. A visit sweeps every family of the pass, this device's rows (queries, or their
positive documents) against the block it holds (``blockwise.sweep``); ``ring``'s
schedule brings the blocks (one device: its own block, once).

The backward makes the same passes (``blockwise.backward(into=...)``): the rows'
gradients are added into one buffer per side that stays here, the block's into its
columns' buffer. Where the columns come from is the engine's *policy*
(``policies``): :class:`policies.Local` (one device, or the columns gathered: each family
its own pass, the buffers each side's own, in the inputs' dtypes) or
:class:`policies.Ring` (each side one pass around the ``axis_name`` devices, each block
travelling with its columns' metadata so the masks of every tile are the dense form's,
the column buffer an accumulator travelling one step behind its block, in the
accumulation dtype, the passes ordered by data dependencies).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gc_jax.losses._engine import blockwise as _blockwise
from gc_jax.losses._engine import families as _families
from gc_jax.losses._engine import sweeps as _sweeps
from gc_jax.losses._engine import tiles as _tiles
from gc_jax.losses._engine import vjp as _vjp
from gc_jax.losses._engine.families import Family, Inputs, Spec, targets_of
from gc_jax.losses._engine.masks import Mask
from gc_jax.losses._engine.policies import Backward, Local, Pass, Policy, State
from gc_jax.losses._engine.precision import accumulation_dtype
from gc_jax.losses._engine.ring import around, around_back
from gc_jax.losses._engine.sides import Sides, is_bank
from gc_jax.losses._engine.tiles import Firsts


class Engine(NamedTuple):
    """The engine (a ``vjp.Differentiable``) of ``spec``'s families in tiles of ``block`` rows,
    its columns where ``policy`` says (``policies.Local`` or ``policies.Ring``); static,
    hashable. Its inputs are ``families.Inputs``."""

    spec: Spec
    block: int
    policy: Policy = Local()

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
    spec, (sides, scale, _, _), policy = engine.spec, inputs, engine.policy
    carries = (_blockwise.init(spec.kind, sides.x, sides.y, dtype=scale.dtype),) * spec.groups
    for n, p in enumerate(policy.passes(spec, sides)):

        def visit(here, carries, own, p=p):
            carries = list(carries)
            for fam in p.families:
                tiles = engine.tiles(fam, inputs, here, own)
                carries[fam.group] = _blockwise.sweep(tiles, carries[fam.group])
            return tuple(carries)

        here = policy.start_pass(_here(p, inputs), carries, n)
        carries = around(visit, here, carries, policy.axis_name)
    losses, stats = zip(*(spec.kind.finish(c) for c in carries), strict=True)
    return _families.mean(losses), stats


def backward(engine: Engine, inputs: Inputs, stats: tuple, g: jax.Array) -> tuple:
    """Cotangents of the sides, of ``(scale, bias)`` (the bias's None without one) and
    of the hardness strength (None without hardness)."""
    spec, sides, policy = engine.spec, inputs.sides, engine.policy
    g = g / spec.groups
    if policy.writes_over(spec):
        return _written_over(engine, inputs, stats, g)
    state = State(policy.buffers(spec, inputs))
    all_passes, args = policy.passes(spec, sides), (engine, inputs, stats, g)
    now = Backward(spec, sides, stats, all_passes)
    for n, p in enumerate(all_passes):
        here, state = policy.enter(p, n, _here(p, inputs), state, now)
        if is_bank(p.cols):  # a bank's columns: constants, the rows' sweep alone
            state = around(functools.partial(_bank_visit, p, args), here, state, policy.axis_name)
            continue
        start = policy.start(p, inputs, state, spec.score.leaf)
        visit = functools.partial(_visit, p, args)
        home, state = around_back(visit, here, start, state, policy.axis_name)
        state = policy.home(state, p, home)
    grads, dscale, dbias, dalpha = policy.finish(spec, sides, state)
    return _families.cotangents(spec.score, sides, grads), (dscale, dbias), dalpha


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
    p = engine.policy.passes(spec, sides)[0]
    tiles = engine.tiles(fam, inputs, _here(p, inputs), True)
    dx, dcols, ds, db, *da = _blockwise.backward(tiles, stats[0], g)
    grads = Sides().put("x", dx).put(p.cols, dcols)
    dbias = None if inputs.bias is None else db
    dalpha = da[0] if da else None
    return _families.cotangents(spec.score, sides, grads), (ds, dbias), dalpha


def call(engine: Engine, inputs: Inputs) -> jax.Array:
    """Per-query losses of this device's rows against every device's columns.

    ``inputs``: this device's sides and their metadata (locally, in the gather form, the
    gathered columns ``cx``/``cy`` too; on the ring, its bank's, whose blocks travel
    like ``y``'s), the targets indexing the columns as the metadata does. The scalars
    are cast to the accumulation dtype, varying like the rows (the policy's
    ``vary``: on the ring the metadata too, its blocks travel).
    """
    sides, scale, meta, bias = inputs
    arrays = engine.policy.arrays(sides)
    scalars = (scale,) if bias is None else (scale, bias)
    acc = accumulation_dtype(*(engine.spec.score.leaf(v) for v in arrays), *scalars)
    scalars = tuple(None if v is None else jnp.asarray(v, acc) for v in (scale, bias))
    (scale, bias), meta = engine.policy.vary(scalars, meta, arrays)
    return _vjp.rowwise(engine, Inputs(sides, scale, meta, bias))
