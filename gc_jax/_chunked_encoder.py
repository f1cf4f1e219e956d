"""``chunked_encoder``: gradient caching as a composable transform of the encoder.

``chunked_encoder(encode, chunk_size)`` returns ``encode_batch(params, batch, key)``,
which computes what ``encode(params, batch, key)`` would, chunk by chunk, keeping
only the representations. It is a ``jax.custom_vjp``: differentiating *any* program
that uses it (``jax.grad``, ``jax.value_and_grad``, ``jax.vjp``, ``nnx.grad``,
inside a user's own jitted optax or ``TrainState`` step) runs the cached backward,
pass 2 of :mod:`gc_jax._passes`, against the cotangent the rest of the program
produced for the representations. So the loss, the optimizer and the training loop
stay the user's; only the forward function is wrapped.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gc_jax import _distributed, _first_order, _passes, _validation
from gc_jax._base import AxisName, Encoder, EncoderView, PyTree
from gc_jax._chunks import plan as _plan
from gc_jax._chunks.plan import ChunkSize


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static part of a call: what the custom VJP closes over."""

    encode: Callable[..., PyTree]
    chunk_size: _plan.ChunkSize
    policy: Any
    batch_axis: Any
    view: EncoderView = "auto"
    keep: int = 0


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Static:
    """A residual with no array leaves (which batch leaves are differentiated)."""

    value: Any


def _input(config: _Config, params: PyTree, batch: PyTree, key, wrt=()) -> _passes.Input:
    inp = _passes.make_input(
        config.encode,
        batch,
        config.chunk_size,
        key,
        name="encode",
        batch_name="batch",
        batch_axis=config.batch_axis,
        wrt=wrt,
        policy=config.policy,
    )
    return _passes.per_device([inp], params, config.view)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _encode_batch(config: _Config, params: PyTree, batch: PyTree, key) -> PyTree:
    return _passes.forward(_input(config, params, batch, key), params)[0]


def _value(x):
    return x.value if isinstance(x, jax.custom_derivatives.CustomVJPPrimal) else x


def _fwd(config: _Config, params, batch, key):
    is_primal = lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal)
    leaves = jax.tree.leaves(batch, is_leaf=is_primal)
    wrt = tuple(bool(x.perturbed) and _passes.is_inexact(x.value) for x in leaves)
    params, batch, key = jax.tree.map(_value, (params, batch, key), is_leaf=is_primal)
    inp = _input(config, params, batch, key, wrt)
    reps, kept = _passes.forward(inp, params, keep=_keep(config.keep, inp.plan))
    return reps, (params, batch, key, _Static(wrt), kept)


def _keep(keep: int, plan: Any) -> int:
    """``keep``, or a ValueError where the batch has fewer chunks."""
    if keep > plan.keepable:
        raise _plan.TooManyKept(
            f"chunked_encoder(keep={keep}) is more chunks than the batch has: "
            f"{plan.keepable}; write keep={plan.keepable} to keep every chunk, or fewer.",
            plan.keepable,
        )
    return keep


