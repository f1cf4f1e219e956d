"""The gradient cache: exact large-batch gradients with one chunk's activations live.

``cached_value_and_grad`` is ``jax.value_and_grad`` for a contrastive loss over
encoded batches, computed in three steps:

1. *Pass 1*: every input is encoded chunk by chunk in a loop; only the
   representations are kept, written in place into the cache (a ``fori_loop``
   rather than ``lax.map``, whose stacked outputs would need a second copy).
2. The loss and its gradient with respect to the cached representations (and the
   parameters the loss itself uses, e.g. a temperature).
3. *Pass 2*: every chunk is encoded again under ``jax.vjp`` and its slice of the
   representation gradient is pulled back to the parameters, accumulated in the
   carry of the loop (never stacked per chunk).

The batch's very last chunk (of the last input) is encoded under ``jax.vjp`` already
in pass 1 and its activations stay live until pass 2, saving one forward without
ever holding two chunks' activations. When every input is a single chunk, every
input's VJP is kept: that is plain full-batch training, with nothing re-encoded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gc_jax import _chunking, _distributed, _validation

PyTree = Any
Encoder = Callable[[PyTree, PyTree, jax.Array | None], PyTree]


def _wide(dtype) -> jnp.dtype:
    """Float dtypes narrower than float32 are widened (cache, loss, accumulation)."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def _cast(tree: PyTree, like: PyTree) -> PyTree:
    return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


def _checked(encode: Encoder, name: str) -> Encoder:
    def run(params, chunk, key):
        reps = encode(params, chunk, key)
        _validation.rows(reps, _validation.leading_size(chunk, "chunk"), name)
        return reps

    return run


def _plan(x, chunk_size, index, axis_name, batch_axis) -> _chunking.ChunkPlan:
    batch = _validation.leading_size(x, f"inputs[{index}]")
    if axis_name is not None:  # inside pmap/shard_map: x holds this device's rows
        return _chunking.make_plan(batch, chunk_size)
    return _chunking.make_plan(batch, chunk_size, *_distributed.batch_sharding(x, batch_axis))


def _chunk_encoder(encode, plan, x, rng, index):
    """``run(params, c)``: chunk ``c`` of the input (None: the tail) encoded with its key."""

    def run(params, c):
        key = _chunking.chunk_key(rng, index, plan.num_body if c is None else c)
        return encode(params, _chunking.take(x, plan, c), key)

    return run


def _forward(run, params, plan, x, keep_tail, cache_dtype, after=()):
    """Pass 1 for one input: the cached representations, and the tail's VJP if kept.

    A kept chunk (see the module docstring) is encoded after every other chunk
    (``after``: the caches already written), so no other chunk's activations
    overlap with it.
    """
    shapes = jax.eval_shape(run, params, None)
    like = jax.tree.map(
        lambda r: jax.ShapeDtypeStruct(r.shape, cache_dtype or _wide(r.dtype)), shapes
    )
    vma = _distributed.varying_axes_of((params, x))
    cache = _chunking.zeros(like, plan, vma)
    if plan.num_body:  # written in place: no stacked copy of the inputs or the cache
        step = lambda c, cache: _chunking.put(cache, run(params, c), plan, c)
        cache = jax.lax.fori_loop(0, plan.num_body, step, cache)
    if not keep_tail:
        return _chunking.put(cache, run(params, None), plan), None
    # The barrier orders the kept chunk's forward after all other pass-1 work.
    (cache, after), params = jax.lax.optimization_barrier(((cache, after), params))
    tail_reps, tail_vjp = jax.vjp(lambda p: run(p, None), params)
    return _chunking.put(cache, tail_reps, plan), tail_vjp


def _backward(run, params, plan, rep_grad, tail_vjp, acc):
    """Pass 2 for one input: accumulates the parameter gradient of every chunk."""
    add = lambda a, g: jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, g)
    shapes = jax.eval_shape(run, params, None)
    cotangent = lambda c: _cast(_chunking.take(rep_grad, plan, c), shapes)
    if tail_vjp is None:  # re-encode the tail, as every other chunk
        # The barrier makes the re-encoding wait for the gradient so far: XLA can
        # neither hoist it next to pass 1 nor merge it with pass 1's forward.
        acc, params = jax.lax.optimization_barrier((acc, params))
        tail_vjp = jax.vjp(lambda p: run(p, None), params)[1]
    acc = add(acc, tail_vjp(cotangent(None))[0])
    if not plan.num_body:
        return acc
    acc, params = jax.lax.optimization_barrier((acc, params))

    def step(c, acc):
        _, vjp = jax.vjp(lambda p: run(p, c), params)
        return add(acc, vjp(cotangent(c))[0])

    return jax.lax.fori_loop(0, plan.num_body, step, acc)


