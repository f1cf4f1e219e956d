"""What every loss shares: argument checks, the reduction, and where the rows are scored.

:func:`run` reads how the rows lie (one device, ``shard_map``/``pmap``, or ``jit`` over
a mesh) and calls a loss's per-device body there; :func:`rows` is that body's per-row
losses in the dense, blockwise or ring form; :func:`reduce` turns this device's
per-row losses into the global loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gc_jax import _distributed, _layout, _validation
from gc_jax._base import AxisName
from gc_jax.losses import _options
from gc_jax.losses._engine import blockwise as _blockwise
from gc_jax.losses._engine import families as _families
from gc_jax.losses._engine import plan as _plan
from gc_jax.losses._engine import strategies as _strategies
from gc_jax.losses._engine import tiles as _tiles
from gc_jax.losses._engine.masks import Sides
from gc_jax.losses._engine.scores import Dot

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


def _gather(v: jax.Array, axis_name: AxisName | None) -> jax.Array:
    return v if axis_name is None else _distributed.all_gather(v, axis_name)


def _targets(rows: int, k: int, axis_name: AxisName | None) -> jax.Array:
    """Index into the gathered other side of each local row's positive (``k`` per query)."""
    return (_offset(rows, axis_name) + jnp.arange(rows)) * k


def reduce(per_row: jax.Array, global_rows: int, reduction: str, axis_name) -> jax.Array:
    """Reduces this device's per-row losses into the global mean or sum."""
    if reduction == "none":
        return per_row
    share = jnp.sum(per_row)
    if reduction == "mean":
        share = share / global_rows
    return _distributed.global_loss(share, axis_name)


def _logits(x: jax.Array, ys: jax.Array, scale, bias=0.0) -> jax.Array:
    """``scale * x @ ys.T + bias`` accumulated in at least float32, without casting x or ys."""
    acc = _blockwise.accumulation_dtype(x, ys, scale, bias)
    if x.dtype == acc:
        # Wide rows: scaled before the product, on [rows, dim], so the compiler need not
        # keep the unscaled product as a second [rows, cols] buffer (XLA:CPU does:
        # three B x B buffers for the dense InfoNCE step instead of two).
        return jnp.matmul(x * scale, ys.T, preferred_element_type=acc) + bias
    # Narrow rows are not rounded again by the scale: it multiplies the accumulated product.
    return scale * jnp.matmul(x, ys.T, preferred_element_type=acc) + bias


def rows(kind, x, y, scalars, where: Where, ids=None, *, k: int = 1) -> jax.Array:
    """Per-row losses of this device's ``x`` against every device's ``y``, ring or gathered.

    ``scalars``: ``(scale, bias)``; ``k``: rows of ``y`` per row of ``x``. ``ids``:
    ``{"qid": query ids or None, "pid": document ids or None}`` (``[rows, w]``, split
    like ``x`` and ``y``): a pair whose ids match, other than a row's positive, is
    dropped (``_options.id_mask``)."""
    n, (scale, bias), (block_size, axis_name, ring) = x.shape[0], scalars, where
    ids = _options.Options(query_ids=(ids or {}).get("qid"), doc_ids=(ids or {}).get("pid"))
    if ring:
        block = where.block(max(n, y.shape[0]))  # dense: one tile per travelling block
        offset = _offset(n, axis_name)
        mask = _options.id_mask(ids, k, offset, offset)
        meta = _families.one_meta(mask, jnp.arange(n) * k)
        spec = _families.one(kind, Dot, None if mask is None else mask.rule, k)
        inputs = _families.Inputs(Sides(x=x, y=y), scale, meta, bias)
        return _plan.call(_plan.Plan(spec, block, axis_name), inputs)
    ys = _gather(y, axis_name)
    targets = _targets(n, k, axis_name)
    if axis_name is None:  # jit over a mesh: every array whole
        whole = lambda v: _layout.reshard_typed(v, P())
        ids, cols = ids.map_arrays(whole), None
    else:
        cols = ids.map_arrays(lambda v: _gather(v, axis_name))
    mask = _options.id_mask(ids, k, _offset(n, axis_name), 0, cols)
    x, ys = _layout.gathered_scoring(x, ys, whole_x=block_size is not None)
    if block_size is not None:
        spec = _families.one(kind, Dot, None if mask is None else mask.rule, k)
        inputs = _families.Inputs(Sides(x=x, y=ys), scale, _families.one_meta(mask, targets), bias)
        return _plan.call(_plan.Plan(spec, block_size), inputs)
    logits = _logits(x, ys, scale, bias)
    positive = jnp.arange(ys.shape[0]) == targets[:, None]
    keep = None if mask is None else _dense_keep(mask, n, ys.shape[0])
    if kind is _strategies.Softmax:
        # Not optax's integer-label cross-entropy: its per-row gather transposes to a
        # scatter whose sharding JAX 0.12 cannot infer under explicit mesh axes.
        pos = jnp.sum(jnp.where(positive, logits, 0), axis=1)
        logits = logits if keep is None else jnp.where(keep, logits, -jnp.inf)
        return jax.nn.logsumexp(logits, axis=1) - pos
    labels = jnp.where(positive, 1.0, -1.0).astype(logits.dtype)
    terms = -jax.nn.log_sigmoid(labels * logits)
    return jnp.sum(terms if keep is None else jnp.where(keep, terms, 0), axis=1)


