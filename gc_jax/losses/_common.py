"""What every loss shares: argument checks, the reduction, and where the rows are scored.

:func:`run` reads how the rows lie (one device, ``shard_map``/``pmap``, or ``jit`` over
a mesh) and calls a loss's per-device body there; :func:`dispatch`, the one dispatcher, is
that body's per-row losses for every loss (a spec of its families of logits) in the
dense, blockwise, gather or ring form; :func:`reduce` turns this device's per-row
losses into the global loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gc_jax import _distributed, _layout, _validation
from gc_jax._base import AxisName
from gc_jax.losses import _bank, _devices, _options
from gc_jax.losses._engine import engine as _engine
from gc_jax.losses._engine import families as _families
from gc_jax.losses._engine import tiles as _tiles
from gc_jax.losses._engine.families import Metadata
from gc_jax.losses._engine.policies import Ring
from gc_jax.losses._engine.precision import accumulation_dtype
from gc_jax.losses._engine.sides import Sides

REDUCTIONS = ("mean", "sum", "none")
METHODS = ("auto", "ring", "gather")
GATHER_BYTES = 64 * 2**20
"""``method="auto"`` gathers while the gathered inputs take at most this much per device."""


def check_pair(x: jax.Array, y: jax.Array, multiple: bool) -> int:
    """Checks ``x`` and ``y`` are ``[rows, dim]`` alike; returns ``k = len(y) // len(x)``.

    ``multiple``: ``y`` may hold ``k`` rows per row of ``x`` (else exactly one).
    """
    for name, v in (("x", x), ("y", y)):
        if getattr(v, "ndim", None) != 2:
            raise ValueError(
                f"{name} must be a 2-D [rows, dim] array, got shape {getattr(v, 'shape', v)}."
            )
    if x.shape[1] != y.shape[1]:
        raise ValueError(
            f"x and y must have the same embedding dim, got x: {x.shape} and y: {y.shape}."
        )
    if multiple:
        if y.shape[0] % x.shape[0]:
            raise ValueError(
                f"len(y) must be a multiple of len(x) (k rows of y per query: its positive, "
                f"then hard negatives), got len(x)={x.shape[0]}, len(y)={y.shape[0]}."
            )
    elif x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have the same number of rows, got {x.shape} and {y.shape}.")
    return y.shape[0] // x.shape[0]


def docs_per_query(
    rows: int, docs: int, given: Any, axis_name: AxisName | None, names=("x", "y")
) -> int:
    """``k``, the documents per query: ``given``, checked against ``docs`` rows for
    ``rows`` queries, or ``docs // rows`` where that cannot be a mistake.

    Under ``pmap`` or ``shard_map(check_vma=False)`` nothing tells this device's ``k``
    documents per query from every device's documents passed replicated
    (``in_axes=None``, ``P()``), which would be read as hard negatives: a wrong loss,
    silently. There, more documents than queries need ``docs_per_query=`` said.
    """
    x, y = names
    if given is not None:
        k = _validation.positive_int(given, "docs_per_query")
        if docs != k * rows:
            raise ValueError(
                f"docs_per_query={k} says {y} holds {k} rows per query: {k * rows} for "
                f"len({x})={rows}, got len({y})={docs}. Across devices both are this "
                f"device's rows: split {y} like {x}, its {k} rows per query together."
            )
        return k
    untyped = axis_name is not None and _layout.is_bound(axis_name)
    untyped = untyped and _distributed.typed_axes(axis_name) is None
    if untyped and docs != rows:
        raise ValueError(
            f"{y} has {docs} rows for this device's {rows} queries under pmap or "
            f"shard_map(check_vma=False), where gc_jax cannot tell {docs // rows} documents "
            f"per query from every device's documents passed replicated (in_axes=None, "
            f"in_specs=P()), which would be read as hard negatives: a wrong loss, silently. "
            f"If each query has {docs // rows} documents here, say docs_per_query="
            f"{docs // rows}; if {y} holds every device's documents, split it like {x} "
            f"(pmap in_axes=0, shard_map in_specs=P(axis_name))."
        )
    return docs // rows


def check_options(reduction: str, block_size: Any, method: Any) -> tuple[int | None, str]:
    """Checks the options every loss takes; returns ``(block_size, method)``."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
    if block_size is not None:
        block_size = _validation.positive_int(block_size, "block_size")
    if method not in METHODS:
        raise ValueError(
            f"method must be one of {METHODS}, got {method!r}: 'ring' passes the other "
            "side's blocks around the devices (memory flat in the number of devices), "
            "'gather' all-gathers it, 'auto' picks (see gc_jax.losses)."
        )
    return block_size, method


