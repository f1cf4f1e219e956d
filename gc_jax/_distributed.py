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
    """
    if axis_name is None:
        return local_share
    total = jax.lax.psum(local_share, axis_name)
    return local_share + jax.lax.stop_gradient(total - local_share)


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
        vma = getattr(jax.typeof(x), "vma", frozenset())
        missing = tuple(n for n in names if n not in vma)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def num_batch_shards(tree: PyTree) -> int:
    """How many devices the leading axis of ``tree``'s leaves is sharded over.

    Read from the array types under explicit mesh axes (``jax.make_mesh``'s default);
    under auto axes the sharding is not part of the type and 1 is returned.
    """
    leaf = jax.tree.leaves(tree)[0]
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not spec or spec[0] is None:
        return 1
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return math.prod(sharding.mesh.shape[a] for a in axes)


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
