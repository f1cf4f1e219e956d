"""Contrastive losses for cached representations, local or across devices.

*Across devices*, with ``axis_name`` (inside ``shard_map`` or ``pmap``), each device
computes only its own rows' losses against every device's other side, and the loss
returns the *global* loss on every device with the gradient of this device's share
(see ``gc_jax.global_loss``), which is what ``cached_value_and_grad`` expects. Under
``shard_map`` the loss is typed replicated: return it with ``out_specs=P()``. Rows'
gradients are this device's rows of the global gradient, and a replicated scalar
(e.g. a temperature in ``in_specs=P()``) gets the global gradient. Under plain
``jit`` over rows sharded with ``NamedSharding`` the losses read the layout from the
rows' types (explicit mesh axes); under auto mesh axes pass ``axis_name`` naming the
batch's mesh axis (with ``jax.set_mesh``), or nothing inside ``cached_value_and_grad``
/ ``make_train_step`` with ``batch_axis``, which tell the loss (see
``gc_jax._layout.rows_layout``).

*Two forms across devices* (``method=``):

* ``"gather"``: every device all-gathers the other side (``all_gather``, which
  transposes to a reduce-scatter). Under sharded ``jit`` the compiler replicates the
  rows instead and every device computes the whole loss. Per-device memory grows
  with the *global* batch.
* ``"ring"`` (``gc_jax._ring``): each device keeps its rows; the other side's blocks
  travel around the devices with ``ppermute`` (the next block is sent while this one
  is computed), with an online log-sum-exp for the softmax losses and a backward on
  the ring that carries each block's gradient home. Nothing batch-sized is gathered
  in either direction, and per-device memory follows the *per-device* batch, whatever
  the number of devices. Under sharded ``jit`` the loss runs its ring inside a
  ``shard_map`` over the batch's mesh axes.
* ``"auto"`` (the default): the ring when the rows are split over more than one
  device and the gather form would hold more than 64 MiB of gathered rows per device
  (``_GATHER_BYTES``; e.g. 43,690 rows of 768-d bfloat16 for ``contrastive_loss``,
  both sides for ``clip_loss``); the gather form below that, where the ring's
  ``P`` sequential steps would cost more than its memory saves.

With ``block_size`` the logits are computed in ``block_size x block_size`` tiles,
forward and backward, and never held whole (see ``gc_jax._blockwise``): memory
grows with ``rows * dim`` instead of ``rows**2``. Values and gradients match the
dense computation up to float rounding. In the ring, ``block_size`` tiles each
travelling block (without it, each travelling block is one tile).

*Forward mode*: a loss with ``block_size`` (or in ring form) is a ``jax.custom_vjp``,
so ``jax.jvp`` and ``jax.jacfwd`` do not go through it (JAX raises); reverse mode
(``jax.grad``, ``jax.vjp``) does. Without ``block_size``, in the gather form, it is
plain JAX and supports both.

*Precision*: logits and losses are accumulated in at least float32. Rows in bfloat16
or float16 are never cast whole (each matrix product accumulates in float32); the
loss is float32 and the rows' gradients come back in the rows' own dtype. Scalars
(temperature, logit scale and bias) are used in float32 and differentiated as such.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gc_jax import _blockwise, _distributed, _layout, _ring, _validation
from gc_jax._base import AxisName

_REDUCTIONS = ("mean", "sum", "none")
_METHODS = ("auto", "ring", "gather")
_GATHER_BYTES = 64 * 2**20
"""``method="auto"`` gathers while the gathered inputs take at most this much per device."""


def _check_pair(x: jax.Array, y: jax.Array, multiple: bool) -> int:
    for name, v in (("x", x), ("y", y)):
        if getattr(v, "ndim", None) != 2:
            raise ValueError(
                f"{name} must be a 2-D [rows, dim] array, got shape {getattr(v, 'shape', v)}."
            )
    if x.shape[1] != y.shape[1]:
        raise ValueError(
            f"x and y must have the same embedding dim, got x: {x.shape} and y: {y.shape}."
        )
    if multiple:
        if y.shape[0] % x.shape[0]:
            raise ValueError(
                f"len(y) must be a multiple of len(x) (k rows of y per query: its positive, "
                f"then hard negatives), got len(x)={x.shape[0]}, len(y)={y.shape[0]}."
            )
    elif x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have the same number of rows, got {x.shape} and {y.shape}.")
    return y.shape[0] // x.shape[0]


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}.")


def _num_devices(axis_name: AxisName | None) -> int:
    return 1 if axis_name is None else jax.lax.axis_size(axis_name)


def _gather(v: jax.Array, axis_name: AxisName | None) -> jax.Array:
    return v if axis_name is None else _distributed.all_gather(v, axis_name)


def _check_block(block_size: Any) -> int | None:
    return None if block_size is None else _validation.positive_int(block_size, "block_size")


def _check_method(method: Any) -> str:
    if method not in _METHODS:
        raise ValueError(
            f"method must be one of {_METHODS}, got {method!r}: 'ring' passes the other "
            "side's blocks around the devices (memory flat in the number of devices), "
            "'gather' all-gathers it, 'auto' picks (see gc_jax.losses)."
        )
    return method


def _targets(rows: int, k: int, axis_name: AxisName | None) -> jax.Array:
    """Index into the gathered other side of each local row's positive (``k`` per query)."""
    offset = 0 if axis_name is None else _distributed.axis_index_offset(rows, axis_name)
    return (offset + jnp.arange(rows)) * k


