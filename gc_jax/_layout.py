"""Where a batch's rows lie across devices: decided here, once, as a :class:`Layout`.

Four kinds: manual axes inside ``shard_map``/``pmap`` (each device sees its rows), an
explicit mesh read from the array types under ``jit``, an auto mesh named by
``batch_axis`` (with ``jax.set_mesh``), or a single device. :func:`layout_of` decides
it for a batch (the chunk plan carries it, see ``gc_jax._chunks.plan``) and
:func:`rows_layout` for a loss's rows; the chunking, the passes and the losses ask
the layout and never re-derive it. The helpers below read and write shardings in
array types (``jit`` over explicit mesh axes).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from gc_jax._base import AxisName, PyTree


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


LayoutKind = Literal["single", "manual", "explicit", "auto"]


class Layout(NamedTuple):
    """How a batch's rows lie across devices: decided here, once, and asked everywhere else.

    Attributes:
      kind: ``"single"`` (one device, or auto mesh axes nobody named), ``"manual"``
        (inside ``shard_map``/``pmap``: each device holds its rows; ``axes`` is the
        ``axis_name``), ``"explicit"`` (``jit`` over explicit mesh axes: read from the
        arrays' types) or ``"auto"`` (``jit`` over auto mesh axes: named by
        ``batch_axis``, the mesh set with ``jax.set_mesh``).
      axes: the axis name(s) the rows are split over (None when single).
      mesh: the (abstract) mesh of the explicit and auto kinds.
      shards: how many ways the rows are split.
    """

    kind: LayoutKind = "single"
    axes: Any = None
    mesh: Any = None
    shards: int = 1

    @property
    def manual_axes(self) -> AxisName | None:
        """The ``shard_map``/``pmap`` axes the rows are split over (None unless manual):
        what the step's parameters vary over and its gradients are summed over."""
        return self.axes if self.kind == "manual" else None

    @property
    def array_shards(self) -> int:
        """Contiguous shards of the rows in one array as the program sees it.

        ``shards`` under ``jit`` over a mesh; 1 for a single device and inside
        ``shard_map``/``pmap``, where each device's program sees its own rows only.
        """
        return 1 if self.mesh is None else self.shards

    @property
    def sharding(self) -> NamedSharding | None:
        """How a new batch-sized array is sharded under ``jit`` (None: not by gc_jax)."""
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec(self.axes))

    def place(self, v: jax.Array, spec: PartitionSpec | None = None) -> jax.Array:
        """``v`` laid out as ``spec`` (default: rows split like the batch) on the mesh.

        Explicit axes: a ``reshard`` (the sharding is in the type); auto axes: a
        sharding constraint; no mesh: ``v`` itself.
        """
        if self.mesh is None:
            return v
        sharding = NamedSharding(self.mesh, PartitionSpec(self.axes) if spec is None else spec)
        if self.kind == "explicit":
            return jax.sharding.reshard(v, sharding)
        return jax.lax.with_sharding_constraint(v, sharding)

    def place_like(self, buf: jax.Array, like: Any) -> jax.Array:
        """A batch-sized ``buf`` for chunks typed like ``like`` (a ``ShapeDtypeStruct``
        of one chunk's output): rows split like the batch, other dims as ``like``'s
        explicit type (e.g. rows sharded within the chunks of a pre-chunked batch, or
        an embedding dim over a model axis), so writing a chunk needs no reshard."""
        sharding = getattr(like, "sharding", None)
        spec = tuple(getattr(sharding, "spec", None) or ())
        rest = (*spec[1:], *(None,) * buf.ndim)[: buf.ndim - 1]
        if self.mesh is not None:
            return self.place(buf, PartitionSpec(self.axes, *rest) if any(rest) else None)
        if not any(a is not None for a in rest) or not hasattr(sharding, "mesh"):
            return buf
        return jax.sharding.reshard(buf, NamedSharding(sharding.mesh, PartitionSpec(None, *rest)))

    @property
    def per_device(self) -> bool:
        """Whether the rows are split over devices under ``jit`` (see :meth:`stack`)."""
        return self.mesh is not None and self.shards > 1

    def stack(self, x: jax.Array) -> jax.Array:
        """``x`` repeated along a new leading shard axis: each device holds its copy.

        Other dims keep ``x``'s explicit sharding (model parallelism); under auto axes
        the compiler chooses them.
        """
        stacked = jnp.broadcast_to(x[None], (self.shards, *x.shape))
        if self.kind == "explicit":
            rest = (*typed_spec(x), *(None,) * x.ndim)[: x.ndim]
        else:
            rest = (PartitionSpec.UNCONSTRAINED,) * x.ndim
        return self.place(stacked, PartitionSpec(self.axes, *rest))

    @property
    def shards_sharding(self) -> NamedSharding | None:
        """Under explicit axes, how an array with a leading shard axis is split (each
        device its shard): an ``out_sharding`` JAX cannot infer for a scatter; else None."""
        if self.kind != "explicit":
            return None
        return NamedSharding(self.mesh, PartitionSpec(self.axes))

    def reshape(self, x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """``x`` (leading axis: the shards) reshaped, the shards staying split over
        ``axes`` (under explicit axes the output sharding must be stated)."""
        if self.kind != "explicit":
            return x.reshape(shape)
        spec = PartitionSpec(self.axes, *(None,) * (len(shape) - 1))
        return jax.lax.reshape(x, shape, out_sharding=NamedSharding(self.mesh, spec))

    def rows_split(self, x: jax.Array) -> jax.Array:
        """``x`` (rows first) with its rows split like the batch's in its type (explicit
        axes), when its type lost that split (e.g. a ``pure_callback``'s result); other
        dims keep their sharding. Anything else: ``x`` itself."""
        spec = typed_spec(x)
        if self.kind != "explicit" or self.shards == 1 or (spec and spec[0] == self.axes):
            return x
        rest = (*spec[1:], *(None,) * x.ndim)[: x.ndim - 1]
        return jax.sharding.reshard(x, NamedSharding(self.mesh, PartitionSpec(self.axes, *rest)))


SINGLE = Layout()


def stackable(params: PyTree, layout: Layout) -> bool:
    """Whether ``params`` can get a per-device copy along ``layout``'s axes: no leaf may
    be sharded over them (FSDP) in its explicit type."""
    axes = set(names(layout.axes))

    def uses_batch_axes(p):
        return any(set(names(s)) & axes for s in typed_spec(p) if s is not None)

    return not any(uses_batch_axes(p) for p in jax.tree.leaves(params))


def chunks_spread(tree: PyTree, params: PyTree, name: str, spanning: bool = False) -> PyTree:
    """A pre-chunked ``tree`` (``[n_chunk, rows, ...]``) laid out for its encoder.

    Each device holds whole chunks where the chunk axis is split over explicit mesh
    axes. An encoder that cannot run on each device's chunks alone needs each chunk
    spread over the devices instead, as under plain ``jit``: where ``params`` are
    sharded over those axes too (FSDP: the encoder gathers its weights and constrains
    its rows to them), or where the caller found it does not trace per device
    (``spanning``). The chunks are then moved from ``P(axes, None)`` to
    ``P(None, axes)`` (an all-to-all). Anything else: ``tree`` itself.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    layout = next((axis_layout(x) for _, x in leaves if axis_layout(x) is not None), None)
    if layout is None or layout.kind != "explicit":
        return tree
    if stackable(params, layout) and not spanning:
        return tree
    why = "the encoder does not run on each device's chunks alone"
    if not spanning:
        why = "the params are sharded over those axes too (FSDP)"
    for path, x in leaves:
        if x.ndim < 2 or x.shape[1] % layout.shards:
            raise ValueError(
                f"{name}{jax.tree_util.keystr(path)} has shape {tuple(x.shape)}: its "
                f"chunk axis is split over the explicit mesh axes {layout.axes!r} and {why}, "
                f"so each chunk's rows must be split over those {layout.shards} devices, "
                f"which {layout.shards} must divide; use fewer, larger chunks "
                f"(cachex.tree_chunk(batch, n_chunk) with batch_size // n_chunk a multiple "
                f"of {layout.shards})."
            )

    def spread(x):
        rest = (*typed_spec(x)[2:], *(None,) * x.ndim)[: x.ndim - 2]
        spec = PartitionSpec(None, layout.axes, *rest)
        return jax.sharding.reshard(x, NamedSharding(layout.mesh, spec))

    return jax.tree.map(spread, tree)


def typed_spec(x: jax.Array) -> tuple:
    """The partition spec in ``x``'s type (``jit`` over explicit mesh axes), else ``()``."""
    return tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ())


