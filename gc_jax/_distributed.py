"""Helpers for data parallelism: the autodiff rules of collectives, and sharded batches.

The rule gc_jax follows everywhere: under ``pmap``/``shard_map`` each device
differentiates *its share* of the global loss, and the per-device parameter
gradients are summed once, at the end of the step. ``all_gather`` transposes to a
reduce-scatter, so the share's gradient with respect to this device's
representations already sums every device's contribution. A loss whose *value* is
the global loss on every device (what users want to log) gets its gradient from
:func:`global_loss`, which returns the global value and the local share's gradient.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

PyTree = Any
AxisName = Any


def all_gather(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Concatenates ``x`` from every device along its leading axis."""
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=True)


def axis_index_offset(rows: int, axis_name: AxisName) -> jax.Array:
    """Global index of this device's first row, when every device holds ``rows`` rows."""
    return jax.lax.axis_index(axis_name) * rows


def global_loss(local_share: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """The global loss as a value, with the gradient of this device's share.

    Args:
      local_share: this device's part of the loss; the global loss is their sum.
      axis_name: the data-parallel axis, or None (then ``local_share`` is returned).

    Returns:
      ``psum(local_share)`` in value; differentiates like ``local_share``.

    Examples:
      A distributed mean of squares: every device returns the global value, and
      the per-device gradients sum to the global gradient.

      >>> import jax, jax.numpy as jnp, gc_jax
      >>> def loss(x):  # x: this device's rows; 2 devices of 2 rows each
      ...     return gc_jax.global_loss(jnp.sum(x**2) / 4, "d")
      >>> x = jnp.arange(4.0).reshape(2, 2)
      >>> value, grad = jax.vmap(jax.value_and_grad(loss), axis_name="d")(x)
      >>> value.tolist(), grad.tolist()
      ([3.5, 3.5], [[0.0, 0.5], [1.0, 1.5]])
    """
    if axis_name is None:
        return local_share
    total = jax.lax.psum(local_share, axis_name)
    return local_share + jax.lax.stop_gradient(total - local_share)


def varying_axes(x: jax.Array) -> tuple:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:  # newer JAX keeps it under `manual_axis_type`
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return tuple(vma)


def varying_axes_of(tree: PyTree) -> tuple:
    """The manual mesh axes any leaf of ``tree`` varies over."""
    axes = {a for leaf in jax.tree.leaves(tree) for a in varying_axes(leaf)}
    return tuple(sorted(axes, key=str))


def to_varying(tree: PyTree, axis_name: AxisName | None) -> PyTree:
    """Marks replicated values as per-device, so their cotangents are not all-reduced.

    Under ``shard_map`` a replicated value used with per-device data gets an implicit
    broadcast whose transpose is a ``psum``: differentiating per chunk would all-reduce
    once per chunk. Casting parameters to varying first keeps every chunk's gradient
    local; gc_jax sums once at the end of the step.
    """
    if axis_name is None:
        return tree
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def cast(x):
        missing = tuple(n for n in names if n not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def batch_sharding(tree: PyTree, batch_axis: AxisName | None = None) -> tuple[int, Any]:
    """How the leading axis of ``tree`` is sharded under plain ``jit``.

    Under explicit mesh axes this is read from the array types. Under auto axes the
    sharding is not in the type, so ``batch_axis`` names the mesh axes the batch is
    sharded over, looked up in the mesh set with ``jax.set_mesh``.

    Returns:
      ``(num_shards, sharding)``: the number of shards of the leading axis, and a
      sharding that shards a new batch-sized array the same way (None if unsharded).
    """
    leaf = jax.tree.leaves(tree)[0]
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec and spec[0] is not None:
        mesh, axes = sharding.mesh, spec[0]
    elif batch_axis is not None:
        mesh, axes = jax.sharding.get_abstract_mesh(), batch_axis
        names = axes if isinstance(axes, tuple) else (axes,)
        if mesh.empty or any(a not in mesh.axis_names for a in names):
            raise ValueError(
                f"batch_axis={batch_axis!r} must name axes of the current mesh; got mesh "
                f"axes {() if mesh.empty else mesh.axis_names}. Call under "
                "`with jax.set_mesh(mesh):`."
            )
    else:
        return 1, None
    names = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[a] for a in names), NamedSharding(mesh, PartitionSpec(axes))


def reduce_grads(grads: PyTree, axis_name: AxisName | None) -> PyTree:
    """The one gradient all-reduce of a step."""
    if axis_name is None:
        return grads
    return jax.lax.psum(grads, axis_name)


def replicated_loss(loss: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """Returns the (already global) loss typed as replicated, for ``out_specs=P()``."""
    if axis_name is None:
        return loss
    return jax.lax.pmean(loss, axis_name)