def _reduce(per_row: jax.Array, global_rows: int, reduction: str, axis_name) -> jax.Array:
    """Reduces this device's per-row losses into the global mean or sum."""
    if reduction == "none":
        return per_row
    share = jnp.sum(per_row)
    if reduction == "mean":
        share = share / global_rows
    return _distributed.global_loss(share, axis_name)


def _logits(x: jax.Array, ys: jax.Array, scale, bias=0.0) -> jax.Array:
    """``scale * x @ ys.T + bias`` accumulated in at least float32, without casting x or ys."""
    acc = _blockwise.accumulation_dtype(x, ys, scale, bias)
    return scale * jnp.matmul(x, ys.T, preferred_element_type=acc) + bias


def _rows(kind, x, y, k, scale, bias, block_size, axis_name, ring) -> jax.Array:
    """Per-row losses of this device's ``x`` against every device's ``y``, ring or gathered."""
    n = x.shape[0]
    if ring:
        block = block_size or max(n, y.shape[0])  # dense: one tile per travelling block
        return _ring.rows(kind, x, y, jnp.arange(n) * k, scale, bias, block, axis_name)
    ys = _gather(y, axis_name)
    targets = _targets(n, k, axis_name)
    x, ys = _layout.gathered_scoring(x, ys, whole_x=block_size is not None)
    if block_size is not None:
        return _blockwise._call(kind, x, ys, targets, scale, bias, block_size)
    logits = _logits(x, ys, scale, bias)
    positive = jnp.arange(ys.shape[0]) == targets[:, None]
    if kind is _blockwise._Softmax:
        # Not optax's integer-label cross-entropy: its per-row gather transposes to a
        # scatter whose sharding JAX 0.12 cannot infer under explicit mesh axes.
        pos = jnp.sum(jnp.where(positive, logits, 0), axis=1)
        return jax.nn.logsumexp(logits, axis=1) - pos
    labels = jnp.where(positive, 1.0, -1.0).astype(logits.dtype)
    return -jnp.sum(jax.nn.log_sigmoid(labels * logits), axis=1)


def _use_ring(method: str, layout: _layout.Layout, gathered: int) -> bool:
    """The automatic rule: the ring once the gathered side would exceed ``_GATHER_BYTES``."""
    if method != "auto":
        return method == "ring"
    return layout.shards > 1 and gathered > _GATHER_BYTES


