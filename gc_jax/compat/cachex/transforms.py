"""The functions of ``grad_cache.cachex``, on gc_jax's two passes.

Inputs are *pre-chunked* (:func:`~gc_jax.compat.cachex.tree_chunk`): every leaf has a
leading ``n_chunk`` axis. Internally the chunk axis is the *row* axis of
:mod:`gc_jax._passes`, cut into chunks of one: each "row" of the passes is one of
your chunks, given to your function with the chunk axis removed, and its output gets
it back. So every form here runs the one implementation of the algorithm:

* :func:`chunk_encode` is pass 1 (``_passes.forward``): representations only.
* :func:`cache_grad` is pass 2 (``_passes.backward``), accumulating into your
  ``grad_accumulator``.
* :func:`grad_cached` is :func:`gc_jax.chunked_encoder` with ``chunk_size=1``: a
  ``jax.custom_vjp`` whose backward is pass 2.

Pass 1 keeps no activations at all, and pass 2 re-encodes one chunk at a time, so
a gradient through any of these holds one chunk's activations at most.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from gc_jax import _chunked_encoder, _layout, _passes, _validation
from gc_jax._base import PyTree
from gc_jax.compat.cachex.tree_utils import merge_chunks, tree_unchunk

__all__ = [
    "cache_grad",
    "chunk_encode",
    "grad_cached",
    "grad_with_cache",
    "unchunk_args",
]

Array = jax.Array


def _chunk_of(tree: PyTree) -> PyTree:
    """The one chunk of a ``[1, rows, ...]`` slice, as the user's function sees it."""
    return jax.tree.map(lambda x: x[0], tree)


def _as_row(out: PyTree) -> PyTree:
    """A chunk's output as one "row" of the passes: a leading axis of 1."""
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), out)


def _num_chunks(tree: PyTree, name: str) -> int:
    """The shared leading (chunk) axis of every leaf of ``tree``."""
    hint = "; expected pre-chunked arrays of shape [n_chunk, rows, ...] (see cachex.tree_chunk)"
    return _validation.leading_size(tree, name, axis="chunk", hint=hint)


def _input(encode, xx: PyTree, name: str, params: PyTree = ()) -> _passes.Input:
    """The passes' view of pre-chunked inputs: one "row" per chunk, one row per pass chunk.

    Under ``jit`` over chunks sharded across devices, each device encodes its own
    chunks (``_passes.per_device``), as ``grad_cached`` does through ``chunked_encoder``.
    Over explicit mesh axes, an encoder that cannot (FSDP params, or arrays on the
    mesh closed over) gets one chunk at a time spread over the devices instead
    (``_layout.chunks_spread``).
    """
    _num_chunks(xx, "xx")
    xx = _layout.chunks_spread(xx, params, "xx")
    inp = _passes.make_input(encode, xx, 1, None, name=name, batch_name="xx")
    if inp.plan.layout.kind != "explicit":
        return _passes.per_device([inp], params)[0]
    try:
        return _passes.per_device([inp], params, "local")[0]
    except Exception:  # e.g. it closes over arrays on the mesh
        pass
    # Not on each device's chunks alone: one chunk at a time, spread over the devices.
    xx = _layout.chunks_spread(xx, params, "xx", spanning=True)
    return _passes.make_input(encode, xx, 1, None, name=name, batch_name="xx")


def grad_with_cache(f: Callable[..., PyTree], **grad_kwargs: Any) -> Callable[..., PyTree]:
    """The gradient of ``f``'s output contracted with a cached representation gradient.

    Args:
      f: ``f(params, *args, **kwargs) -> reps`` (an array or a pytree of arrays).
      **grad_kwargs: passed to ``jax.grad`` (``argnums``, ``allow_int``, ...).

    Returns:
      ``g(params, cache, *args, **kwargs)``: ``jax.grad`` of
      ``sum(f(params, *args, **kwargs) * cache)`` (summed over every leaf), i.e. the
      vector-Jacobian product of ``f`` with ``cache``, with respect to ``params``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.compat.cachex import grad_with_cache
      >>> f = lambda w, x: x @ w
      >>> x, cache = jnp.ones((2, 3)), jnp.ones((2, 1))
      >>> grad_with_cache(f)(jnp.zeros((3, 1)), cache, x).ravel().tolist()
      [2.0, 2.0, 2.0]
    """
    _validation.callable_arg(f, "f")

    def cache_f(params, cache, *args, **kwargs):
        out = f(params, *args, **kwargs)
        if jax.tree.structure(out) != jax.tree.structure(cache):
            raise ValueError(
                f"cache has structure {jax.tree.structure(cache)} but f returned "
                f"{jax.tree.structure(out)}; pass the gradient of f's output."
            )
        sums = jax.tree.map(lambda o, c: jnp.sum(o * c), out, cache)
        return sum(jax.tree.leaves(sums))

    return jax.grad(cache_f, **grad_kwargs)


