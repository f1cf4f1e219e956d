"""What an encoder sees of a chunk under ``jit`` over a batch split across devices.

``"local"``: each device's rows as plain local arrays, under ``shard_map`` over the
batch's mesh axes (:func:`encode_local`); ``"global"``: the chunk as a sharded global
array, as under plain ``jit``. ``gc_jax._passes.per_device`` chooses
(:data:`gc_jax._base.EncoderView`); this module holds the local form and when it
cannot be used.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from gc_jax import _keys, _layout, _validation
from gc_jax._base import Encoder, PyTree


def encode_local(layout: _layout.Layout, encode: Encoder, params: PyTree, chunk: PyTree,
                 key: jax.Array | None, stacked: bool, name: str) -> PyTree:  # fmt: skip
    """Each device's rows of ``chunk`` encoded on their own, under ``shard_map`` over the
    batch's mesh axes.

    The encoder sees what a data-parallel program sees: plain local arrays (the
    device's rows, its copy of the parameters), with the batch axes manual and any
    other mesh axis (a model axis) as the arrays' types say. So an embedding lookup
    ``table[ids]`` needs no sharding annotation, under explicit axes too.
    ``stacked``: ``params`` hold one copy per device (a leading shard axis), so their
    gradients do too and stay on their devices.
    """
    rows = PartitionSpec(layout.axes)

    def one(p, local, k):
        if stacked:  # this device's copy: [1, ...]
            p = jax.tree.map(lambda x: x[0], p)
        k = _keys.device_key(k, jax.lax.axis_index(layout.axes))
        return _validation.call_encoder(encode, p, local, k, name)

    run = jax.shard_map(
        one,
        mesh=layout.mesh,
        in_specs=(rows if stacked else PartitionSpec(), rows, PartitionSpec()),
        out_specs=rows,
        axis_names=frozenset(_layout.names(layout.axes)),
        # Off: some primitives (e.g. erfc, in an exact GELU) have no replication rule
        # for a constant meeting per-device rows on JAX 0.12. Nothing here needs it:
        # only per-device values (the rows, the stacked parameters) are differentiated.
        check_vma=False,
    )
    return run(params, chunk, key)


def why_not_local(layouts: set, layout: _layout.Layout, params: PyTree) -> str | None:
    """Why each device cannot encode its own rows (None: it can)."""
    if len(layouts) > 1:
        return "the inputs are split over different mesh axes"
    if not layout.per_device:
        return "the batch is not split over devices under jit over a mesh"
    if not _layout.stackable(params, layout):
        return (
            f"a parameter is sharded over the batch axes {layout.axes!r} (FSDP); use "
            "encoder_view='global' or 'auto'"
        )
    return None


def unsafe_annotation(jaxpr: Any, layout: _layout.Layout, where: str = "",
                      encoder_only: bool = True) -> str | None:  # fmt: skip
    """Why ``jaxpr`` cannot be encoded on each device's rows: its first sharding
    annotation that is not provably harmless inside ``shard_map`` over the batch axes,
    or a primitive holding a Python rule gc_jax cannot read; None: nothing found.

    Read are the encoder's equations and every jaxpr nested in them (``pjit``,
    ``checkpoint``, ``scan``, ``cond``, ``custom_jvp``'s and ``custom_vjp``'s primal
    functions, ``custom_vmap``'s ...). The custom derivative rules (``custom_vjp``'s
    forward and backward, ``custom_jvp``'s JVP) are Python callables: the caller
    reads them in the jaxpr of the encoder's VJP, where JAX has traced them
    (``where`` names that trace). ``encoder_only``: read only inside gc_jax's own
    ``shard_map`` (the rest of the trace is gc_jax's, not the encoder's).

    Harmless is an annotation that names only mesh axes other than the batch axes of
    the batch's own mesh (a model axis; or none). Anything else (a batch axis, like
    MaxText's activation constraints; another mesh, even over the same devices; a
    device or another kind of sharding) was written for the chunk spanning the
    devices: inside ``shard_map`` over the batch axes JAX refuses it, on JAX 0.12 only
    when the step is lowered. So the rule is read from the jaxpr, not from whether
    tracing raised.
    """
    for eqn, inside in _equations(jaxpr, encoder_only):
        for value in _values(eqn.params, skip_specs=False):
            if _is_annotation(value) and not _harmless(value, layout):
                return _describe(eqn, value, layout) + _place(eqn, inside, where)
        rule = _opaque_rule(eqn)
        if rule:
            return (
                f"holds a Python rule gc_jax cannot read ({eqn.primitive.name}'s {rule})"
                + _place(eqn, inside, where)
            )
    return None


def rule_holding(jaxpr: Any, layout: _layout.Layout) -> str | None:
    """Names the custom derivative rule in the encoder's ``jaxpr`` that holds what
    :func:`unsafe_annotation` finds in the VJP, for a message (None: not found).

    Each ``custom_vjp``/``custom_jvp`` equation is differentiated on its own: its JVP
    runs ``custom_vjp``'s forward rule (``custom_jvp``'s JVP rule), its VJP adds the
    backward rule."""
    untraced = []
    for eqn, _ in _equations(jaxpr, encoder_only=True):
        kind = eqn.primitive.name.removesuffix("_call")
        if kind not in _TRACES:
            continue
        name = _rule_name(eqn.params.get("call_jaxpr"), "function")
        for which, trace in (("forward", _jvp_of), ("backward", _vjp_of))[: _TRACES[kind]]:
            rule = _RULES[kind, which]
            fn = _rule_name(eqn.params.get(rule[1]) or eqn.params.get(rule[2]), "?")
            named = f"the {rule[0]} rule {fn!r} of the {kind} function {name!r}"
            try:
                found = unsafe_annotation(trace(eqn), layout, encoder_only=False)
            except Exception:  # e.g. the annotation itself, on the device's rows
                untraced.append(named)
                continue
            if found:
                return named
    if untraced:
        return f"a custom derivative rule (of those not traceable alone: {'; '.join(untraced)})"
    return None


_RULES = types.MappingProxyType(
    {  # (what it is called, its parameter, its older name)
        ("custom_vjp", "forward"): ("forward", "fwd_jaxpr_thunk", "fwd"),
        ("custom_vjp", "backward"): ("backward", "bwd", "bwd"),
        ("custom_jvp", "forward"): ("JVP", "jvp_jaxpr_fun", "jvp_jaxpr_thunk"),
    }
)
# How many traces read a kind's rules: a custom_jvp's one rule runs in its JVP.
_TRACES = types.MappingProxyType({"custom_vjp": 2, "custom_jvp": 1})


def _rule_name(fun: Any, default: str) -> str:
    info = getattr(fun, "debug_info", None)
    info = info or getattr(getattr(fun, "jaxpr", None), "debug_info", None)
    return getattr(info, "func_name", None) or getattr(fun, "__name__", None) or default


def _one_equation(eqn: Any) -> tuple[Any, list]:
    """``eqn`` as a function of its variables, and their shapes."""
    ins = [v for v in eqn.invars if isinstance(v, jax.extend.core.Var)]
    jaxpr = jax.extend.core.Jaxpr([], ins, eqn.outvars, [eqn])
    call = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(jaxpr, []))
    return call, [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins]


def _jvp_of(eqn: Any) -> Any:
    call, shapes = _one_equation(eqn)
    return jax.make_jaxpr(lambda *x: jax.jvp(call, x, tuple(map(jnp.ones_like, x))))(*shapes)


def _vjp_of(eqn: Any) -> Any:
    call, shapes = _one_equation(eqn)

    def pulled(*x):
        out, pull = jax.vjp(call, *x)
        return pull([jnp.ones_like(o) for o in out])

    return jax.make_jaxpr(pulled)(*shapes)


# Primitives whose Python callables are harmless or read elsewhere: custom_vjp's and
# custom_jvp's rules run (and are read) in the VJP's trace; custom_vmap's rule runs
# only under vmap, traced into the jaxpr there; host callbacks run host code; the
# random primitives carry their PRNG implementation.
_READ_ELSEWHERE = frozenset({
    "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call", "custom_vmap_call",
    "pure_callback", "io_callback", "debug_callback", "random_seed", "random_bits",
    "random_split", "random_fold_in", "random_wrap", "random_unwrap", "threefry2x32",
})  # fmt: skip


def _opaque_rule(eqn: Any) -> str | None:
    """The name of a parameter of ``eqn`` holding a Python rule that is not read."""
    if eqn.primitive.name in _READ_ELSEWHERE:
        return None
    for key, value in eqn.params.items():
        for v in value if isinstance(value, tuple | list) else (value,):
            if callable(v) and not isinstance(v, (type, *_MESHES)) and not _is_annotation(v):
                return f"{key}={getattr(v, '__name__', type(v).__name__)}"
    return None


_MESHES = (jax.sharding.Mesh, jax.sharding.AbstractMesh)


def _is_annotation(value: Any) -> bool:
    return isinstance(value, jax.sharding.Sharding | PartitionSpec | jax.Device)


def _mesh_axes(mesh: Any) -> tuple:
    return tuple(getattr(mesh, "shape_tuple", ()) or ())


def _harmless(value: Any, layout: _layout.Layout) -> bool:
    """Whether ``value`` names only mesh axes other than the batch axes of the batch's
    own mesh (a model axis), or none."""
    if isinstance(value, NamedSharding):
        if _mesh_axes(value.mesh) != _mesh_axes(layout.mesh):
            return False
        value = value.spec
    if not isinstance(value, PartitionSpec):
        return False  # a device, or another kind of sharding
    free = {name for name, _ in _mesh_axes(layout.mesh)} - set(_layout.names(layout.axes))
    return set(_spec_names(value)) <= free


def _describe(eqn: Any, value: Any, layout: _layout.Layout) -> str:
    spec = value.spec if isinstance(value, NamedSharding) else value
    if not isinstance(spec, PartitionSpec):
        return f"has a sharding annotation ({eqn.primitive.name} to {value})"
    if isinstance(value, NamedSharding) and _mesh_axes(value.mesh) != _mesh_axes(layout.mesh):
        return (
            f"has a sharding annotation on another mesh ({eqn.primitive.name} to {spec} "
            f"on a mesh of axes {_mesh_axes(value.mesh)}, not the batch's "
            f"{_mesh_axes(layout.mesh)})"
        )
    named = set(_spec_names(spec)) & set(_layout.names(layout.axes))
    what = f"the batch axes {layout.axes!r}" if named else "axes outside the batch's mesh"
    return f"names {what} in a sharding annotation ({eqn.primitive.name} to {spec})"


def _place(eqn: Any, inside: tuple, where: str) -> str:
    """Where ``eqn`` sits: the primitives around it, the trace, the user's line."""
    parts = [f"inside {' > '.join(inside)}"] if inside else []
    if where:
        parts.append(where)
    site = _site(eqn)
    if site:
        parts.append(f"at {site}")
    return f", {', '.join(parts)}" if parts else ""