@_layout.types_mesh
def _run(local, x, y, scalars, *, reduction, method, axis_name, sides):
    """Runs ``local(x, y, *scalars, axis_name=, ring=)`` where the rows lie.

    ``sides``: the inputs each device would gather in the gather form (their size
    decides ``method="auto"``). Under ``jit`` over a mesh (explicit axes read from the
    types, an ``axis_name`` naming a mesh axis outside ``shard_map``, or the core's
    ``batch_axis``) the ring runs inside a ``shard_map`` over the batch's mesh axes.
    """
    _distributed.check_split_alike({"x": x, "y": y}, _distributed.typed_axes(axis_name))
    layout = _layout.rows_layout(x, axis_name)
    here = sum(v.size * v.dtype.itemsize for v in sides) // layout.array_shards
    gathered = layout.shards * here  # what every device would hold in the gather form
    ring = _use_ring(method, layout, gathered)
    if layout.kind in ("single", "manual"):
        return local(x, y, *scalars, axis_name=layout.axes, ring=ring and layout.shards > 1)
    if not ring:  # gathered whole by the compiler, from the sharding in the types
        return local(x, y, *scalars, axis_name=None, ring=False)
    rows = P(layout.axes, None)
    out = P(layout.axes) if reduction == "none" else P()
    f = jax.shard_map(
        functools.partial(local, axis_name=layout.axes, ring=True),
        mesh=layout.mesh,
        in_specs=(rows, rows, *[P()] * len(scalars)),
        out_specs=out,
    )
    scalars = [jnp.asarray(v, jnp.result_type(v, jnp.float32)) for v in scalars]
    return f(layout.place(x, rows), layout.place(y, rows), *scalars)


def contrastive_loss(
    x: jax.Array,
    y: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    reduction: str = "mean",
    block_size: int | None = None,
    axis_name: AxisName | None = None,
    method: str = "auto",
) -> jax.Array:
    """InfoNCE of each query row of ``x`` against every row of ``y``.

    ``y`` holds ``k = len(y) // len(x)`` rows per query: its positive first, then its
    hard negatives, so query ``i``'s target is row ``i * k`` (every other row of the
    global ``y`` is a negative).

    Args:
      x: queries, ``[n, d]``.
      y: documents, ``[n * k, d]``.
      temperature: logits are ``x @ y.T / temperature``; may be a traced parameter.
      reduction: ``"mean"`` or ``"sum"`` over the global batch, or ``"none"`` for the
        per-query losses of this device's rows.
      block_size: if set, compute the loss and its gradient in tiles of this many
        rows of each side, never materialising the ``[n, n * k]`` logits.
      axis_name: the data-parallel axis of ``shard_map``/``pmap`` (or a mesh axis
        of ``jax.set_mesh`` under ``jit``), or None (also under ``jit`` over rows
        sharded over explicit mesh axes).
      method: ``"auto"``, ``"ring"`` or ``"gather"``: how the rows of other devices
        are reached (see the module docstring); the same values either way.

    Returns:
      The loss, in float32 (or wider). Under ``axis_name``: the global loss on every
      device, typed replicated under ``shard_map`` (``out_specs=P()``). With
      ``reduction="none"``: this device's per-row losses.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gc_jax.losses import contrastive_loss
      >>> q = jnp.array([[1.0, 0.0], [0.0, 1.0]])
      >>> float(contrastive_loss(q, q, temperature=0.1)) < 1e-4
      True
      >>> x, y = jnp.sin(jnp.arange(80.0)).reshape(2, 10, 4)
      >>> blockwise = jax.jit(contrastive_loss, static_argnames="block_size")
      >>> bool(jnp.allclose(blockwise(x, y, block_size=3), contrastive_loss(x, y)))
      True

      bfloat16 rows: a float32 loss, bfloat16 gradients.

      >>> value, grad = jax.jit(jax.value_and_grad(contrastive_loss))(x.astype(jnp.bfloat16), y)
      >>> value.dtype, grad.dtype
      (dtype('float32'), dtype(bfloat16))

      Under ``shard_map`` with a learnable temperature: the loss and the temperature's
      gradient are replicated, each device gets its rows' gradients.

      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> def step(x, y, t):
      ...     loss = lambda x, y, t: contrastive_loss(x, y, temperature=t, axis_name="data")
      ...     return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, y, t)
      >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data"), P()),
      ...                           out_specs=(P(), (P("data"), P("data"), P()))))
      >>> x, y = jnp.sin(jnp.arange(16.0 * jax.device_count())).reshape(2, -1, 4)
      >>> rows = NamedSharding(mesh, P("data"))
      >>> got = f(jax.device_put(x, rows), jax.device_put(y, rows), 0.5)
      >>> full = lambda x, y, t: contrastive_loss(x, y, temperature=t)
      >>> want = jax.jit(jax.value_and_grad(full, argnums=(0, 1, 2)))(x, y, 0.5)
      >>> jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-6)), got, want))
      True

      The ring form: ``y``'s blocks travel around the devices, nothing is gathered.

      >>> def ring(x, y, t):
      ...     return contrastive_loss(x, y, temperature=t, axis_name="data", method="ring")
      >>> f = jax.jit(jax.shard_map(jax.value_and_grad(ring, argnums=(0, 1, 2)), mesh=mesh,
      ...     in_specs=(P("data"), P("data"), P()), out_specs=(P(), (P("data"), P("data"), P()))))
      >>> got = f(jax.device_put(x, rows), jax.device_put(y, rows), 0.5)
      >>> jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-6)), got, want))
      True
    """
    _check_reduction(reduction)
    block_size, method = _check_block(block_size), _check_method(method)
    k = _check_pair(x, y, multiple=True)

    def local(x, y, temperature, *, axis_name, ring):
        scale = 1.0 / temperature
        per_row = _rows(_blockwise._Softmax, x, y, k, scale, 0.0, block_size, axis_name, ring)
        return _reduce(per_row, len(x) * _num_devices(axis_name), reduction, axis_name)

    kw = {"reduction": reduction, "method": method, "axis_name": axis_name}
    return _run(local, x, y, (temperature,), sides=(y,), **kw)