class Where(NamedTuple):
    """Where and how a loss's per-device body scores its rows (static).

    Attributes:
      block_size: rows per tile (None: the dense form; on the ring, one tile per
        travelling block).
      axis_name: the devices' axis (None: one device, or every array whole under
        ``jit`` over a mesh).
      ring: the other side travels around the devices (else it is gathered).
    """

    block_size: int | None
    axis_name: AxisName | None
    ring: bool

    def block(self, rows: int) -> int:
        """Rows per tile: ``block_size``, or ``rows`` (one tile) without one."""
        return self.block_size or rows


def num_devices(axis_name: AxisName | None) -> int:
    """How many devices share the batch along ``axis_name`` (1 without one)."""
    return 1 if axis_name is None else jax.lax.axis_size(axis_name)


def reduce(per_row: jax.Array, global_rows: int, reduction: str, axis_name) -> jax.Array:
    """Reduces this device's per-row losses into the global mean or sum."""
    if reduction == "none":
        return per_row
    share = jnp.sum(per_row)
    if reduction == "mean":
        share = share / global_rows
    return _distributed.global_loss(share, axis_name)


def dispatch(spec, x, y, scalars, where: Where, options=None) -> jax.Array:
    """Per-row losses of this device's ``x`` against every device's ``y``: the dense,
    blockwise, gather or ring form of every loss.

    Args:
      spec: the loss's families of logits (``_engine.families.Spec``: its strategy
        and score).
      x: this device's rows (an array, or a pytree of per-row leaves: MaxSim's
        tokens and mask).
      y: this device's columns (``k`` per row of ``x``), likewise.
      scalars: ``(scale, bias)``: the logits' multiplier, and what is added to every
        logit (None: nothing).
      where: where the rows are scored (:class:`Where`).
      options: the checked ``_options.Options`` whose ids, guide and bank the families'
        rules read (their arrays split like ``x`` and ``y``); None: none.

    Returns:
      This device's per-row losses.
    """
    options = _options.Options() if options is None else options
    if where.ring:
        return _ring_rows(spec, (x, y), scalars, where, options)
    return _gathered_rows(spec, (x, y), scalars, where, options)


def _gathered_rows(spec, sides: tuple, scalars: tuple, where: Where, options: _options.Options):
    """The dense and blockwise forms: every device's columns gathered (or whole, under
    ``jit`` over a mesh); the metadata numbers the columns from every device's first."""
    (x, y), axis_name = sides, where.axis_name
    n = _tiles.count(x)
    if axis_name is None:  # one device, or jit over a mesh: every array whole
        options = options.map_arrays(lambda v: _layout.reshard_typed(v, P()))
        offset, cols = 0, options
        whole_x = where.block_size is not None or len(spec.families) > 1
        x, y = _scoring(x, y, whole_x)
        sides = Sides(x=x, y=y)
    else:
        gather = lambda v: jax.tree.map(lambda a: _distributed.all_gather(a, axis_name), v)
        offset, cols = _distributed.axis_index_offset(n, axis_name), options.map_arrays(gather)
        sides = _gathered(spec, x, y, gather)
    meta = _metadata(spec, options, (offset, 0), cols)
    meta = meta._replace(targets=_options.targets(spec, offset, n))
    if options.bank is not None:  # every device's bank (gathered or whole): from row 0
        sides, meta = _bank.with_columns(cols.bank, sides, meta, 0, options)
    if where.block_size is not None:
        engine = _engine.Engine(spec, where.block_size)
        return _engine.call(engine, _families.Inputs(sides, scalars[0], meta, scalars[1]))
    return _families.dense(spec, sides, _dense_scalars(spec, sides, scalars), meta)


def _gathered(spec, x: Any, y: Any, gather) -> Sides:
    """The gather form's sides: this device's rows ``x``, every device's columns (``cx``
    where a family scores against queries), and the documents: every device's as
    ``y``, or this device's as ``y`` and every device's as ``cy`` where a family's
    rows are among them (the positives)."""
    cx = gather(x) if any(f.cols == "x" for f in spec.families) else None
    if any(f.rows == "p" for f in spec.families):
        return Sides(x=x, y=y, cx=cx, cy=gather(y))
    return Sides(x=x, y=gather(y), cx=cx)


