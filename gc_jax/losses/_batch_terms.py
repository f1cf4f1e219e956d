"""Batch-wide terms from summed per-row statistics, on one device or across devices.

A regulariser such as SPLADE's FLOPS (``sum_j (mean_i w_ij)^2``) or the spread-out
term (``mean_{i != j} (x_i . x_j)^2``) is a function ``F`` of statistics *summed over
the rows* of the batch: column sums, a ``d x d`` Gram matrix, a row count. Across
devices each device sums its own rows and a ``psum`` adds them up: nothing row-sized
is gathered, so memory does not grow with the batch. (One exception, by choice: the
spread-out term on a global batch of at most ``d`` rows sums over its pairs directly,
from the gathered rows, no more than its ``d x d`` Gram matrix; see
``spread_out_regularizer``.)

:func:`run` evaluates ``F(psum(stats(rows)))`` wherever the rows lie (``_devices.run``),
with gc_jax's convention for distributed losses (``gc_jax.global_loss``): the *global*
value on every device, and the gradient of this device's share,
``F'(S) . d stats(local rows)``, which summed over the devices is the global gradient
(under ``shard_map``, ``pmap`` and ``shard_map(check_vma=False)`` alike).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gc_jax import _distributed, _layout
from gc_jax._base import AxisName, PyTree
from gc_jax.losses import _devices


def _global_of(fn: Callable[[PyTree], jax.Array], stats: PyTree, axis_name: AxisName) -> jax.Array:
    """``fn(psum(stats))`` in value; differentiates like ``fn'(S) . stats`` (the share)."""
    total = jax.lax.stop_gradient(jax.lax.psum(stats, axis_name))
    value, vjp = jax.vjp(fn, total)
    (slope,) = vjp(jnp.ones_like(value))
    slope = jax.lax.stop_gradient(slope)
    share = sum(
        jnp.vdot(g, s) for g, s in zip(jax.tree.leaves(slope), jax.tree.leaves(stats), strict=True)
    )
    devices = jax.lax.axis_size(axis_name)
    # The linear share carries the gradient; the constant makes the shares sum to fn(S).
    share = share + jax.lax.stop_gradient(value / devices - share)
    return _distributed.global_loss(share, axis_name)


@_layout.types_mesh
def run(
    stats: Callable[..., PyTree],
    fn: Callable[[PyTree], jax.Array],
    rows: dict[str, jax.Array],
    axis_name: AxisName | None,
    *,
    min_rows: int = 1,
) -> jax.Array:
    """``fn(sum over the global batch of stats(axes, *rows))``, wherever ``rows`` lie.

    ``stats(axes, *local_rows)`` returns a pytree of sums over its rows; ``axes`` are
    the manual axes the rows are split over (None on one device), for statistics that
    need every device's rows (see :func:`gathered`). ``fn`` maps their global sums to a
    scalar. One device: ``fn(stats(None, *rows))``. Inside ``shard_map`` or ``pmap``
    (``axis_name`` bound): each device's stats are summed with ``psum``. Under ``jit``
    over rows sharded on a mesh (explicit axes from the types, auto axes named by
    ``axis_name`` or the core's ``batch_axis``): the same inside a ``shard_map`` over the
    batch's mesh axes, returned replicated.

    ``rows`` are named (``{"w": w}``) for the errors: a global batch of fewer than
    ``min_rows`` rows raises (its shape is known at trace time), and so does a row
    input typed replicated inside ``shard_map`` (``in_specs=P()``) while ``axis_name``
    says the batch is split: every device would count the same rows as its own, a
    wrong term silently. The check is the losses' (``_distributed.check_split_alike``);
    under ``pmap`` and ``shard_map(check_vma=False)`` values carry no such type and it
    cannot be made.
    """
    values = tuple(rows.values())
    layout = _devices.locate(rows, axis_name)
    check_rows(rows, min_rows, layout.shards if layout.kind == "manual" else 1)

    def body(axes, values):
        if axes is None:
            return fn(stats(None, *values))
        return _global_of(fn, stats(axes, *values), axes)

    return _devices.run(body, values, (), layout, shard=True)


def check_rows(rows: dict[str, jax.Array], min_rows: int, shards: int) -> None:
    """Raises unless the global batch (``shards`` devices' rows) has ``min_rows`` rows."""
    name, first = next(iter(rows.items()))
    total = first.shape[0] * shards
    if total < min_rows:
        where = f" ({first.shape[0]} per device on {shards})" if shards > 1 else ""
        need = "at least one row" if min_rows == 1 else f"at least {min_rows} rows"
        raise ValueError(
            f"{name} has {total} row{'' if total == 1 else 's'} in the global batch{where}, "
            f"shape {first.shape}: the "
            f"term is a mean over {'rows' if min_rows == 1 else 'pairs of distinct rows'} "
            f"and needs {need} (its value would be 0/0, NaN). Pass {need}, or leave the "
            "term out of the loss for such a batch."
        )


def gathered(axes: AxisName | None, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every device's rows of ``x`` (without gradient) and the global index of this
    device's first row: what a ``stats`` of :func:`run` reads to pair its rows with
    every other row of the global batch."""
    x = jax.lax.stop_gradient(x)
    if axes is None:
        return x, jnp.asarray(0)
    return jax.lax.all_gather(x, axes, tiled=True), jax.lax.axis_index(axes) * len(x)


def rows_of(x: Any, name: str, ndim: int = 2) -> jax.Array:
    """Checks ``x`` is a float array of ``ndim`` dims (``[rows, dim]`` by default)."""
    if getattr(x, "ndim", None) != ndim or not jnp.issubdtype(x.dtype, jnp.floating):
        want = "[rows, dim]" if ndim == 2 else f"{ndim}-D"
        raise ValueError(
            f"{name} must be a float {want} array, got "
            f"{getattr(x, 'shape', type(x).__name__)} of {getattr(x, 'dtype', '?')}."
        )
    return x