def clip_loss(
    x: jax.Array,
    y: jax.Array,
    logit_scale: float | jax.Array,
    *,
    reduction: str = "mean",
    block_size: int | None = None,
    axis_name: AxisName | None = None,
    method: str = "auto",
) -> jax.Array:
    """Symmetric CLIP loss: the mean of image-to-text and text-to-image InfoNCE.

    Args:
      x: one modality, ``[n, d]`` (normalise rows yourself, as CLIP does).
      y: the other modality, ``[n, d]``; row ``i`` pairs with ``x[i]``.
      logit_scale: *log* of the logit multiplier (learnable in CLIP, which starts
        at ``log(1 / 0.07)``); logits are ``exp(logit_scale) * x @ y.T``.
      reduction: ``"mean"`` or ``"sum"`` over the global batch, or ``"none"`` for
        the per-pair losses of this device's rows.
      block_size: if set, compute both directions and their gradients in tiles of
        this many rows of each side, never materialising the ``[n, n]`` logits.
      axis_name: the data-parallel axis of ``shard_map``/``pmap`` (or a mesh axis
        of ``jax.set_mesh`` under ``jit``), or None (also under ``jit`` over rows
        sharded over explicit mesh axes); each device scores its ``x`` rows against
        every ``y`` and its ``y`` rows against every ``x``.
      method: ``"auto"``, ``"ring"`` or ``"gather"``: how the rows of other devices
        are reached (see the module docstring); the same values either way.

    Returns:
      The loss, in float32 (or wider). Under ``axis_name``: the global loss on every
      device, typed replicated under ``shard_map`` (``out_specs=P()``). With
      ``reduction="none"``: this device's per-row losses.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import clip_loss
      >>> e = jnp.eye(3)
      >>> bool(clip_loss(e, e, jnp.log(100.0)) < 1e-3)
      True
      >>> bool(jnp.allclose(clip_loss(e, e, 0.0, block_size=2), clip_loss(e, e, 0.0)))
      True
    """
    _check_reduction(reduction)
    block_size, method = _check_block(block_size), _check_method(method)
    _check_pair(x, y, multiple=False)

    def local(x, y, logit_scale, *, axis_name, ring):
        scale, kind = jnp.exp(logit_scale), _blockwise._Softmax
        rows = lambda a, b: _rows(kind, a, b, 1, scale, 0.0, block_size, axis_name, ring)
        x_to_y = rows(x, y)
        if ring:  # one ring at a time, forward and backward (else both hold their buffers)
            x_to_y, x, y = jax.lax.optimization_barrier((x_to_y, x, y))
            x, y = _ring.after(x, x_to_y), _ring.after(y, x_to_y)  # kept on XLA:CPU too
        per_row = (x_to_y + rows(y, x)) / 2
        return _reduce(per_row, len(x) * _num_devices(axis_name), reduction, axis_name)

    kw = {"reduction": reduction, "method": method, "axis_name": axis_name}
    return _run(local, x, y, (logit_scale,), sides=(x, y), **kw)