def chunk_encode(encode_fn: Callable[..., PyTree]) -> Callable[..., PyTree]:
    """Encodes pre-chunked keyword inputs chunk by chunk, keeping only the outputs.

    Pass 1 of gradient caching (``gc_jax._passes.forward``): nothing is saved for a
    backward pass.

    Args:
      encode_fn: ``encode_fn(**chunk) -> reps`` for one chunk (the parameters usually
        bound with ``functools.partial``); ``reps`` is an array or a pytree of arrays.

    Returns:
      ``f(**xx)``: every keyword input has a leading ``n_chunk`` axis; returns
      ``encode_fn`` of each chunk, stacked: leaves of shape ``[n_chunk, ...]``.

    Examples:
      >>> import functools, jax.numpy as jnp
      >>> from gc_jax.compat import cachex
      >>> encode = lambda w, x: jnp.tanh(x @ w)
      >>> x = cachex.tree_chunk(jnp.ones((6, 3)), 3)
      >>> cachex.chunk_encode(functools.partial(encode, jnp.ones((3, 2))))(x=x).shape
      (3, 2, 2)
    """
    _validation.callable_arg(encode_fn, "encode_fn")

    def encode(params, chunk, key):
        return _as_row(encode_fn(**_chunk_of(chunk)))

    def f(**xx):
        return _passes.forward(_input(encode, xx, "encode_fn"), ())[0]

    return f


def cache_grad(encode_fn: Callable[..., PyTree]) -> Callable[..., PyTree]:
    """Accumulates the parameter gradient of every chunk, from the cached representation gradient.

    Pass 2 of gradient caching (``gc_jax._passes.backward``): each chunk is encoded
    again under ``jax.vjp`` and its slice of ``cached_grad`` pulled back to the
    parameters, one chunk's activations at a time.

    Args:
      encode_fn: ``encode_fn(params=params, **chunk) -> reps`` (``params`` is a
        keyword).

    Returns:
      ``f(params, grad_accumulator, cached_grad, **xx) -> grads``: ``xx`` are the
      pre-chunked inputs of :func:`chunk_encode`, ``cached_grad`` the gradient of the
      loss with respect to its ``[n_chunk, ...]`` output, and ``grad_accumulator`` a
      pytree like ``params`` (e.g. zeros) that every chunk's gradient is added to
      (in its dtype).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gc_jax.compat import cachex
      >>> encode = lambda params, x: x @ params
      >>> w, x = jnp.ones((3, 1)), cachex.tree_chunk(jnp.ones((4, 3)), 2)
      >>> g = cachex.cache_grad(encode)(w, jnp.zeros_like(w), jnp.ones((2, 2, 1)), x=x)
      >>> g.ravel().tolist()
      [4.0, 4.0, 4.0]
    """
    _validation.callable_arg(encode_fn, "encode_fn")

    def encode(params, chunk, key):
        return _as_row(encode_fn(params=params, **_chunk_of(chunk)))

    def f(params, grad_accumulator, cached_grad, **xx):
        inp = _input(encode, xx, "encode_fn", params)
        shapes = _passes.output_shapes(inp, params)
        n_chunk = inp.plan.batch_size
        if jax.tree.structure(cached_grad) != jax.tree.structure(shapes):
            raise ValueError(
                f"cached_grad has structure {jax.tree.structure(cached_grad)}, but encode_fn "
                f"returns {jax.tree.structure(shapes)}; pass the gradient of the loss with "
                "respect to chunk_encode's output."
            )
        for (path, g), r in zip(
            jax.tree_util.tree_flatten_with_path(cached_grad)[0],
            jax.tree.leaves(shapes),
            strict=True,
        ):
            want = (n_chunk, *r.shape[1:])
            if tuple(getattr(g, "shape", ())) != want:
                raise ValueError(
                    f"cached_grad{jax.tree_util.keystr(path)} has shape "
                    f"{tuple(getattr(g, 'shape', ()))}, but encode_fn's output over "
                    f"{n_chunk} chunks has shape {want}."
                )
        if jax.tree.structure(grad_accumulator) != jax.tree.structure(params):
            raise ValueError(
                f"grad_accumulator has structure {jax.tree.structure(grad_accumulator)} "
                f"but params has {jax.tree.structure(params)}; start from e.g. "
                "jax.tree.map(jnp.zeros_like, params)."
            )
        return _passes.backward([inp], params, [cached_grad], grad_accumulator)[0]

    return f


