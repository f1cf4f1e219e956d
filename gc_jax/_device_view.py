"""What an encoder sees of a chunk under ``jit`` over a batch split across devices.

``"local"``: each device's rows as plain local arrays, under ``shard_map`` over the
batch's mesh axes (:func:`encode_local`); ``"global"``: the chunk as a sharded global
array, as under plain ``jit``. ``gc_jax._passes.per_device`` chooses
(:data:`gc_jax._base.EncoderView`); this module holds the local form and when it
cannot be used.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

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
    """Adds to a sharding type error raised by an encoder whose chunks span the devices
    over explicit mesh axes (``encoder_view="global"``) what it needs, and what to do
    with a model that cannot be annotated."""
    if layout.kind != "explicit" or not any(
        t.__name__ == "ShardingTypeError" for t in type(error).__mro__
    ):
        return
    error.add_note(
        f"gc_jax gave the encoder each chunk as one array split over the explicit mesh "
        f"axes {layout.axes!r} (encoder_view='global', which 'auto' picks where a "
        "parameter is sharded over those axes: FSDP), as plain jit over that mesh would; "
        "there the encoder needs the annotations plain jit needs, e.g. an embedding "
        f"lookup as table.at[ids].get(out_sharding=P({layout.axes!r})). For a model that "
        "cannot be annotated (a KerasHub backbone's ReversibleEmbedding): keep its "
        "parameters replicated over the batch axes, and encoder_view='auto' encodes each "
        "device's rows with plain local types; or shard them over a mesh with auto axes "
        "(jax.make_mesh(..., axis_types=(AxisType.Auto,)), jax.set_mesh and batch_axis=), "
        "where the compiler places the lookup."
    )