def _site(eqn: Any) -> str:
    """``function (file:line)`` of the user's code that emitted ``eqn``, if JAX says."""
    try:
        from jax._src import source_info_util  # private: optional

        frame = source_info_util.user_frame(eqn.source_info.traceback)
    except Exception:  # not given by this JAX: the line is left out
        return ""
    if frame is None:
        return ""
    return f"{frame.function_name} ({os.path.basename(frame.file_name)}:{frame.start_line})"


def _equations(jaxpr: Any, encoder_only: bool, inside: tuple = ()) -> Iterator[tuple]:
    """``(equation, primitives around it)`` for every equation of ``jaxpr`` and of the
    jaxprs nested in it. ``encoder_only``: only those inside a ``shard_map`` (gc_jax's
    own, whose in/out specs name its manual axes and are not read)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if not encoder_only:
            yield eqn, inside
        entering = encoder_only and name == "shard_map"
        for value in _values(eqn.params, skip_specs=entering):
            if isinstance(value, jax.extend.core.Jaxpr | jax.extend.core.ClosedJaxpr):
                deeper = () if encoder_only else (*inside, name)
                yield from _equations(value, encoder_only and not entering, deeper)


def _values(params: dict, skip_specs: bool) -> Iterator[Any]:
    """The values of an equation's parameters, tuples and lists opened (a ``cond``'s
    branches). ``skip_specs``: a ``shard_map``'s own in/out specs name its manual axes."""
    for key, value in params.items():
        if skip_specs and key in ("in_specs", "out_specs"):
            continue
        yield from value if isinstance(value, tuple | list) else (value,)


