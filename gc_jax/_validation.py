"""Trace-time argument checks with messages that say what was given and what is expected."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

PyTree = Any


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def positive_int(value: Any, name: str) -> int:
    """Returns ``value`` as an int, or raises naming ``name``."""
    if not _is_int(value):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__}).")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}.")
    return int(value)


def per_input(value: Any, num_inputs: int, name: str, check: Callable[[Any, str], Any]) -> tuple:
    """Broadcasts a single setting to every input, or checks a per-input sequence."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != num_inputs:
            raise ValueError(
                f"{name} has {len(value)} entries but {num_inputs} inputs were given; "
                f"pass one {name} for all inputs or exactly one per input."
            )
        return tuple(check(v, f"{name}[{i}]") for i, v in enumerate(value))
    return (check(value, name),) * num_inputs


def chunk_sizes(value: Any) -> None:
    """Checks ``chunk_size`` (one positive int, or a sequence of them) up front."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not value:
            raise ValueError(
                "chunk_size is an empty sequence; expected one positive int per input."
            )
        for i, v in enumerate(value):
            positive_int(v, f"chunk_size[{i}]")
    else:
        positive_int(value, "chunk_size")


def callable_arg(value: Any, name: str) -> Callable:
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {value!r} ({type(value).__name__}).")
    return value


def leading_size(tree: PyTree, name: str) -> int:
    """The shared leading (batch) size of every leaf of ``tree``."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        raise ValueError(f"{name} has no array leaves; expected a pytree of arrays.")
    sizes = {}
    for path, leaf in leaves:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(
                f"{where} must be an array with a leading batch axis, "
                f"got {type(leaf).__name__}: {leaf!r}."
            )
        if len(leaf.shape) == 0:
            raise ValueError(f"{where} is a scalar; every input leaf needs a leading batch axis.")
        sizes[where] = leaf.shape[0]
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(f"leaves of {name} have different leading (batch) sizes: {listing}.")
    size = next(iter(sizes.values()))
    if size == 0:
        raise ValueError(f"{name} is an empty batch (leading size 0); expected at least one row.")
    return size


def rows(tree: PyTree, expected: int, name: str) -> None:
    """Checks that an encoder returned one row per input row."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0 or shape[0] != expected:
            raise ValueError(
                f"{name} returned {jax.tree_util.keystr(path) or 'an output'} with shape "
                f"{shape} for a chunk of {expected} rows; an encoder must return one "
                f"representation row per input row (leading axis {expected})."
            )


def scalar_loss(out: Any, has_aux: bool) -> tuple[jax.Array, Any]:
    """Splits ``loss_fn``'s output into ``(loss, aux)`` and checks the loss is a scalar."""
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise TypeError(
                "loss_fn was declared with has_aux=True, so it must return a pair "
                f"(loss, aux); got {type(out).__name__}."
            )
        loss, aux = out
    else:
        loss, aux = out, None
    shape = getattr(loss, "shape", None)
    if shape != ():
        hint = " (did you mean has_aux=True?)" if isinstance(out, tuple | list) else ""
        raise ValueError(f"loss_fn must return a scalar loss, got shape {shape}{hint}.")
    return loss, aux


def axis_bound(axis_name: Any, name: str = "axis_name") -> None:
    """Raises a ValueError unless ``axis_name`` is bound by pmap/shard_map here."""
    if axis_name is None:
        return
    try:
        jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"{name}={axis_name!r} is not bound here: call this inside jax.pmap(..., "
            f"axis_name={axis_name!r}) or jax.shard_map over a mesh with that axis, or pass "
            f"{name}=None under plain jax.jit."
        ) from e