def cached_value_and_grad(
    loss_fn: Callable[..., Any],
    encoders: Encoder | Sequence[Encoder],
    chunk_size: int | Sequence[int],
    *,
    has_aux: bool = False,
    axis_name: Any = None,
    batch_axis: Any = None,
    cache_dtype: Any = None,
) -> Callable[..., Any]:
    """Like ``jax.value_and_grad`` of a loss over encoded batches, with chunked memory.

    Args:
      loss_fn: ``loss_fn(params, *reps, **loss_kwargs)`` returning a scalar loss, or
        ``(loss, aux)`` with ``has_aux``. ``reps[i]`` are the representations of the
        whole ``inputs[i]`` batch. Under ``axis_name`` the loss must be the *global*
        loss on every device, with the gradient of this device's share (the
        ``gc_jax.losses`` do this; see ``gc_jax.global_loss`` for your own).
      encoders: ``encode(params, chunk, key) -> reps``, one for all inputs (tied
        weights) or one per input. ``reps`` is an array or pytree of arrays with one
        row per row of ``chunk``.
      chunk_size: rows encoded at once, for all inputs or one per input. Under
        ``pmap``/``shard_map`` it counts rows per device; under ``jit`` with a sharded
        batch (explicit mesh axes, or ``batch_axis``) it also counts rows per device:
        every device encodes its own ``chunk_size`` rows of every chunk at once.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      axis_name: the data-parallel axis under ``pmap``/``shard_map``, or None.
      batch_axis: under plain ``jit`` with *auto* mesh axes, the mesh axes the batch
        is sharded over (the mesh set with ``jax.set_mesh``), so that every device
        encodes its rows of every chunk at once. Not needed under explicit axes,
        where the sharding is read from the array types.
      cache_dtype: dtype of the cached representations and of the loss inputs;
        default: the encoder's dtype widened to at least float32.

    Returns:
      ``f(params, *inputs, rng=None, loss_scale=None, **loss_kwargs) -> (loss, grads)``
      (or ``((loss, aux), grads)``). ``loss_scale`` multiplies the loss gradient
      before pass 2 and divides the result after (float16 loss scaling); the
      returned gradients are unscaled. Chunk ``c`` of input ``i`` is encoded with key
      ``fold_in(fold_in(rng, i), c)`` in both passes (``None`` if ``rng`` is None),
      so dropout is replayed exactly; under ``axis_name`` the device index is folded
      into ``rng`` first, so devices draw different masks. ``grads`` has the
      structure of ``params``.

    Examples:
      >>> import jax, jax.numpy as jnp, gc_jax
      >>> encode = lambda w, x, key: jnp.tanh(x @ w)
      >>> loss = lambda w, q, d: gc_jax.losses.contrastive_loss(q, d)
      >>> f = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size=3))
      >>> w = jnp.eye(4)
      >>> q, d = jnp.ones((8, 4)), jnp.arange(32.0).reshape(8, 4) / 32
      >>> value, grads = f(w, q, d)
      >>> full = jax.value_and_grad(lambda w: loss(w, encode(w, q, None), encode(w, d, None)))
      >>> bool(jnp.allclose(value, full(w)[0])), grads.shape
      (True, (4, 4))
    """
    _validation.callable_arg(loss_fn, "loss_fn")
    if isinstance(encoders, Sequence):
        encoders = tuple(
            _validation.callable_arg(e, f"encoders[{i}]") for i, e in enumerate(encoders)
        )
        if not encoders:
            raise ValueError("encoders is an empty sequence; expected one encoder per input.")
    else:
        _validation.callable_arg(encoders, "encoders")
    _validation.chunk_sizes(chunk_size)

    def value_and_grad_fn(
        params: PyTree,
        *inputs: PyTree,
        rng: jax.Array | None = None,
        loss_scale: jax.Array | float | None = None,
        **loss_kwargs: Any,
    ):
        if not inputs:
            raise ValueError("no inputs were given; expected at least one batch to encode.")
        n = len(inputs)
        encs = _validation.per_input(encoders, n, "encoders", lambda e, _: e)
        sizes = _validation.per_input(chunk_size, n, "chunk_size", _validation.positive_int)
        _validation.axis_bound(axis_name)
        _validation.rng_key(rng)
        encs = [
            _checked(e, f"encoders[{i}]" if isinstance(encoders, tuple) else "encoder")
            for i, e in enumerate(encs)
        ]

        if rng is not None and axis_name is not None:  # distinct dropout on every device
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
        pparams = _distributed.to_varying(params, axis_name)
        plans = [
            _plan(x, size, i, axis_name, batch_axis)
            for i, (x, size) in enumerate(zip(inputs, sizes, strict=True))
        ]
        runs = [
            _chunk_encoder(e, plan, x, rng, i)
            for i, (e, plan, x) in enumerate(zip(encs, plans, inputs, strict=True))
        ]
        # Only the batch's last chunk stays live from pass 1, unless every input is a
        # single chunk: that is plain full-batch training, which re-encodes nothing.
        keep_all = all(plan.num_body == 0 for plan in plans)
        reps, kept_vjps = (), []
        for i, (run, plan) in enumerate(zip(runs, plans, strict=True)):
            keep = keep_all or i == n - 1
            cache, vjp = _forward(run, pparams, plan, inputs[i], keep, cache_dtype, reps)
            reps += (cache,)
            kept_vjps.append(vjp)

        def loss_of(p, reps):
            return _validation.scalar_loss(loss_fn(p, *reps, **loss_kwargs), has_aux)

        (loss, aux), (acc, rep_grads) = jax.value_and_grad(loss_of, (0, 1), has_aux=True)(
            pparams, reps
        )
        acc = jax.tree.map(lambda g: g.astype(_wide(g.dtype)), acc)
        if loss_scale is not None:  # scale cotangents so float16 backward passes don't underflow
            acc, rep_grads = jax.tree.map(lambda g: g * loss_scale, (acc, rep_grads))
        for i in reversed(range(n)):  # the kept chunk first, freeing its activations
            acc = _backward(runs[i], pparams, plans[i], rep_grads[i], kept_vjps[i], acc)
        if loss_scale is not None:
            acc = jax.tree.map(lambda g: g / loss_scale, acc)
        grads = _cast(_distributed.reduce_grads(acc, axis_name), params)
        loss = _distributed.replicated_loss(loss, axis_name)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return value_and_grad_fn
