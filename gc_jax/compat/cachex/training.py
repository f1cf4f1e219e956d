"""``cache_train_step``: the original ``cachex`` training step for a Flax ``TrainState``.

Built on :func:`~gc_jax.compat.cachex.chunk_encode` (pass 1) and
:func:`~gc_jax.compat.cachex.cache_grad` (pass 2), under ``jax.pmap``. For new code,
:func:`gc_jax.make_train_step` (or :func:`gc_jax.chunked_encoder` inside your own
step) does the same without pre-chunking, with ``shard_map``/sharded ``jit`` too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gc_jax import _validation
from gc_jax.compat.cachex.transforms import cache_grad, chunk_encode, unchunk_args

__all__ = [
    "cache_train_step",
]


def cache_train_step(
    loss_fn: Callable[..., jax.Array],
    state: Any,
    ss: dict[str, Any],
    tt: dict[str, Any],
    axis: Any = "device",
) -> tuple[jax.Array, Any]:
    """One gradient-cached step of a two-input contrastive model, inside ``jax.pmap``.

    Encodes the pre-chunked inputs ``ss`` and ``tt`` with
    ``state.apply_fn(params=state.params, **chunk)`` (representations only), takes
    ``jnp.mean(loss_fn(xx, yy, axis=axis))`` of the un-chunked representations and
    its gradient with respect to them, accumulates the parameter gradients of both
    inputs chunk by chunk, ``pmean``s loss and gradients over ``axis`` and applies
    them.

    Args:
      loss_fn: ``loss_fn(xx, yy, axis=axis) -> per-example losses``, with ``xx`` and
        ``yy`` this device's ``[B, ...]`` representations; it does its own
        ``jax.lax.all_gather`` over ``axis`` for in-batch negatives from every device.
      state: a ``flax.training.train_state.TrainState`` (anything with ``params``,
        ``apply_fn`` taking ``params=`` as a keyword, and ``apply_gradients``).
      ss: keyword inputs of the first encoding (e.g. queries), every leaf
        pre-chunked ``[n_chunk, rows, ...]`` (:func:`~gc_jax.compat.cachex.tree_chunk`);
        per-chunk dropout keys are a leaf like any other.
      tt: the same for the second input (e.g. passages); its ``n_chunk`` may differ.
      axis: the ``pmap`` axis name.

    Returns:
      ``(loss, new_state)``: the loss averaged over devices, and the state after
      ``state.apply_gradients`` with the averaged gradients.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from flax.training import train_state
      >>> from gc_jax.compat.cachex import cache_train_step, tree_chunk
      >>> def loss_fn(xx, yy, axis):
      ...     yy = jax.lax.all_gather(yy, axis, tiled=True)
      ...     labels = jnp.arange(xx.shape[0]) + jax.lax.axis_index(axis) * xx.shape[0]
      ...     return optax.softmax_cross_entropy_with_integer_labels(xx @ yy.T, labels)
      >>> n = jax.local_device_count()
      >>> state = train_state.TrainState.create(
      ...     apply_fn=lambda params, x: jnp.tanh(x @ params["w"]), params={"w": jnp.eye(4)},
      ...     tx=optax.sgd(0.1))
      >>> state = jax.tree.map(lambda v: jnp.broadcast_to(v, (n, *jnp.shape(v))), state)
      >>> x = tree_chunk(jnp.ones((n, 6, 4)), 3, axis=1)  # [device, chunk, rows, 4]
      >>> step = jax.pmap(cache_train_step, axis_name="device", static_broadcasted_argnums=0)
      >>> loss, state = step(loss_fn, state, {"x": x}, {"x": x})
      >>> loss.shape == (n,), bool(jnp.allclose(loss, loss[0])), state.step.tolist() == [1] * n
      (True, True, True)
    """
    _validation.callable_arg(loss_fn, "loss_fn")
    for name, value in (("ss", ss), ("tt", tt)):
        if not isinstance(value, dict):
            raise TypeError(
                f"{name} must be a dict of pre-chunked keyword inputs for state.apply_fn, "
                f"got {type(value).__name__}."
            )

    def encode_with_params(params, **kwargs):
        return state.apply_fn(params=params, **kwargs)

    encode_fn = chunk_encode(functools.partial(encode_with_params, state.params))
    grad_fn = cache_grad(encode_with_params)

    s_reps = encode_fn(**ss)
    t_reps = encode_fn(**tt)

    @unchunk_args(axis=0, argnums=(0, 1))
    def grad_cache_fn(xx, yy):
        return jnp.mean(loss_fn(xx, yy, axis=axis))

    loss, (s_grads, t_grads) = jax.value_and_grad(grad_cache_fn, argnums=(0, 1))(s_reps, t_reps)

    grads = jax.tree.map(jnp.zeros_like, state.params)
    grads = grad_fn(state.params, grads, s_grads, **ss)
    grads = grad_fn(state.params, grads, t_grads, **tt)

    loss, grads = jax.lax.pmean((loss, grads), axis)
    return loss, state.apply_gradients(grads=grads)
