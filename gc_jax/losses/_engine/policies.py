"""Where an engine's columns come from: :class:`Local` and :class:`Ring`, its two policies.

``engine.Engine`` runs the same passes and visits under both; a policy says what
differs. :class:`Local` (one device, or the columns gathered) makes each family its own
pass over the block it holds, visited once; the backward adds into buffers in the
inputs' dtypes, each side's own (zeros before its first family), and a spec of one
family writes its gradients over copies of its inputs instead. :class:`Ring` makes each
side one pass around the ``axis_name`` devices (``ring``'s schedule), its blocks
travelling with their metadata; the backward adds into buffers in the accumulation
dtype, the columns' travelling one step behind their block, and orders the passes,
each pass's last ``ppermute`` and the scalars' ``psum`` by data dependencies
(``order.after``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from gc_jax._base import AxisName
from gc_jax.losses._engine import families as _families
from gc_jax.losses._engine import tiles as _tiles
from gc_jax.losses._engine.families import Family, Inputs, Metadata, Spec
from gc_jax.losses._engine.order import after, after_on_cpu
from gc_jax.losses._engine.sides import Side, Sides, is_bank


class Pass(NamedTuple):
    """The columns one pass visits: the side holding them (``cols``), the side of
    their metadata (``meta``: ``cols`` but for the gathered ones) and the families
    that score against them."""

    cols: Side
    meta: Side
    families: tuple[Family, ...]


class State(NamedTuple):
    """What the backward adds into: a gradient buffer per side and the scalars' (None
    until the first family's; ``dbias`` stays None without a bias)."""

    grads: Sides
    dscale: Any = None
    dbias: Any = None
    dalpha: Any = None


class Backward(NamedTuple):
    """What a policy reads at each pass of the backward: the spec, the sides, the
    forward's statistics and every pass."""

    spec: Spec
    sides: Sides
    stats: tuple
    passes: tuple[Pass, ...]


class Local(NamedTuple):
    """One device, or the columns gathered: the ring of one device, visited once."""

    @property
    def axis_name(self) -> None:
        return None

    def passes(self, spec: Spec, sides: Sides) -> tuple[Pass, ...]:
        """One pass per family, in the spec's order (its gathered columns if any)."""
        return tuple(Pass(_families.cols_key(f, sides), f.cols, (f,)) for f in spec.families)

    def arrays(self, sides: Sides) -> list:
        """The arrays the scalars vary like: every side's."""
        return [v for v in sides if v is not None]

    def vary(self, scalars: tuple, meta: Metadata, arrays: list) -> tuple:
        """The scalars and the hardness strength (differentiated) varying like ``arrays``."""
        rows = meta.rows.x
        alpha = None if rows is None else rows.alpha
        scalars, alpha = _tiles.varying_like((scalars, alpha), *arrays)
        return scalars, meta if alpha is None else _families.with_alpha(meta, alpha)

    def start_pass(self, here: tuple, carries: tuple, n: int) -> tuple:
        """The forward's block ``here`` of pass ``n``: as it is."""
        return here

    def writes_over(self, spec: Spec) -> bool:
        """A spec of one family (no bank's) writes its gradients over copies of its inputs."""
        return len(spec.families) == 1 and not is_bank(spec.families[0].cols)

    def buffers(self, spec: Spec, inputs: Inputs) -> Sides:
        """None yet: each pass adds its sides' buffers (:meth:`enter`)."""
        return Sides()

    def enter(self, p: Pass, n: int, here: tuple, state: State, now: Backward) -> tuple:
        """``(here, state)`` for the backward's pass ``p``: a buffer (zeros) for each side
        its family adds into."""
        (fam,), sides = p.families, now.sides
        keys = (_rows_side(fam),) + (() if is_bank(p.cols) else (p.cols,))
        grads = state.grads
        for key in keys:
            if grads.of(key) is None:
                grads = grads.put(key, _families.zeros_of(sides.of(key), *sides))
        return here, state._replace(grads=grads)

    def start(self, p: Pass, inputs: Inputs, state: State, leaf: Any) -> Any:
        """The column buffer: the side's own (None: the rows' holds the columns)."""
        return None if _same(p) else state.grads.of(p.cols)

    def home(self, state: State, p: Pass, home: Any) -> State:
        """``state`` with the pass's column gradient ``home`` put in its side's buffer."""
        return state if _same(p) else state._replace(grads=state.grads.put(p.cols, home))

    def finish(self, spec: Spec, sides: Sides, state: State) -> State:
        """The gradients as they are (in the inputs' dtypes already)."""
        return state


