"""Helpers for data parallelism: the autodiff rules of collectives, and sharded batches.

The rule gc_jax follows everywhere: under ``pmap``/``shard_map`` each device
differentiates *its share* of the global loss, and the per-device parameter
gradients are summed once, at the end of the step. ``all_gather`` transposes to a
reduce-scatter, so the share's gradient with respect to this device's
representations already sums every device's contribution. A loss whose *value* is
the global loss on every device (what users want to log) gets its gradient from
:func:`global_loss`, which returns the global value and the local share's gradient.

How the rows lie across devices is ``gc_jax._layout``'s: this module holds the
collectives, their autodiff rules and the checks that the core and the loss agree on
the axes they communicate over.
"""

from __future__ import annotations

from typing import Any

import jax

from gc_jax import _layout
from gc_jax._base import AxisName, PyTree
from gc_jax._layout import varying_axes, varying_axes_of


def all_gather(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Concatenates ``x`` from every device along its leading axis."""
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=True)


def axis_index_offset(rows: int, axis_name: AxisName) -> jax.Array:
    """Global index of this device's first row, when every device holds ``rows`` rows."""
    return jax.lax.axis_index(axis_name) * rows


def varies_over(x: jax.Array, axis_name: AxisName) -> bool:
    """Whether ``x`` is typed as varying over every axis of ``axis_name``.

    True only inside ``shard_map`` with its replication check on (``check_vma=True``,
    the default), for a value computed from per-device data. Under ``pmap``, ``vmap``
    or ``shard_map(check_vma=False)`` values carry no such type: False.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return set(names) <= set(varying_axes(x))


def global_loss(local_share: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """The global loss as a value, with the gradient of this device's share.

    Under ``shard_map`` (with its default ``check_vma=True``) a share computed from
    per-device data is typed as varying, and the result is ``psum(local_share)``,
    typed as replicated, so it can be returned with ``out_specs=P()``: the transpose of
    ``psum`` on a varying value is a ``pvary``, which hands each device the gradient of
    its own share. Under ``pmap``, ``vmap`` or ``shard_map(check_vma=False)`` the
    result is ``local_share + stop_gradient(psum(local_share) - local_share)``: the
    same value, and again the gradient of this device's share only.

    Either way, summing the per-device gradients of parameters cast to varying (a
    ``psum``, as ``gc_jax`` does once per step) gives the gradient of the global loss,
    and a replicated parameter used under ``shard_map`` gets it directly.

    Args:
      local_share: this device's part of the loss; the global loss is their sum.
      axis_name: the data-parallel axis, or None (then ``local_share`` is returned).

    Returns:
      ``psum(local_share)`` in value (typed replicated under ``shard_map``, for
      ``out_specs=P()``); differentiates like ``local_share``.

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

      Under ``shard_map`` the loss is replicated, so ``out_specs=P()`` is allowed:

      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("d",))
      >>> rows = jax.device_put(jnp.arange(8.0 * jax.device_count()).reshape(-1, 2),
      ...                       NamedSharding(mesh, P("d")))
      >>> mean_square = lambda x: gc_jax.global_loss(jnp.sum(x**2) / rows.size, "d")
      >>> step = jax.shard_map(jax.value_and_grad(mean_square), mesh=mesh,
      ...                      in_specs=P("d"), out_specs=(P(), P("d")))
      >>> value, grad = jax.jit(step)(rows)
      >>> bool(jnp.allclose(value, jnp.mean(rows**2)))
      True
      >>> bool(jnp.allclose(grad, 2 * rows / rows.size))
      True
    """
    if axis_name is None:
        return local_share
    total = jax.lax.psum(local_share, axis_name)
    if varies_over(local_share, axis_name):
        return total
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
    names = _layout.names(axis_name)

    def cast(x):
        missing = tuple(n for n in names if n not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def vary_like(tree: PyTree, *others: PyTree) -> PyTree:
    """``tree`` cast to vary over every ``shard_map`` axis any leaf of ``others`` varies
    over: the one place where "vary like the inputs" is decided.

    A loop carry, a buffer written with per-device chunks, or parameters used with
    per-device rows must have the type of what meets them; a replicated value cast so
    gets its (summed) gradient through the cast's transpose.
    """
    return to_varying(tree, varying_axes_of(others) or None)


def reduce_grads(grads: PyTree, axis_name: AxisName | None) -> PyTree:
    """The one gradient all-reduce of a step."""
    if axis_name is None:
        return grads
    return jax.lax.psum(grads, axis_name)


def replicated_loss(loss: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """Returns the (already global) loss typed as replicated, for ``out_specs=P()``."""
    varying = tuple(a for a in _layout.names(axis_name) if a in varying_axes(loss))
    return jax.lax.pmean(loss, varying) if varying else loss


def typed_axes(axis_name: AxisName | None) -> AxisName | None:
    """``axis_name`` if values inside it carry varying types (``shard_map`` with
    ``check_vma=True``); None under ``pmap``, ``vmap``, ``check_vma=False`` or outside."""
    if axis_name is None or not _layout.is_bound(axis_name):
        return None
    return axis_name if varying_axes(jax.lax.axis_index(axis_name)) else None


def check_split_alike(sides: dict[str, PyTree], axis_name: AxisName | None) -> None:
    """Raises unless the loss's sides are split over the same ``shard_map`` axes.

    Inside ``shard_map`` (with its default ``check_vma=True``) a value's type says
    which manual axes it varies over. A loss pairs this device's rows of ``x`` with
    the rows of ``y`` it holds (the core: input ``i``'s rows with the other inputs');
    one side replicated while the other is split (e.g.
    ``in_specs=(P(), P("data"), P())``) silently pairs the wrong rows: the replicated
    documents would be read as hard negatives, or gathered ``P`` times over. Under
    ``pmap`` or ``check_vma=False`` values carry no such type and this cannot be seen.
    """
    varying = {name: set(varying_axes_of(v)) for name, v in sides.items()}
    wanted = set(_layout.names(axis_name)) | set().union(*varying.values())
    for name, axes in varying.items():
        missing = sorted(wanted - axes, key=str)
        if missing:
            split = [n for n, a in varying.items() if set(missing) & a] or ["axis_name"]
            spec = missing[0] if len(missing) == 1 else tuple(missing)
            consequence = (
                "the loss would pair each device's rows with rows of another device's examples"
                if len(sides) > 1
                else "every device would count the same rows as its own share of the batch"
            )
            raise ValueError(
                f"{name} is replicated over mesh axes {missing} inside shard_map (in_specs "
                f"P() for it) while {' and '.join(split)} {'is' if len(split) == 1 else 'are'}"
                f" split over them, so {consequence}: a wrong loss, silently. Split {name}"
                f"{' like the others' if len(sides) > 1 else ''}: in_specs=P({spec!r}) for it "
                "(each device its own rows), or pass every input replicated and call the "
                "loss without axis_name."
            )


def untyped_manual_axes(axis_name: AxisName | None) -> tuple:
    """Manual axes bound here (``pmap``, ``shard_map``) outside ``axis_name`` whose values
    carry no varying type (``pmap``, ``shard_map(check_vma=False)``).

    Over such an axis JAX cannot tell whether the batch is split; under
    ``check_vma=True`` an axis's own index is typed as varying over it.
    """
    named = set(_layout.names(axis_name))
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    return tuple(
        a for a in manual if a not in named and a not in varying_axes(jax.lax.axis_index(a))
    )


_COLLECTIVES = ("psum", "pmax", "pmin", "all_gather", "reduce_scatter", "ppermute", "all_to_all")


def collective_axes(jaxpr: Any) -> set:
    """The named axes that the collectives of ``jaxpr`` (and its inner jaxprs) run over.

    A ``shard_map`` or ``pmap`` inside ``jaxpr`` binds its own axes (a loss under
    sharded ``jit`` runs its ring in one): its collectives are not counted.
    """
    from jax.extend import core as jex_core

    found: set = set()

    def visit(value):
        if isinstance(value, jex_core.ClosedJaxpr):
            value = value.jaxpr
        if isinstance(value, jex_core.Jaxpr):
            for eqn in value.eqns:
                if eqn.primitive.name in ("shard_map", "xla_pmap"):
                    continue  # its collectives run over the axes it binds itself
                if any(c in eqn.primitive.name for c in _COLLECTIVES):
                    axes = eqn.params.get("axis_name", eqn.params.get("axes", ()))
                    found.update(a for a in _layout.names(axes) if not isinstance(a, int))
                for param in eqn.params.values():
                    visit(param)
        elif isinstance(value, tuple | list):
            for v in value:
                visit(v)

    visit(jaxpr)
    return found


def check_loss_axes(loss_axes: set, axis_name: AxisName | None, inputs_vary: tuple) -> None:
    """Raises unless the loss's collectives and the core's ``axis_name`` agree.

    ``loss_axes``: the axes the loss communicates over (:func:`collective_axes`);
    ``inputs_vary``: the ``shard_map`` axes the inputs vary over.
    """
    names = set(_layout.names(axis_name))
    if names and not loss_axes & names:
        raise ValueError(
            f"axis_name={axis_name!r} was given, but loss_fn communicates over no axis "
            f"{'' if not loss_axes else '(only ' + repr(sorted(loss_axes, key=str)) + ') '}"
            "of it: it would return this device's local loss while gc_jax sums the "
            f"gradients over {axis_name!r}, so loss and gradients would both be wrong. Pass "
            f"axis_name={axis_name!r} to the loss too (e.g. gc_jax.losses.contrastive_loss(q, "
            f"d, axis_name={axis_name!r})), or gather the representations in your loss "
            "(gc_jax.compat.functional.gather_inputs, gc_jax.global_loss)."
        )
    if not names and loss_axes:
        axes = sorted(loss_axes, key=str)
        raise ValueError(
            f"loss_fn communicates over mesh axes {axes} but axis_name was not given, so "
            "the per-device gradients would never be summed. Pass "
            f"axis_name={axes[0] if len(axes) == 1 else tuple(axes)!r} to "
            "cached_value_and_grad (or make_train_step / GradCache)."
        )
    missing = [a for a in inputs_vary if a not in names]
    if missing:
        fix = missing[0] if len(missing) == 1 else tuple(missing)
        raise ValueError(
            f"the inputs vary over mesh axes {missing} (inside shard_map) but "
            f"axis_name={axis_name!r} does not name them: each device would train on its "
            f"own rows alone. Pass axis_name={fix!r} here and to the loss."
        )