def _spec_names(spec: PartitionSpec) -> Iterator[str]:
    for entry in spec:
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, tuple):
            yield from (e for e in entry if isinstance(e, str))


def explain(error: Exception) -> None:
    """Adds to an error raised while tracing the encoder on each device's rows what
    commonly causes it there, and what to do."""
    error.add_note(
        "gc_jax traced the encoder on each device's rows under shard_map over the batch "
        "axes (encoder_view='local'). There an encoder cannot close over arrays typed on "
        "explicit mesh axes (pass them in params), nor name the batch axes in sharding "
        "annotations; use encoder_view='global' (or 'auto') for such an encoder: the chunk "
        "then spans the devices, as under plain jit."
    )


def explain_spanning(error: Exception, layout: _layout.Layout) -> None:
    """Adds to an error raised by an encoder whose chunks span the devices over explicit
    mesh axes (``encoder_view="global"``) what it needs, and what to do with a model
    that cannot be annotated: a sharding type error (an unannotated lookup), or JAX's
    refusal of a ``vmap`` over the rows whose unmapped weights are sharded over the
    same axes (a named-axis model's lookup, as Penzai's, with FSDP weights), or of a
    ``scan`` over stacked layers sharded along the layer axis."""
    if layout.kind != "explicit":
        return
    if any(t.__name__ == "ShardingTypeError" for t in type(error).__mro__):
        error.add_note(_spanning_note(layout, _LOOKUP))
    elif isinstance(error, ValueError) and "Unmapped values passed to vmap" in str(error):
        error.add_note(_spanning_note(layout, _VMAPPED))
    elif isinstance(error, ValueError) and "0th dimension of all xs should be" in str(error):
        error.add_note(_spanning_note(layout, _SCANNED))


