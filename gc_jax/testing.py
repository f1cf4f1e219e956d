"""Checking that gradient caching is exact for *your* model.

Gradient caching is exact when every row's representation depends only on that row
(and the chunk's key). Models with cross-example state (BatchNorm in training mode,
in-batch statistics, attention across the rows of a packed line) are not: their
chunks see different batches. Run :func:`assert_matches_full_batch` once on a small batch to
find out before training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax

from gc_jax import _plan, _validation
from gc_jax._base import PyTree
from gc_jax._plan import ChunkSize


def _full_batch_reps(encode, params, x, chunk_size, rng, index):
    """Encodes the batch in one differentiable graph; with an rng, chunk by chunk with
    gc_jax's keys so dropout draws the same masks (without one, all rows at once)."""
    if rng is None:
        return encode(params, x, None)
    return _chunk_reps(encode, params, x, chunk_size, rng, index)


def _chunk_reps(encode, params, x, chunk_size, rng, index, trim=True):
    """The batch encoded in the chunks gc_jax cuts on one device (token chunks trimmed,
    unless not ``trim``), with their keys, differentiably (``Plan.reference``)."""
    name = f"inputs[{index}]"
    _, plan, key = _plan.make(x, chunk_size, rng=rng, index=index, name=name, one_device=True)
    return plan.reference(encode, params, x, key, trim)


def _check_trimming(encoders, chunk_size, params, inputs, rtol, atol) -> None:
    """Raises if an input's encoder gives other outputs for its token-budget chunks
    trimmed to their bucket than at the padded length (same rows, no key), or for its
    packed chunks than for the batch unpacked. Outputs
    with a token axis are compared up to the bucket's length, where the cache holds
    them (past it the cache is zero and the loss must mask those tokens)."""
    n = len(inputs)
    encs = _validation.per_input(encoders, n, "encoders", lambda e, _: e)
    sizes = _validation.per_input(chunk_size, n, "chunk_size", _plan.check)
    for i, (e, x, s) in enumerate(zip(encs, inputs, sizes, strict=True)):
        if not _plan.by_tokens(s):  # only token budgets and packings trim rows
            continue
        both = jax.jit(lambda p, x, e=e, s=s, i=i: [
            _chunk_reps(e, p, x, s, None, i, trim) for trim in (True, False)
        ])  # fmt: skip
        trimmed, padded = both(params, x)
        try:
            chex.assert_trees_all_close(trimmed, padded, rtol=rtol, atol=atol)
        except AssertionError as err:
            raise AssertionError(_plan.trimming_error(s, i, err)) from err


def full_batch_value_and_grad(
    loss_fn: Callable[..., Any],
    encoders: Callable | Sequence[Callable],
    chunk_size: ChunkSize | Sequence[ChunkSize],
    *,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """The plain ``jax.value_and_grad`` that ``cached_value_and_grad`` must equal.

    Same arguments and returned signature as ``gc_jax.cached_value_and_grad``
    (single device), but every representation stays in one autodiff graph, so it
    needs the whole batch's activations in memory. ``chunk_size`` is only used to
    hand each chunk the same dropout key as gc_jax does.

    Without ``rng``, every input is encoded whole, at its padded length: with a
    :class:`gc_jax.TokenBudget`, this also checks that trimming a chunk to its
    bucket's length does not change the encoder's outputs (with a
    :class:`gc_jax.TokenPacking`, that packing does not). With ``rng``, each row is
    encoded in the chunk, trimmed as gc_jax cuts it, with that chunk's key, so that
    dropout draws the same masks (every chunk the budget could cut is encoded: meant
    for small batches).

    Examples:
      >>> import jax.numpy as jnp, gc_jax
      >>> encode = lambda w, x, key: x @ w
      >>> loss = lambda w, q, d: gc_jax.losses.contrastive_loss(q, d)
      >>> ref = gc_jax.testing.full_batch_value_and_grad(loss, encode, 2)
      >>> value, grads = ref(jnp.eye(3), jnp.eye(3), jnp.eye(3))
      >>> grads.shape
      (3, 3)
    """

    def value_and_grad_fn(params, *inputs, rng=None, **loss_kwargs):
        n = len(inputs)
        encs = _validation.per_input(encoders, n, "encoders", lambda e, _: e)
        sizes = _validation.per_input(chunk_size, n, "chunk_size", _plan.check)

        def total(p):
            reps = [
                _full_batch_reps(e, p, x, s, rng, i)
                for i, (e, x, s) in enumerate(zip(encs, inputs, sizes, strict=True))
            ]
            return loss_fn(p, *reps, **loss_kwargs)

        return jax.value_and_grad(total, has_aux=has_aux)(params)

    return value_and_grad_fn


def assert_matches_full_batch(
    loss_fn: Callable[..., Any],
    encoders: Callable | Sequence[Callable],
    chunk_size: ChunkSize | Sequence[ChunkSize],
    params: PyTree,
    *inputs: PyTree,
    rng: jax.Array | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **loss_kwargs: Any,
) -> None:
    """Asserts that gradient caching gives the full-batch loss and gradients.

    Use it once on a small batch of real data with your real model: it fails for
    models whose rows interact (e.g. BatchNorm in training mode).

    Raises:
      AssertionError: naming the loss or parameter leaves that differ.

    Examples:
      >>> import jax, jax.numpy as jnp, gc_jax
      >>> encode = lambda w, x, key: jnp.tanh(x @ w)
      >>> batch_norm = lambda w, x, key: encode(w, x, key) - encode(w, x, key).mean(0)
      >>> loss = lambda w, q, d: gc_jax.losses.contrastive_loss(q, d)
      >>> x = jax.random.normal(jax.random.key(0), (8, 3))
      >>> gc_jax.testing.assert_matches_full_batch(loss, encode, 2, jnp.eye(3), x, x)
      >>> gc_jax.testing.assert_matches_full_batch(loss, batch_norm, 2, jnp.eye(3), x, x)
      Traceback (most recent call last):
      AssertionError: ...
    """
    from gc_jax._value_and_grad import cached_value_and_grad

    args = (loss_fn, encoders, chunk_size)
    _check_trimming(encoders, chunk_size, params, inputs, rtol, atol)
    cached = jax.jit(cached_value_and_grad(*args))(params, *inputs, rng=rng, **loss_kwargs)
    full = jax.jit(full_batch_value_and_grad(*args))(params, *inputs, rng=rng, **loss_kwargs)
    try:
        chex.assert_trees_all_close(cached, full, rtol=rtol, atol=atol)
    except AssertionError as e:
        raise AssertionError(
            f"gradient caching with chunk_size={chunk_size} differs from the full batch. "
            "Does the model mix rows of a batch (BatchNorm, in-batch statistics)? "
            f"Details: {e}"
        ) from e