def reshard_typed(v: jax.Array, spec: PartitionSpec) -> jax.Array:
    """``v`` resharded to ``spec`` over the mesh in its type, if its type is sharded.

    Under ``jit`` over explicit mesh axes the sharding is part of the type, with or
    without ``jax.set_mesh``; the mesh is taken from there. Under auto axes (or
    unsharded) the type has no sharding and ``v`` is returned as is.
    """
    current = typed_spec(v)
    if not any(a is not None for a in current) or current == tuple(spec):
        return v
    return jax.sharding.reshard(v, NamedSharding(jax.typeof(v).sharding.mesh, spec))


def typed_like(v: jax.Array, like: jax.Array) -> jax.Array:
    """``v`` resharded to the explicit sharding in ``like``'s type, if they differ.

    An accumulator a user (or ``jnp.zeros_like`` without a context mesh) made
    unsharded meets gradients sharded like the parameters in a loop carry: both
    must have one type.
    """
    spec = typed_spec(like)
    if not any(a is not None for a in spec) or typed_spec(v) == spec:
        return v
    return jax.sharding.reshard(v, jax.typeof(like).sharding)


def gathered_scoring(x: jax.Array, ys: jax.Array, whole_x: bool) -> tuple[jax.Array, jax.Array]:
    """A loss's gather form under ``jit`` over explicit mesh axes: what each device needs.

    Every device scores its rows of ``x`` (whole rows: an embedding dim sharded over
    another axis is gathered) against all of ``ys``; with ``whole_x`` (the blockwise
    loops) all of ``x`` too. Without explicit sharding this is a no-op.
    """
    rows = typed_spec(x)[:1] or (None,)
    x = reshard_typed(x, PartitionSpec() if whole_x else PartitionSpec(rows[0], None))
    return x, reshard_typed(ys, PartitionSpec())