def _dense(ct: Any) -> Any:
    """A symbolic-zero cotangent as an array (integer outputs: float0 zeros)."""
    if not isinstance(ct, jax.custom_derivatives.SymbolicZero):
        return ct
    if jnp.issubdtype(ct.dtype, jnp.inexact):
        return jnp.zeros(ct.shape, ct.dtype)
    return np.zeros(ct.shape, jax.dtypes.float0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_only(chunk_size: Any, tree: PyTree) -> PyTree:
    """``tree``; differentiating through it raises (a token budget's pass 2)."""
    return tree


@_first_order_only.defjvp
def _first_order_only_jvp(chunk_size, primals, tangents):
    what = "chunked_encoder(encode, chunk_size)"
    raise ValueError(_first_order.message(what, chunk_size, forward_mode=False))


def _bwd(config: _Config, residuals, ct):
    params, batch, key, wrt, kept = residuals
    ct = jax.tree.map(
        _dense, ct, is_leaf=lambda x: isinstance(x, jax.custom_derivatives.SymbolicZero)
    )
    if _plan.by_tokens(config.chunk_size):  # loops as long as the data says
        params, batch, ct = _first_order_only(config.chunk_size, (params, batch, ct))
    inp = _input(config, params, batch, key, wrt.value)
    acc, (batch_grads,) = _passes.backward(
        [inp], params, [ct], _passes.grad_buffer(params), kept=[kept]
    )
    grads = _passes.param_grads(acc, params)
    it = iter(batch_grads)  # None: a zero cotangent for leaves nobody differentiates
    batch_grads = [next(it) if w else None for w in wrt.value]
    return grads, jax.tree.structure(batch).unflatten(batch_grads), None


_encode_batch.defvjp(_fwd, _bwd, symbolic_zeros=True)


def _hoisted(config: _Config, params: PyTree, batch: PyTree, key) -> tuple[_Config, PyTree]:
    """``(config, params)`` with what ``encode`` closes over and is differentiated made explicit.

    An encoder built inside the differentiated function (``lambda _, x, key: f(w, x)``
    in ``loss(w)``) closes over ``w``'s tracer, which a ``custom_vjp`` cannot see.
    ``jax.closure_convert`` (once per chunk shape: the full chunks and the last one, or
    one per bucket of a ``TokenBudget``)
    turns such values into arguments; they are passed along with ``params`` and get
    their gradient like them. Closed-over values that are only staged (``jit``) stay
    closed over, as before.
    """
    inp = _input(config, params, batch, key)
    plan, shards = inp.plan, inp.plan.layout.shards if inp.per_device else 1
    shape = lambda chunk: tuple(x.shape for x in jax.tree.leaves(chunk))
    # What encode sees: a chunk, or (per device) one device's rows of it.
    one_device = lambda x: jax.ShapeDtypeStruct((x.shape[0] // shards, *x.shape[1:]), x.dtype)
    converted = {}
    for c in plan.samples():
        chunk = jax.eval_shape(lambda b, c=c: plan.take(b, c), batch)
        chunk = chunk if shards == 1 else jax.tree.map(one_device, chunk)
        call = lambda p, x, k: _validation.call_encoder(config.encode, p, x, k, "encode")
        converted[shape(chunk)] = jax.closure_convert(call, params, chunk, key)
    staged = type(jnp.zeros(()))  # a value merely staged out here (jit), or a plain array
    consts = [cs for _, cs in converted.values()]
    if not any(not isinstance(x, staged) for cs in consts for x in cs):
        return config, params
    if any(len(cs) != len(consts[0]) or any(a is not b for a, b in zip(cs, consts[0], strict=True))
           for cs in consts):  # fmt: skip
        raise ValueError(
            "encode closes over differentiated values, and not the same ones for the full "
            "chunks and the last chunk; pass them as encode's first argument instead: "
            "chunked_encoder(lambda params, x, key: ..., chunk_size)(params, batch)."
        )

    def encode(explicit, chunk, key):
        fn, _ = converted[shape(chunk)]
        return fn(explicit[0], chunk, key, *explicit[1])

    return dataclasses.replace(config, encode=encode), (params, list(consts[0]))


def chunked_encoder(
    encode: Encoder,
    chunk_size: ChunkSize,
    *,
    policy: Callable[..., bool] | None = None,
    batch_axis: AxisName | None = None,
    encoder_view: EncoderView = "auto",
    keep: int = 0,
) -> Callable[..., PyTree]:
    """Wraps an encoder so that any JAX differentiation through it is gradient-cached.

    The forward encodes the batch ``chunk_size`` rows at a time and keeps only the
    representations. Differentiating a program that uses the result (with
    ``jax.grad``, ``jax.value_and_grad``, ``jax.vjp``, ``nnx.grad``, ...) re-encodes
    each chunk under ``jax.vjp`` against its slice of the representations' cotangent
    and accumulates the parameter gradients in a loop: one chunk's activations are
    alive at a time, and the gradient is the one of ``encode(params, batch, key)``.
    Call it as often as you like in one loss (queries and passages, tied or separate
    towers): each call is cached on its own.

    Args:
      encode: ``encode(params, chunk, key) -> reps``; ``reps`` is an array or a
        pytree of arrays with one row per row of ``chunk``. Integer or boolean outputs
        (ids, masks) are returned as they are and get no gradient.
      chunk_size: rows encoded at once. Under ``jit`` with a sharded batch (explicit
        mesh axes, or ``batch_axis``) it counts rows per device; inside
        ``shard_map``/``pmap`` it counts this device's rows. A
        :class:`gc_jax.TokenBudget` or :class:`gc_jax.TokenPacking` counts tokens.
      policy: a ``jax.checkpoint`` policy (``jax.checkpoint_policies``) applied to
        each chunk's re-encoding in the backward pass, to keep even less than one
        chunk's activations; None keeps them all (one chunk's worth).
      batch_axis: under plain ``jit`` with *auto* mesh axes, the mesh axes the batch
        is sharded over (under ``jax.set_mesh``), so that every device encodes its
        rows of every chunk at once. Not needed under explicit axes.
      encoder_view: under ``jit`` over a sharded batch, ``"local"`` (each device
        encodes its rows as plain local arrays), ``"global"`` (the chunk spans the
        devices: the encoder's own sharding annotations, e.g. FSDP) or ``"auto"``
        (local where it can); as in :func:`gc_jax.cached_value_and_grad`.
      keep: how many chunks (the batch's last) the forward encodes under ``jax.vjp``
        and keeps the activations of, when differentiated, so that the backward
        re-encodes only the others; 0 (default) re-encodes every chunk. As in
        :func:`gc_jax.cached_value_and_grad`.

    Returns:
      ``encode_batch(params, batch, key=None) -> reps``. Chunk ``c`` is encoded with
      ``fold_in(key, c)`` in both passes (``None`` stays None), so dropout is replayed
      exactly. Gradients flow to ``params`` and to the float leaves of ``batch`` that
      are differentiated (soft prompts, input embeddings). Under ``shard_map``,
      parameters shared by all devices get the sum of every device's gradient, as
      with any JAX function; under ``pmap``, each device's, as with any JAX
      function (reduce them as usual). Forward-mode differentiation (``jax.jvp``)
      is not supported.

    Examples:
      A plain optax step; only the encoder is wrapped:

      >>> import jax, jax.numpy as jnp, optax, gc_jax
      >>> encode = lambda w, x, key: jnp.tanh(x @ w)
      >>> encode_batch = gc_jax.chunked_encoder(encode, chunk_size=2)
      >>> def loss(w, q, d):
      ...     return gc_jax.losses.contrastive_loss(encode_batch(w, q), encode_batch(w, d))
      >>> w, q, d = jnp.eye(4), jnp.eye(6, 4), jnp.eye(6, 4)[::-1] + 0.1
      >>> value, grads = jax.jit(jax.value_and_grad(loss))(w, q, d)
      >>> plain = lambda w: gc_jax.losses.contrastive_loss(encode(w, q, None), encode(w, d, None))
      >>> bool(jnp.allclose(grads, jax.grad(plain)(w), atol=1e-6))
      True
    """
    _validation.callable_arg(encode, "encode", swapped_with=(
        "chunk_size", chunk_size, "chunked_encoder(encode, chunk_size)"))  # fmt: skip
    chunk_size = _plan.check(chunk_size, "chunk_size")
    if policy is not None:
        _validation.callable_arg(policy, "policy")
    view = _validation.encoder_view(encoder_view)
    keep = _plan.check_keep(keep)
    config = _Config(encode, chunk_size, policy, batch_axis, view, keep)

    def encode_batch(params: PyTree, batch: PyTree, key: jax.Array | None = None) -> PyTree:
        _validation.rng_key(key, "key")
        _validation.leading_size(batch, "batch")
        # Inside shard_map, parameters used with per-device rows are cast to vary
        # first: their gradient is then summed over devices by the cast's transpose.
        params = _distributed.vary_like(params, batch)
        hoisted, params = _hoisted(config, params, batch, key)
        return _encode_batch(hoisted, params, batch, key)

    return encode_batch
