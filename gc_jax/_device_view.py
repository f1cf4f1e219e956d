"""What an encoder sees of a chunk under ``jit`` over a batch split across devices.

``"local"``: each device's rows as plain local arrays, under ``shard_map`` over the
batch's mesh axes (:func:`encode_local`); ``"global"``: the chunk as a sharded global
array, as under plain ``jit``. ``gc_jax._passes.per_device`` chooses
(:data:`gc_jax._base.EncoderView`); this module holds the local form and when it
cannot be used.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.extend
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


def batch_annotation(jaxpr: Any, axes: Any) -> str | None:
    """The first sharding annotation in ``jaxpr`` (nested jaxprs included) that names one
    of the batch ``axes``, described for a log line; None: there is none.

    Such an annotation (``with_sharding_constraint(h, NamedSharding(mesh, P("data")))``
    on activations, as MaxText's layers put; an ``out_sharding``, a ``reshard``) was
    written for the chunk spanning the devices: inside ``shard_map`` over those axes it
    names manual axes, which JAX refuses, on JAX 0.12 only when the step is lowered. So
    the rule is read from the jaxpr, not from whether tracing raised.
    """
    wanted = set(_layout.names(axes))
    for eqn in _equations(jaxpr):
        for value in _values(eqn.params, skip_specs=eqn.primitive.name == "shard_map"):
            spec = value.spec if isinstance(value, NamedSharding) else value
            if isinstance(spec, PartitionSpec) and wanted & set(_spec_names(spec)):
                return f"{eqn.primitive.name} to {spec}"
    return None


def _equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for value in _values(eqn.params, skip_specs=False):
            if isinstance(value, jax.extend.core.Jaxpr | jax.extend.core.ClosedJaxpr):
                yield from _equations(value)


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