_LOOKUP = (
    "there the encoder needs the annotations plain jit needs, e.g. an embedding lookup as "
    "table.at[ids].get(out_sharding=P({axes!r})). For a model that cannot be annotated (a "
    "KerasHub backbone's ReversibleEmbedding): keep its parameters replicated over the "
    "batch axes, and encoder_view='auto' encodes each device's rows with plain local "
    "types; or"
)
_VMAPPED = (
    "plain jit of the full batch fails the same way: the model vmaps over the rows (a "
    "named-axis model, e.g. Penzai's embedding lookup) while a weight it does not map is "
    "sharded over the same mesh axes {axes!r}, which JAX refuses under explicit axes. "
    "Shard such weights over another mesh axis (keep them replicated over {axes!r}: "
    "encoder_view='auto' then encodes each device's rows with plain local types), or"
)


_SCANNED = (
    "plain jit of the full batch fails the same way: the model scans over stacked layers "
    "whose layer axis is sharded over mesh axes (MaxText's shard_mode='explicit' with "
    "scan_layers=True), which lax.scan refuses under explicit axes. Shard the stacked "
    "weights over their other dimensions (the layer axis replicated), run the layers "
    "unscanned (MaxText: scan_layers=False), or"
)


def _spanning_note(layout: _layout.Layout, what: str) -> str:
    return (
        f"gc_jax gave the encoder each chunk as one array split over the explicit mesh "
        f"axes {layout.axes!r} (encoder_view='global', which 'auto' picks where a "
        "parameter is sharded over those axes: FSDP), as plain jit over that mesh would; "
        + what.format(axes=layout.axes)
        + " shard them over a mesh with auto axes (jax.make_mesh(..., axis_types=(AxisType.Auto,))"
        ", jax.set_mesh(mesh) and batch_axis=), where the compiler places the lookup."
    )