def typed_mesh(tree: PyTree) -> Any:
    """The mesh in the types of ``tree``'s leaves (``jit`` over explicit axes), or None."""
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):  # e.g. an encoder in a NamedTuple
            continue
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and any(s is not None for s in typed_spec(leaf)):
            return mesh
    return None


def types_mesh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under the mesh its arguments' types name, when no mesh is set.

    Under ``jit`` over *explicit* mesh axes the sharding is part of each array's type,
    and users need not call ``jax.set_mesh``. Since JAX 0.12 new arrays (``zeros_like``,
    ``full``) are typed against the *context* mesh, so without one they come out
    unsharded and clash with the sharded values they meet (a loop carry, an update).
    Inside ``fn`` the context mesh is the one the arguments already live on, as if
    the user had set it; with a mesh set, or no explicit sharding, nothing changes.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        mesh = None
        if jax.sharding.get_abstract_mesh().empty:
            mesh = typed_mesh((args, kwargs))
        if mesh is None:
            return fn(*args, **kwargs)
        with jax.sharding.use_abstract_mesh(mesh):
            return fn(*args, **kwargs)

    return run


def _mesh_layout(mesh: Any, axes: Any) -> Layout:
    shards = math.prod(mesh.shape[a] for a in names(axes))
    explicit = jax.sharding.AxisType.Explicit in mesh.axis_types
    return Layout("explicit" if explicit else "auto", axes, mesh, shards)


def axis_layout(leaf: jax.Array, axis: int = 0) -> Layout | None:
    """The layout of ``leaf``'s ``axis`` read from its type (explicit mesh axes), or None."""
    spec = typed_spec(leaf)
    if axis < len(spec) and spec[axis] is not None:
        return _mesh_layout(jax.typeof(leaf).sharding.mesh, spec[axis])
    return None


def _with_leading(leaf: jax.Array, layout: Layout) -> jax.Array:
    """``leaf`` resharded so that its leading axis is split like ``layout`` (a free slice)."""
    spec = tuple(getattr(jax.typeof(leaf).sharding, "spec", ()) or ())
    rest = spec[1:] + (None,) * (leaf.ndim - max(len(spec), 1))
    return layout.place(leaf, PartitionSpec(layout.axes, *rest))


def is_bound(axis_name: AxisName) -> bool:
    """Whether ``axis_name`` is an axis of an enclosing ``shard_map``/``pmap``/``vmap``."""
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True


_BATCH: contextvars.ContextVar[Layout] = contextvars.ContextVar("gc_jax_batch_layout", default=None)


@contextlib.contextmanager
def batch_layout(layout: Layout) -> Iterator[None]:
    """The layout the losses assume for rows whose types say nothing (auto mesh axes).

    ``cached_value_and_grad`` (and the forms built on it) call the loss inside this,
    with the layout of the batch they were given, so a loss called without
    ``axis_name`` on the cached representations under auto axes and ``batch_axis``
    knows how its rows are split (see :func:`rows_layout`).

    Why implicit: the loss is the user's ``loss_fn(params, *reps)``, which calls
    ``gc_jax.losses`` itself; under auto mesh axes nothing in ``reps`` says how
    their rows are split, and the user's signature leaves no room to pass it. A
    ``ContextVar`` (not a module-level list) keeps it per thread and per task, and
    is reset even when the loss raises.
    """
    token = _BATCH.set(layout)
    try:
        yield
    finally:
        _BATCH.reset(token)