def _ring_rows(spec, sides: tuple, scalars: tuple, where: Where, options: _options.Options):
    """The ring form: this device's sides and metadata, the columns' travelling with
    their blocks; the targets index this device's own block."""
    (x, y), axis_name = sides, where.axis_name
    n = _tiles.count(x)
    offset = _distributed.axis_index_offset(n, axis_name)
    meta = _metadata(spec, options, (offset, offset))
    sides = Sides(x=x, y=y)
    if options.bank is not None:  # this device's bank: its blocks travel like y's
        sides, meta = _bank.with_columns(options.bank, sides, meta, offset, options)
    meta = meta._replace(targets=_options.targets(spec, 0, n))  # into its own block
    engine = _engine.Engine(spec, where.block(max(n, _tiles.count(y))), Ring(axis_name))
    return _engine.call(engine, _families.Inputs(sides, scalars[0], meta, scalars[1]))


def _metadata(spec, options, offsets: tuple, cols=None) -> Metadata:
    """What the families' rules read (``_options.metadata``; nothing without a rule)."""
    if all(f.rule is None for f in spec.families):
        return Metadata(Sides(), Sides())
    return _options.metadata(options, spec, *offsets, cols)


def _scoring(x: Any, ys: Any, whole_x: bool) -> tuple:
    """``_layout.gathered_scoring`` of every leaf of the rows and of the columns."""
    leaves = zip(jax.tree.leaves(x), jax.tree.leaves(ys), strict=True)
    pairs = [_layout.gathered_scoring(a, b, whole_x) for a, b in leaves]
    back = lambda v, leaves: jax.tree.unflatten(jax.tree.structure(v), leaves)
    return back(x, [a for a, _ in pairs]), back(ys, [b for _, b in pairs])


def _dense_scalars(spec, sides: Sides, scalars: tuple) -> tuple:
    """``(scale, bias)`` in the accumulation dtype of the rows and the scalars."""
    scale, bias = scalars
    leaves = [spec.score.leaf(v) for v in (sides.x, sides.y)]
    acc = accumulation_dtype(*leaves, *(v for v in scalars if v is not None))
    return jnp.asarray(scale, acc), None if bias is None else jnp.asarray(bias, acc)


def use_ring(method: str, layout: _layout.Layout, gathered: int) -> bool:
    """The automatic rule: the ring once the gathered side would exceed ``GATHER_BYTES``."""
    if method != "auto":
        return method == "ring"
    return layout.shards > 1 and gathered > GATHER_BYTES


@_layout.types_mesh
def run(local: Callable, x, y, scalars, *, reduction, method, axis_name, sides, per_row=None):
    """Runs ``local(x, y, *scalars, per_row, axis_name=, ring=)`` where the rows lie
    (``_devices.run``).

    ``x`` and ``y`` are arrays, or pytrees of arrays with the same rows (e.g. token
    vectors and their mask: ``maxsim_loss``), split alike. ``sides``: the inputs each
    device would gather in the gather form (their size decides ``method="auto"``).
    ``per_row``: the options' arrays split like the rows (``_options.PerRow``; None:
    none). Under ``jit`` over a mesh (explicit axes read from the types, an
    ``axis_name`` naming a mesh axis outside ``shard_map``, or the core's
    ``batch_axis``) the ring runs inside a ``shard_map`` over the batch's mesh axes.
    """
    per_row = _options.PerRow() if per_row is None else per_row
    layout = _devices.locate({"x": x, "y": y, **per_row._asdict()}, axis_name)
    here = sum(v.size * v.dtype.itemsize for v in sides) // layout.array_shards
    gathered = layout.shards * here  # what every device would hold in the gather form
    ring = use_ring(method, layout, gathered)
    ring = ring and (layout.shards > 1 or layout.kind != "manual")

    def body(axes, rows, *scalars):
        x, y, per_row = rows
        return local(
            x, y, *scalars, per_row=per_row, axis_name=axes, ring=ring and axes is not None
        )

    out = P(layout.axes) if reduction == "none" else P()
    return _devices.run(body, (x, y, per_row), tuple(scalars), layout, shard=ring, out=out)