def unchunk_args(axis: int = 0, argnums: int | Iterable[int] = ()) -> Callable:
    """Decorator: un-chunks the positional arguments ``argnums`` before the call.

    Lets a loss written for ``[B, d]`` representations take the ``[n_chunk, rows, d]``
    output of :func:`chunk_encode`; differentiating the decorated loss gives
    gradients in the chunked layout, as :func:`cache_grad` wants them.

    Args:
      axis: the chunk axis (see :func:`~gc_jax.compat.cachex.tree_unchunk`).
      argnums: an int or ints: indices of the positional arguments to un-chunk.

    Returns:
      A decorator.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.compat import cachex
      >>> @cachex.unchunk_args(argnums=(0, 1))
      ... def scores(q, d):
      ...     return q @ d.T
      >>> scores(jnp.ones((2, 3, 4)), jnp.ones((3, 2, 4))).shape
      (6, 6)
    """
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {axis!r} ({type(axis).__name__}).")
    nums = (argnums,) if isinstance(argnums, int) else argnums
    try:
        nums = tuple(nums)
    except TypeError:
        raise TypeError(f"argnums must be an int or a sequence of ints, got {argnums!r}.") from None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise TypeError(f"argnums must be an int or a sequence of ints, got {argnums!r}.")

    def decorator_unchunk(f):
        _validation.callable_arg(f, "f")

        @functools.wraps(f)
        def g(*args, **kwargs):
            new_args = list(args)
            for i in nums:
                if not -len(args) <= i < len(args):
                    raise ValueError(
                        f"unchunk_args(argnums={argnums!r}) names positional argument {i}, "
                        f"but {getattr(f, '__name__', 'the function')} was called with "
                        f"{len(args)} positional arguments."
                    )
                new_args[i] = tree_unchunk(args[i], axis)
            return f(*new_args, **kwargs)

        return g

    return decorator_unchunk


def _check_rows(out: PyTree, chunk: PyTree) -> None:
    """Checks that ``f`` returned one row per row of its chunk (``[shards, rows, ...]`` here).

    A batch that was not cut with ``tree_chunk`` hands ``f`` one row per "chunk",
    whose outputs then have no row axis or the wrong number of rows.
    """
    rows = sorted({x.shape[1] for x in jax.tree.leaves(chunk) if x.ndim >= 2})
    fix = (
        "grad_cached's batch must be pre-chunked, every leaf [n_chunk, rows, ...]: write "
        "cached_f(params, cachex.tree_chunk(batch, n_chunk)), and f must return one "
        "representation row per row of its chunk."
    )
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        where = jax.tree_util.keystr(path) or "an output"
        shape = tuple(getattr(leaf, "shape", ()))
        if len(shape) < 2:
            raise ValueError(f"f returned {where} of shape {shape[1:]} for a chunk. {fix}")
        if shape[1] not in rows:
            raise ValueError(
                f"f returned {where} with {shape[1]} rows for a chunk whose leaves have "
                f"{rows or 'no'} rows. {fix}"
            )