def rows_layout(x: jax.Array, axis_name: AxisName | None = None) -> Layout:
    """How a loss's rows ``x`` lie across devices.

    ``axis_name`` bound by ``shard_map``/``pmap``: manual. ``axis_name`` naming axes of
    the mesh set with ``jax.set_mesh`` outside ``shard_map``: rows split over them,
    under ``jit``. No ``axis_name``: explicit axes from ``x``'s type; else the layout
    of the batch the core encoded (:func:`batch_layout`); else a single device.
    """
    if axis_name is not None:
        if is_bound(axis_name):
            return Layout("manual", axis_name, None, jax.lax.axis_size(axis_name))
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or any(a not in mesh.axis_names for a in names(axis_name)):
            raise ValueError(
                f"axis_name={axis_name!r} is neither an axis of an enclosing shard_map or "
                f"pmap nor of the mesh set with jax.set_mesh (mesh axes: "
                f"{() if mesh.empty else mesh.axis_names}). Call the loss inside "
                "shard_map/pmap, or under `with jax.set_mesh(mesh):` with the batch's mesh "
                "axes, or pass axis_name=None under jit over explicitly sharded rows."
            )
        return _mesh_layout(mesh, axis_name)
    found = axis_layout(x)
    if found is not None:
        return found
    batch = _BATCH.get()
    if batch is not None and batch.mesh is not None and not varying_axes(x):
        return batch
    return SINGLE


def layout_of(
    tree: PyTree,
    axis_name: AxisName | None = None,
    batch_axis: AxisName | None = None,
    name: str = "inputs",
) -> tuple[PyTree, Layout]:
    """How the leading axis of a batch ``tree`` is split, and the tree laid out so.

    Inside ``pmap``/``shard_map`` (``axis_name`` given, or leaves varying over a manual
    axis) every device holds its own rows: manual. Under plain ``jit`` explicit mesh
    axes are read from the array types; leaves whose leading axis is replicated are
    resharded like the sharded ones (each device keeps its slice), so every leaf is cut
    the same way. Under auto axes the sharding is not in the type, so ``batch_axis``
    names the mesh axes the batch is sharded over, looked up in the mesh set with
    ``jax.set_mesh``.
    """
    if axis_name is not None or varying_axes_of(tree):
        axes = axis_name if axis_name is not None else varying_axes_of(tree)
        return tree, Layout("manual", axes, None, jax.lax.axis_size(axes))
    paths_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    found = {jax.tree_util.keystr(p): axis_layout(x) for p, x in paths_leaves}
    sharded = {k: v for k, v in found.items() if v is not None}
    if len({(v.mesh, names(v.axes)) for v in sharded.values()}) > 1:
        listing = ", ".join(f"{name}{k}: {v.axes!r}" for k, v in sharded.items())
        raise ValueError(
            f"the leaves of {name} are sharded over different mesh axes along the batch "
            f"axis ({listing}); shard every leaf's leading axis the same way, e.g. with "
            "jax.device_put(x, NamedSharding(mesh, P('data')))."
        )
    if sharded:
        layout = next(iter(sharded.values()))
        if len(sharded) < len(found):
            fix = lambda x: x if axis_layout(x) is not None else _with_leading(x, layout)
            tree = jax.tree.map(fix, tree)
    elif batch_axis is not None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or any(a not in mesh.axis_names for a in names(batch_axis)):
            raise ValueError(
                f"batch_axis={batch_axis!r} must name axes of the current mesh; got mesh "
                f"axes {() if mesh.empty else mesh.axis_names}. Call under "
                "`with jax.set_mesh(mesh):`."
            )
        layout = _mesh_layout(mesh, batch_axis)
    else:
        return tree, SINGLE
    rows = paths_leaves[0][1].shape[0]
    if rows % layout.shards:
        raise ValueError(
            f"{name} has {rows} rows, which the {layout.shards} shards of mesh axes "
            f"{layout.axes!r} do not divide; use a batch size that is a multiple of "
            f"{layout.shards}."
        )
    return tree, layout


def names(axis_name: AxisName | None) -> tuple:
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
