"""Cutting pytrees into pre-chunked ``[n_chunk, rows, ...]`` layouts and back.

The ``cachex`` functions take their inputs *pre-chunked*: every leaf has a leading
``n_chunk`` axis, then the rows of one chunk. :func:`tree_chunk` makes that layout
from a batch and :func:`tree_unchunk` undoes it; both are reshapes (no copy).

Examples:
  >>> import jax.numpy as jnp
  >>> from gc_jax.compat import cachex
  >>> batch = {"input_ids": jnp.arange(24).reshape(6, 4), "label": jnp.arange(6)}
  >>> chunked = cachex.tree_chunk(batch, 3)
  >>> chunked["input_ids"].shape, chunked["label"].shape
  ((3, 2, 4), (3, 2))
  >>> back = cachex.tree_unchunk(chunked)
  >>> bool((back["input_ids"] == batch["input_ids"]).all()), back["label"].shape
  (True, (6,))
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from gc_jax import _layout, _validation
from gc_jax._base import PyTree

__all__ = [
    "tree_chunk",
    "tree_unchunk",
]


def _int_arg(value: Any, name: str) -> int:
    if not _validation._is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    return int(value)


def _leaves(tree: PyTree, name: str) -> list:
    """``(where, leaf)`` for every leaf, checking that each one is an array."""
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "reshape"):
            raise TypeError(f"{where} must be an array, got {type(leaf).__name__}: {leaf!r}.")
        found.append((where, leaf))
    return found


def _explicit_shards(leaf: Any, axis: int) -> int:
    """How many ways ``leaf``'s ``axis`` is sharded in its type (explicit mesh axes)."""
    return (_layout.axis_layout(leaf, axis) or _layout.SINGLE).shards