def grad_cached(
    f: Callable[..., Array],
    policy: Callable[..., bool] | None = jax.checkpoint_policies.nothing_saveable,
    prevent_cse: bool = True,
) -> Callable[..., PyTree]:
    """The one-decorator gradient cache: wraps ``f`` so any gradient through it is cached.

    ``cached_f(params, batch)`` encodes the pre-chunked ``batch`` one chunk at a time,
    keeping only the representations, and returns them flattened to ``[B, ...]``.
    It is :func:`gc_jax.chunked_encoder` with ``chunk_size=1`` over the chunk axis,
    a ``jax.custom_vjp``: differentiating any program that uses it (``jax.grad``,
    ``jax.value_and_grad`` in your optax step) re-encodes each chunk under
    ``jax.vjp`` against its slice of the representations' gradient and accumulates
    the parameter gradients, one chunk's activations at a time.

    Per-chunk dropout keys go in the batch like any other input: a leaf of typed keys
    of shape ``[n_chunk]`` (``jax.random.split(key, n_chunk)``) or of raw keys
    ``[n_chunk, 2]``; each chunk gets its own key in both passes, and keys (like
    every integer input) get no gradient. Floating-point batch leaves are
    differentiable.

    Args:
      f: ``f(params, sub_batch) -> reps``: ``sub_batch`` is one chunk of ``batch``
        (the chunk axis removed); ``reps`` an array (or pytree of arrays) with one row
        per row of the chunk.
      policy: None or ``jax.checkpoint_policies.nothing_saveable`` (the default,
        and what real callers pass): plain gradient caching. Any other
        ``jax.checkpoint`` policy is applied to each chunk's re-encoding in the
        backward pass (``chunked_encoder(policy=...)``), keeping even less than one
        chunk's activations. Unlike the original, no policy ever keeps values across
        chunks: with ``dots_saveable`` the original saved every chunk's dots in the
        forward; here memory never exceeds one chunk's activations, at the price of
        recomputing the rest of the chunk once more.
      prevent_cse: accepted for compatibility; it has no effect. The passes keep the
        backward's re-encoding apart from the forward (loops and optimization
        barriers), and a ``policy``'s ``jax.checkpoint`` uses its default.

    Returns:
      ``cached_f(params, batch) -> reps``: ``batch`` a pytree of arrays with a
      leading ``n_chunk`` axis (:func:`~gc_jax.compat.cachex.tree_chunk`), ``reps`` of shape
      ``[n_chunk * rows, ...]``, in the order of the un-chunked batch.

    Examples:
      The gradient of a loss equals the uncached one:

      >>> import jax, jax.numpy as jnp
      >>> from gc_jax.compat import cachex
      >>> fwd = lambda w, batch: jnp.tanh(batch["x"] @ w)
      >>> loss = lambda h: -jnp.mean(jnp.sum(h[:4] * h[4:], -1))
      >>> w, x = jnp.eye(3) / 2, jnp.arange(24.0).reshape(8, 3) / 24
      >>> cached_fwd = cachex.grad_cached(fwd, None)
      >>> g = jax.jit(jax.grad(lambda w: loss(cached_fwd(w, cachex.tree_chunk({"x": x}, 4)))))(w)
      >>> bool(jnp.allclose(g, jax.grad(lambda w: loss(fwd(w, {"x": x})))(w), atol=1e-6))
      True
    """
    _validation.callable_arg(f, "f")
    if policy is not None:
        _validation.callable_arg(policy, "policy")
    if not isinstance(prevent_cse, bool | jnp.bool_):
        raise TypeError(
            f"prevent_cse must be a bool, got {prevent_cse!r} ({type(prevent_cse).__name__})."
        )
    nothing = jax.checkpoint_policies.nothing_saveable
    chunk_policy = None if policy is None or policy is nothing else policy

    def encode(params, chunk, key):
        # ``chunk`` holds one chunk, or one per device when the chunk axis is sharded
        # (explicit mesh axes): each is encoded as ``f`` sees it, side by side.
        out = jax.vmap(lambda c: f(params, c))(chunk)
        _check_rows(out, chunk)
        return out

    encode_batch = _chunked_encoder.chunked_encoder(encode, 1, policy=chunk_policy)

    @functools.wraps(f)
    def cached_f(params, batch):
        _num_chunks(batch, "batch")
        reps = encode_batch(params, _layout.chunks_spread(batch, params, "batch"))
        return jax.tree.map(lambda r: merge_chunks(r, 0), reps)

    return cached_f