def _offset(rows: int, axis_name: AxisName | None) -> Any:
    """The global index of this device's first row (0 without ``axis_name``)."""
    return 0 if axis_name is None else _distributed.axis_index_offset(rows, axis_name)


def _dense_keep(mask: tuple, n: int, m: int) -> jax.Array:
    """The dense form's ``[n, m]`` pairs kept by ``mask``, views copied out whole."""
    rule, rows_meta, cols_meta = mask
    rows_meta, cols_meta = _tiles.dense(rows_meta), _tiles.dense(cols_meta)
    return rule.keep(rows_meta, cols_meta, jnp.arange(n), jnp.arange(m))


def use_ring(method: str, layout: _layout.Layout, gathered: int) -> bool:
    """The automatic rule: the ring once the gathered side would exceed ``GATHER_BYTES``."""
    if method != "auto":
        return method == "ring"
    return layout.shards > 1 and gathered > GATHER_BYTES


@_layout.types_mesh
def run(local: Callable, x, y, scalars, *, reduction, method, axis_name, sides, extras=None):
    """Runs ``local(x, y, *scalars, axis_name=, ring=)`` where the rows lie.

    ``x`` and ``y`` are arrays, or pytrees of arrays with the same rows (e.g. token
    vectors and their mask: ``maxsim_loss``), split alike.

    ``sides``: the inputs each device would gather in the gather form (their size
    decides ``method="auto"``). ``extras``: a dict of more arrays split like the rows
    (ids, a guide's representations; None entries allowed), passed on as
    ``local(..., extras=)`` when given. Under ``jit`` over a mesh (explicit axes read
    from the types, an ``axis_name`` naming a mesh axis outside ``shard_map``, or the
    core's ``batch_axis``) the ring runs inside a ``shard_map`` over the batch's mesh
    axes.
    """
    named = {"x": x, "y": y, **{k: v for k, v in (extras or {}).items() if v is not None}}
    _distributed.check_split_alike(named, _distributed.typed_axes(axis_name))
    layout = _layout.rows_layout(jax.tree.leaves(x)[0], axis_name)
    here = sum(v.size * v.dtype.itemsize for v in sides) // layout.array_shards
    gathered = layout.shards * here  # what every device would hold in the gather form
    ring = use_ring(method, layout, gathered)
    kw = {} if extras is None else {"extras": extras}
    if layout.kind in ("single", "manual"):
        return local(x, y, *scalars, axis_name=layout.axes, ring=ring and layout.shards > 1, **kw)
    if not ring:  # gathered whole by the compiler, from the sharding in the types
        return local(x, y, *scalars, axis_name=None, ring=False, **kw)
    rows = P(layout.axes, None)
    out = P(layout.axes) if reduction == "none" else P()
    extra_specs = jax.tree.map(lambda _: P(layout.axes), extras)

    def per_device(x, y, extras, *scalars):
        kw = {} if extras is None else {"extras": extras}
        return local(x, y, *scalars, axis_name=layout.axes, ring=True, **kw)

    f = jax.shard_map(
        per_device,
        mesh=layout.mesh,
        in_specs=(rows, rows, extra_specs, *[P()] * len(scalars)),
        out_specs=out,
    )
    scalars = [jnp.asarray(v, jnp.result_type(v, jnp.float32)) for v in scalars]
    place = lambda side: jax.tree.map(lambda v: layout.place(v, rows), side)
    extras = jax.tree.map(lambda v: layout.place(v, P(layout.axes)), extras)
    return f(place(x), place(y), extras, *scalars)