def tree_chunk(tree: PyTree, n_chunk: int, axis: int = 0) -> PyTree:
    """Splits axis ``axis`` of every leaf into ``(n_chunk, size // n_chunk)``.

    Args:
      tree: a pytree of arrays (typed key arrays included) that all have an axis
        ``axis`` divisible by ``n_chunk``.
      n_chunk: the number of chunks, a positive int.
      axis: the axis to split; negative values count from each leaf's last axis.

    Returns:
      ``tree`` with every leaf of shape ``[..., B, ...]`` reshaped to
      ``[..., n_chunk, B // n_chunk, ...]``: chunk ``c`` holds rows
      ``c * B // n_chunk`` to ``(c + 1) * B // n_chunk``.

      Under ``jit`` over explicit mesh axes, a leaf whose axis is split ``S`` ways
      keeps whole chunks on each device when ``S`` divides ``n_chunk`` (the chunk
      axis split, a free reshape). Otherwise each chunk is spread over the devices
      (its rows split, an all-to-all), which ``S`` must then divide: what an encoder
      with weights sharded over the batch axes (FSDP) needs, and what
      :func:`grad_cached` arranges itself for such params.

    Raises:
      TypeError: ``n_chunk`` or ``axis`` is not an int, or a leaf is not an array.
      ValueError: ``n_chunk`` is not positive, a leaf has no axis ``axis``,
        ``n_chunk`` does not divide its size, or a sharded axis can be cut neither
        into whole chunks per device nor into chunks spread over the devices.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.compat.cachex import tree_chunk
      >>> tree_chunk(jnp.zeros((2, 6)), 3, axis=1).shape
      (2, 3, 2)
      >>> tree_chunk(jnp.zeros((5, 4)), 2)
      Traceback (most recent call last):
      ...
      ValueError: n_chunk=2 does not divide axis 0 of tree (size 5); ...
    """
    n_chunk = _validation.positive_int(n_chunk, "n_chunk")
    axis = _int_arg(axis, "axis")
    leaves = _leaves(tree, "tree")
    for where, leaf in leaves:
        ndim = len(leaf.shape)
        ax = axis + ndim if axis < 0 else axis
        if not 0 <= ax < ndim:
            raise ValueError(
                f"axis={axis} is out of range for {where}, which has shape "
                f"{tuple(leaf.shape)} ({ndim} axes)."
            )
        if leaf.shape[ax] % n_chunk:
            raise ValueError(
                f"n_chunk={n_chunk} does not divide axis {axis} of {where} (size "
                f"{leaf.shape[ax]}); use a number of chunks that divides the batch size."
            )
        shards = _explicit_shards(leaf, ax)
        if n_chunk % shards and (leaf.shape[ax] // n_chunk) % shards:
            raise ValueError(
                f"axis {axis} of {where} is sharded {shards} ways over explicit mesh axes, "
                f"which neither n_chunk={n_chunk} nor the {leaf.shape[ax] // n_chunk} rows "
                f"of a chunk divide; use a multiple of {shards} chunks (each device then "
                f"holds whole chunks of its own rows) or chunks of a multiple of {shards} "
                "rows (each chunk then spread over the devices)."
            )

    def one(x):
        ax = axis + x.ndim if axis < 0 else axis
        shape = (*x.shape[:ax], n_chunk, x.shape[ax] // n_chunk, *x.shape[ax + 1 :])
        if n_chunk % _explicit_shards(x, ax) == 0:
            return x.reshape(shape)
        spec = (*_layout.typed_spec(x), *(None,) * x.ndim)[: x.ndim]
        spread = PartitionSpec(*spec[:ax], None, *spec[ax:])
        return jax.lax.reshape(
            x, shape, out_sharding=NamedSharding(jax.typeof(x).sharding.mesh, spread)
        )

    return jax.tree.map(one, tree)


def tree_unchunk(tree: PyTree, axis: int = 0) -> PyTree:
    """Merges axes ``axis`` and ``axis + 1`` of every leaf: the inverse of :func:`tree_chunk`.

    Args:
      tree: a pytree of arrays with at least two axes from ``axis`` on.
      axis: the chunk axis; negative values count from each leaf's last axis
        (``-2`` merges the last two axes).

    Returns:
      ``tree`` with every leaf of shape ``[..., n_chunk, rows, ...]`` reshaped to
      ``[..., n_chunk * rows, ...]``.

    Raises:
      TypeError: ``axis`` is not an int, or a leaf is not an array.
      ValueError: a leaf has no axes ``axis`` and ``axis + 1``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.compat.cachex import tree_unchunk
      >>> tree_unchunk({"h": jnp.zeros((4, 2, 8))})["h"].shape
      (8, 8)
      >>> tree_unchunk(jnp.zeros((3, 4, 2)), axis=1).shape
      (3, 8)
    """
    axis = _int_arg(axis, "axis")
    for where, leaf in _leaves(tree, "tree"):
        ndim = len(leaf.shape)
        ax = axis + ndim if axis < 0 else axis
        if not 0 <= ax < ndim - 1:
            raise ValueError(
                f"tree_unchunk merges axes {axis} and {axis} + 1, but {where} has shape "
                f"{tuple(leaf.shape)}; expected a [..., n_chunk, rows, ...] leaf (as made "
                "by tree_chunk)."
            )

    return jax.tree.map(lambda x: merge_chunks(x, axis + x.ndim if axis < 0 else axis), tree)


def merge_chunks(x: jax.Array, ax: int) -> jax.Array:
    """``x`` with axes ``ax`` (chunks) and ``ax + 1`` (rows) merged, in order.

    Under explicit mesh axes, rows split over devices within each chunk (the chunk
    axis not split) are first moved so that each device holds whole chunks (an
    all-to-all); their rows are then a contiguous block of the merged axis, so the
    reshape keeps the split (JAX cannot infer it for the split inner axis). Fewer
    chunks than devices are merged by the reshape itself, told the split it keeps.
    """
    shape = (*x.shape[:ax], x.shape[ax] * x.shape[ax + 1], *x.shape[ax + 2 :])
    spec = (*_layout.typed_spec(x), *(None,) * x.ndim)[: x.ndim]
    if spec[ax] is not None or spec[ax + 1] is None:
        return x.reshape(shape)
    moved = (*spec[:ax], spec[ax + 1], None, *spec[ax + 2 :])
    if x.shape[ax] % _explicit_shards(x, ax + 1) == 0:
        x = _layout.reshard_typed(x, PartitionSpec(*moved))
    out = NamedSharding(
        jax.typeof(x).sharding.mesh, PartitionSpec(*moved[: ax + 1], *moved[ax + 2 :])
    )
    return jax.lax.reshape(x, shape, out_sharding=out)