class Ring(NamedTuple):
    """Around the ring of ``axis_name`` devices, each side one pass."""

    axis_name: AxisName

    def passes(self, spec: Spec, sides: Sides) -> tuple[Pass, ...]:
        """One pass per side, in the order of their rings."""
        of = lambda side: tuple(f for f in spec.families if f.cols == side)
        return tuple(Pass(s, s, of(s)) for s in ("y", "x", "by", "bx") if of(s))

    def arrays(self, sides: Sides) -> list:
        """The arrays the scalars and the metadata vary like: the rows'."""
        return [sides.x, sides.y]

    def vary(self, scalars: tuple, meta: Metadata, arrays: list) -> tuple:
        """The scalars and the metadata (its blocks travel) varying like ``arrays``."""
        return _tiles.varying_like((scalars, meta), *arrays)

    def start_pass(self, here: tuple, carries: tuple, n: int) -> tuple:
        """The forward's block ``here`` of pass ``n``: the second ring starts once the
        first is done."""
        return after(here, carries) if n else here

    def writes_over(self, spec: Spec) -> bool:
        return False

    def buffers(self, spec: Spec, inputs: Inputs) -> Sides:
        """The rows' gradients' buffers, in the accumulation dtype: ``x``'s, and ``y``'s
        where a family's rows are the positive documents."""
        (x, y), acc, leaf = (inputs.sides.x, inputs.sides.y), inputs.scale.dtype, spec.score.leaf
        dy = _tiles.zeros(leaf(y), acc, x, y) if any(f.rows == "p" for f in spec.families) else None
        return Sides(x=_tiles.zeros(leaf(x), acc, x, y), y=dy)

    def enter(self, p: Pass, n: int, here: tuple, state: State, now: Backward) -> tuple:
        """``(here, state)`` for the backward's pass ``p``, ``here`` ordered: the next ring
        starts once the one before is done (its gradient home)."""
        if n:
            return after(here, state), state
        if now.spec.groups > 1 and len(now.passes) > 1:
            # With a partition function per direction the first ring needs only its own
            # group's statistic, and would run beside the forward's later rings
            # (independent collectives, see ``order``): it waits for every group's.
            return after_on_cpu(here, now.stats), state
        return here, state

    def start(self, p: Pass, inputs: Inputs, state: State, leaf: Any) -> Any:
        """The accumulator that travels with the first block: zeros."""
        x, y = inputs.sides.x, inputs.sides.y
        return _tiles.zeros(leaf(inputs.sides.of(p.cols)), inputs.scale.dtype, x, y)

    def home(self, state: State, p: Pass, home: Any) -> State:
        """``state`` with the pass's column gradient ``home`` added to its side's buffer
        (the rows' gradients are there already)."""
        mine = state.grads.of(p.cols)
        return state._replace(grads=state.grads.put(p.cols, home if mine is None else mine + home))

    def finish(self, spec: Spec, sides: Sides, state: State) -> State:
        """``state`` ordered after every ``ppermute`` (the scalars' ``psum`` follows), its
        gradients cast to the inputs' dtypes."""
        grads, dscale, dbias, dalpha = state
        dx, dscale, dbias, dalpha = after((grads.x, dscale, dbias, dalpha), grads.y)
        if len(spec.families) > 1:
            dscale, dalpha = after((dscale, dalpha), dx)
        leaf = spec.score.leaf
        grads = Sides(x=dx.astype(leaf(sides.x).dtype), y=grads.y.astype(leaf(sides.y).dtype))
        return State(grads, dscale, dbias, dalpha)


Policy = Local | Ring


def _rows_side(fam: Family) -> Side:
    """The side holding ``fam``'s rows: ``x``, or ``y`` for the positive documents."""
    return "y" if fam.rows == "p" else "x"


def _same(p: Pass) -> bool:
    """Whether the pass's rows and columns are rows of one array."""
    return _rows_side(p.families[0]) == p.cols
