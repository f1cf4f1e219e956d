"""The functional gradient cache: decorators for hand-written training loops.

The JAX counterpart of ``grad_cache.functional`` (``cached``, ``cat_input_tensor``,
``gather_input_tensor``), for loaders that emit small batches: encode each
sub-batch with :func:`cached` (representations only, no activations kept), compute
the loss of the big batch from the cached representations, then call each
sub-batch's ``backward`` with its representation gradient and sum the results.
Chunk keys are yours to choose; :func:`gc_jax.cached_value_and_grad` is the
one-call version of this loop.

Examples:
  Four sub-batches of 2 rows give the gradient of one batch of 8:

  >>> import jax, jax.numpy as jnp, gc_jax
  >>> from gc_jax.compat.functional import cached, cat_inputs
  >>> encode = cached(lambda w, x, key: jnp.tanh(x @ w))
  >>> loss = cat_inputs(gc_jax.losses.contrastive_loss)
  >>> w = jnp.eye(4) / 2
  >>> batches = [(jnp.ones((2, 4)) * i, jnp.arange(8.0).reshape(2, 4) / (i + 8))
  ...            for i in range(4)]
  >>> cache_x, cache_y, closures_x, closures_y = [], [], [], []
  >>> for xx, yy in batches:
  ...     rx, cx = encode(w, xx)
  ...     ry, cy = encode(w, yy)
  ...     cache_x.append(rx)
  ...     cache_y.append(ry)
  ...     closures_x.append(cx)
  ...     closures_y.append(cy)
  >>> value, (gx, gy) = jax.value_and_grad(loss, argnums=(0, 1))(cache_x, cache_y)
  >>> grads = sum(f(g) for f, g in zip(closures_x + closures_y, gx + gy))
  >>> xs, ys = (jnp.concatenate(b) for b in zip(*batches))
  >>> full = lambda w: gc_jax.losses.contrastive_loss(jnp.tanh(xs @ w), jnp.tanh(ys @ w))
  >>> ref_value, ref_grads = jax.value_and_grad(full)(w)
  >>> bool(jnp.allclose(value, ref_value)), bool(jnp.allclose(grads, ref_grads, atol=1e-6))
  (True, True)

  Since ``loss`` takes lists, ``jax.grad`` hands back the representation gradient
  already sliced per sub-batch. Under ``shard_map``/``pmap`` decorate the loss with
  :func:`gather_inputs` too and ``psum`` the summed parameter gradients once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gc_jax import _distributed, _layout, _passes, _validation
from gc_jax._base import Encoder, PyTree

__all__ = [
    "cached",
    "cat_inputs",
    "gather_inputs",
]


def _input(encode: Encoder, params: PyTree, chunk: PyTree, key) -> _passes.Input:
    """The sub-batch as one chunk of the passes, encoded with the user's own ``key``.

    Under ``jit`` over a sharded sub-batch each device encodes its own rows (as every
    form does: ``_passes.per_device``); the chunk is then the device's rows.
    """
    rows = _validation.leading_size(chunk, "chunk")
    shards = _layout.layout_of(chunk, name="chunk")[1].array_shards
    fixed_key = lambda params, x, _: encode(params, x, key)
    inp = _passes.make_input(
        fixed_key, chunk, rows // shards, None, name="encode", batch_name="chunk"
    )
    return _passes.per_device([inp], params)[0]


def _pullback(encode: Encoder, params: PyTree, chunk: PyTree, key, rep_grad: PyTree) -> PyTree:
    inp = _input(encode, params, chunk, key)
    acc, _ = _passes.backward([inp], params, [rep_grad], _passes.grad_buffer(params))
    return _passes.param_grads(acc, params)


def cached(encode: Encoder) -> Callable[..., tuple[PyTree, jax.tree_util.Partial]]:
    """Makes an encoder return its representations and a ``backward`` for later.

    Args:
      encode: ``encode(params, chunk, key) -> reps``, e.g. from ``gc_jax.nnx_encoder``
        or ``gc_jax.linen_encoder``; ``reps`` is an array or a pytree of arrays.

    Returns:
      ``f(params, chunk, key=None) -> (reps, backward)``. ``f`` only runs the
      forward: no activations are kept. ``backward(rep_grad)`` encodes ``chunk``
      again (with the same ``key``, so dropout is replayed) under ``jax.vjp`` and
      returns the gradient with respect to ``params``. ``backward`` is a
      ``jax.tree_util.Partial`` whose leaves are exactly ``params``, ``chunk`` and
      ``key``, so it can be returned from or passed into ``jax.jit``. Both run the
      passes of every other form (``gc_jax._passes``) on the sub-batch as one
      chunk, encoded with ``key`` itself: integer outputs (ids, masks) get no
      gradient, integer parameters a ``float0`` one.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.compat.functional import cached
      >>> reps, backward = cached(lambda w, x, key: x @ w)(jnp.eye(2), jnp.ones((3, 2)))
      >>> backward(jnp.ones((3, 2)))
      Array([[3., 3.],
             [3., 3.]], dtype=float32)
    """
    _validation.callable_arg(encode, "encode")
    pull = functools.partial(_pullback, encode)

    @functools.wraps(encode)
    def forward(params: PyTree, chunk: PyTree, key: jax.Array | None = None):
        reps = _passes.forward(_input(encode, params, chunk, key), params)[0]
        return reps, jax.tree_util.Partial(pull, params, chunk, key)

    return forward


def _cat(value: list, name: str) -> PyTree:
    if not value:
        raise ValueError(f"{name} is an empty list; expected a list of arrays (or pytrees).")
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *value)


def cat_inputs(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Concatenates list arguments on axis 0 before calling ``loss_fn``.

    Every positional or keyword argument that is a ``list`` (of arrays, or of
    pytrees with the same structure) is concatenated leaf-wise; other arguments
    (tuples included) are passed unchanged. For losses fed the cached
    representations of several sub-batches (the original's ``cat_input_tensor``).

    Args:
      loss_fn: the loss.

    Returns:
      The decorated loss.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.compat.functional import cat_inputs
      >>> cat_inputs(lambda x, scale=1.0: x.sum() * scale)([jnp.ones(2), jnp.ones(3)], scale=2.0)
      Array(10., dtype=float32)
    """
    _validation.callable_arg(loss_fn, "loss_fn")

    @functools.wraps(loss_fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args = [_cat(a, f"argument {i}") if isinstance(a, list) else a for i, a in enumerate(args)]
        kwargs = {k: _cat(v, k) if isinstance(v, list) else v for k, v in kwargs.items()}
        return loss_fn(*args, **kwargs)

    return wrapped


def gather_inputs(
    axis_name: Any,
    *,
    argnums: Sequence[int] = (),
    argnames: Sequence[str] = (),
    has_aux: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """All-gathers array arguments across devices and calls the loss on the global batch.

    Arrays are gathered tiled on axis 0 (device order), so the loss sees the global
    batch. Every device then computes the same global loss ``L``. Differentiated
    naively, the transpose of ``all_gather`` (a reduce-scatter) would sum ``D``
    identical contributions into each device's input gradient, so the decorated loss
    returns the value ``L`` with ``1 / D`` of the gradient,
    ``gc_jax.global_loss(L / D, axis_name)``: ``psum(L / D)`` under ``shard_map``
    (typed as replicated, so it can be returned with ``out_specs=P()``), the same
    value with the gradient of ``L / D`` under ``pmap`` or
    ``shard_map(check_vma=False)``. Each device's input gradient is then exactly its
    rows of the global gradient, and summing the per-device parameter gradients once
    per step (a ``psum``, as ``gc_jax`` does) gives exactly the global gradient, for
    encoder parameters and learnable loss parameters (e.g. a temperature) alike.

    Under ``shard_map``, cast replicated parameters to varying before
    differentiating (``jax.lax.pcast(params, axis_name, to="varying")``) so that JAX
    does not insert a ``psum`` of its own, then ``psum`` the gradients yourself; a
    parameter left replicated gets the global gradient directly.

    Args:
      axis_name: the data-parallel axis of ``pmap``/``shard_map``.
      argnums: positions of the arguments to gather.
      argnames: names of the keyword arguments to gather. If neither ``argnums`` nor
        ``argnames`` is given, every array argument (or array leaf of a pytree
        argument) with at least one axis is gathered, as the original gathers every
        tensor; scalars and non-arrays are passed unchanged.
      has_aux: whether the loss returns ``(loss, aux)``; ``aux`` is passed unchanged.

    Returns:
      A decorator for a loss whose gathered arguments hold rows on axis 0. The
      decorated loss returns the global loss on every device (replicated under
      ``shard_map``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gc_jax.compat.functional import gather_inputs
      >>> mean_square = lambda x: jnp.mean(x**2)
      >>> n = jax.local_device_count()
      >>> x = jnp.arange(2.0 * n).reshape(n, 2)
      >>> f = jax.pmap(jax.value_and_grad(gather_inputs("d")(mean_square)), axis_name="d")
      >>> values, grads = f(x)
      >>> bool(jnp.allclose(values, mean_square(x)))  # the global loss on every device
      True
      >>> bool(jnp.allclose(grads, jax.grad(mean_square)(x)))  # each device: its rows
      True

      Under ``shard_map`` the loss is replicated: ``out_specs=P()`` for it.

      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((n,), ("d",))
      >>> step = jax.shard_map(jax.value_and_grad(gather_inputs("d")(mean_square)),
      ...                      mesh=mesh, in_specs=P("d"), out_specs=(P(), P("d")))
      >>> value, grad = jax.jit(step)(jax.device_put(x, NamedSharding(mesh, P("d"))))
      >>> bool(jnp.allclose(value, mean_square(x)))
      True
      >>> bool(jnp.allclose(grad, jax.grad(mean_square)(x)))
      True
    """
    if isinstance(argnums, int):
        argnums = (argnums,)
    if isinstance(argnames, str):
        argnames = (argnames,)
    everything = not argnums and not argnames

    def pick(value: Any, selected: bool) -> Any:
        if not (selected or everything):
            return value
        gather = lambda x: _distributed.all_gather(x, axis_name)
        is_row_array = lambda x: isinstance(x, jax.Array | np.ndarray) and x.ndim >= 1
        return jax.tree.map(lambda x: gather(x) if is_row_array(x) else x, value)

    def decorator(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        _validation.callable_arg(loss_fn, "loss_fn")

        @functools.wraps(loss_fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            _validation.axis_bound(axis_name)
            args = [pick(a, i in argnums) for i, a in enumerate(args)]
            kwargs = {k: pick(v, k in argnames) for k, v in kwargs.items()}
            out = loss_fn(*args, **kwargs)
            loss, aux = _validation.scalar_loss(out, has_aux)
            loss = _distributed.global_loss(loss / jax.lax.axis_size(axis_name), axis_name)
            return (loss, aux) if has_aux else loss

        return wrapped

    return decorator