def sigmoid_loss(
    x: jax.Array,
    y: jax.Array,
    logit_scale: float | jax.Array,
    logit_bias: float | jax.Array,
    *,
    reduction: str = "mean",
    block_size: int | None = None,
    axis_name: AxisName | None = None,
    method: str = "auto",
) -> jax.Array:
    """SigLIP's pairwise sigmoid loss.

    Every pair ``(x[i], y[j])`` is a binary problem, positive iff ``i == j``, with
    logit ``exp(logit_scale) * x[i] @ y[j] + logit_bias``. As in SigLIP, the sum over
    pairs is divided by the number of rows (not pairs).

    Args:
      x: one modality, ``[n, d]``.
      y: the other modality, ``[n, d]``.
      logit_scale: log of the logit multiplier (SigLIP starts at ``log(10)``).
      logit_bias: added to every logit (SigLIP starts at ``-10``).
      reduction: ``"mean"`` (per row) or ``"sum"`` over the global batch, or
        ``"none"`` for the per-row sums of this device's rows.
      block_size: if set, compute the loss and its gradient in tiles of this many
        rows of each side, never materialising the ``[n, n]`` logits.
      axis_name: the data-parallel axis of ``shard_map``/``pmap`` (or a mesh axis
        of ``jax.set_mesh`` under ``jit``), or None (also under ``jit`` over rows
        sharded over explicit mesh axes).
      method: ``"auto"``, ``"ring"`` or ``"gather"``: how the rows of other devices
        are reached (see the module docstring); the same values either way.

    Returns:
      The loss, in float32 (or wider). Under ``axis_name``: the global loss on every
      device, typed replicated under ``shard_map`` (``out_specs=P()``). With
      ``reduction="none"``: this device's per-row losses.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import sigmoid_loss
      >>> e = jnp.eye(3)
      >>> bool(sigmoid_loss(e, e, jnp.log(20.0), -10.0) < 1e-3)
      True
      >>> blockwise = sigmoid_loss(e, e, 0.0, -1.0, block_size=2)
      >>> bool(jnp.allclose(blockwise, sigmoid_loss(e, e, 0.0, -1.0)))
      True
    """
    _check_reduction(reduction)
    block_size, method = _check_block(block_size), _check_method(method)
    _check_pair(x, y, multiple=False)

    def local(x, y, logit_scale, logit_bias, *, axis_name, ring):
        scale = jnp.exp(logit_scale)
        kind = _blockwise._Sigmoid
        per_row = _rows(kind, x, y, 1, scale, logit_bias, block_size, axis_name, ring)
        return _reduce(per_row, len(x) * _num_devices(axis_name), reduction, axis_name)

    kw = {"reduction": reduction, "method": method, "axis_name": axis_name}
    return _run(local, x, y, (logit_scale, logit_bias), sides=(y,), **kw)
