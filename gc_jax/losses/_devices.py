"""Where the rows lie: a per-device body run on one device, per device, or under ``jit``.

The one dispatcher of the losses (``_common.run``) and of the batch-wide terms
(``_batch_terms.run``). :func:`locate` checks the inputs split alike and reads how their
rows lie (``_layout.rows_layout``); :func:`run` calls a body there: on one device or
inside ``shard_map``/``pmap`` with the rows as they are, under ``jit`` over a mesh
either on the whole arrays (the compiler gathers) or inside a ``shard_map`` over the
batch's mesh axes, every row input split by its rows and the scalars replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gc_jax import _distributed, _layout
from gc_jax._base import AxisName


def locate(named: dict[str, Any], axis_name: AxisName | None) -> _layout.Layout:
    """How the rows of ``named`` (the row inputs by name, for the errors; None entries
    skipped) lie, after checking they are split alike (``_distributed.check_split_alike``)."""
    named = {k: v for k, v in named.items() if v is not None}
    _distributed.check_split_alike(named, _distributed.typed_axes(axis_name))
    return _layout.rows_layout(jax.tree.leaves(next(iter(named.values())))[0], axis_name)


def run(
    body: Callable[..., Any],
    rows: Any,
    scalars: tuple,
    layout: _layout.Layout,
    *,
    shard: bool,
    out: P | None = None,
) -> Any:
    """``body(axes, rows, *scalars)`` where ``rows`` lie.

    Args:
      body: the per-device body; ``axes`` are the manual axes the rows are split over
        (None: one device, or the whole arrays under ``jit`` over a mesh).
      rows: a pytree of arrays split by their rows (None leaves allowed).
      scalars: replicated values.
      layout: the rows' layout (:func:`locate`).
      shard: under ``jit`` over a mesh, run ``body`` per device inside a
        ``shard_map`` (else on the whole arrays).
      out: the ``shard_map``'s ``out_specs`` (None: ``P()``, replicated).
    """
    if layout.kind in ("single", "manual"):
        return body(layout.axes, rows, *scalars)
    if not shard:  # gathered whole by the compiler, from the sharding in the types
        return body(None, rows, *scalars)
    spec = lambda v: P(layout.axes, *[None] * (v.ndim - 1))
    per_device = lambda rows, *scalars: body(layout.axes, rows, *scalars)
    in_specs = (jax.tree.map(spec, rows), *[P()] * len(scalars))
    out = P() if out is None else out
    f = jax.shard_map(per_device, mesh=layout.mesh, in_specs=in_specs, out_specs=out)
    rows = jax.tree.map(lambda v: layout.place(v, spec(v)), rows)
    return f(rows, *(_scalar(v) for v in scalars))


def _scalar(v: Any) -> jax.Array:
    """``v`` as an array for ``shard_map``: a Python float stays weakly typed (it takes the
    rows' dtype, as outside the ring, also under x64), an integer becomes a float."""
    v = jnp.asarray(v)
    return v if jnp.issubdtype(v.dtype, jnp.floating) else v.astype(jnp.float32)
