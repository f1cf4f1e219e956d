"""Batch-wide terms from summed per-row statistics, on one device or across devices.

A regulariser such as SPLADE's FLOPS (``sum_j (mean_i w_ij)^2``) or the spread-out
term (``mean_{i != j} (x_i . x_j)^2``) is a function ``F`` of statistics *summed over
the rows* of the batch: column sums, a ``d x d`` Gram matrix, a row count. Across
devices each device sums its own rows and a ``psum`` adds them up: nothing row-sized
is gathered, so memory does not grow with the batch.

:func:`run` evaluates ``F(psum(stats(rows)))`` wherever the rows lie, with gc_jax's
convention for distributed losses (``gc_jax.global_loss``): the *global* value on every
device, and the gradient of this device's share, ``F'(S) . d stats(local rows)``,
which summed over the devices is the global gradient (under ``shard_map``, ``pmap`` and
``shard_map(check_vma=False)`` alike).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gc_jax import _distributed, _layout
from gc_jax._base import AxisName, PyTree


def accumulation_dtype(*arrays: jax.Array) -> Any:
    """At least float32 (float64 stays float64)."""
    return jnp.result_type(jnp.float32, *(a.dtype for a in arrays))


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
    rows: tuple[jax.Array, ...],
    axis_name: AxisName | None,
) -> jax.Array:
    """``fn(sum over the global batch of stats(*rows))``, wherever ``rows`` lie.

    ``stats(*local_rows)`` returns a pytree of sums over its rows; ``fn`` maps their
    global sums to a scalar. One device: ``fn(stats(*rows))``. Inside ``shard_map`` or
    ``pmap`` (``axis_name`` bound): each device's stats are summed with ``psum``. Under
    ``jit`` over rows sharded on a mesh (explicit axes from the types, auto axes named by
    ``axis_name`` or the core's ``batch_axis``): the same inside a ``shard_map`` over the
    batch's mesh axes, returned replicated.
    """
    layout = _layout.rows_layout(rows[0], axis_name)
    if layout.kind == "single":
        return fn(stats(*rows))
    if layout.kind == "manual":
        return _global_of(fn, stats(*rows), layout.axes)

    def per_device(*local):
        return _global_of(fn, stats(*local), layout.axes)

    spec = lambda v: P(layout.axes, *[None] * (v.ndim - 1))
    f = jax.shard_map(
        per_device, mesh=layout.mesh, in_specs=tuple(spec(v) for v in rows), out_specs=P()
    )
    return f(*(layout.place(v, spec(v)) for v in rows))


def rows_of(x: Any, name: str, ndim: int = 2) -> jax.Array:
    """Checks ``x`` is a float array of ``ndim`` dims (``[rows, dim]`` by default)."""
    if getattr(x, "ndim", None) != ndim or not jnp.issubdtype(x.dtype, jnp.floating):
        want = "[rows, dim]" if ndim == 2 else f"{ndim}-D"
        raise ValueError(
            f"{name} must be a float {want} array, got "
            f"{getattr(x, 'shape', type(x).__name__)} of {getattr(x, 'dtype', '?')}."
        )
    return x
