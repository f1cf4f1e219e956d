"""Full-batch references that gc_jax's cached gradients are tested against."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def chunked_reps(encode, params, x, chunk_size: int, rng, index: int):
    """Encodes ``x`` chunk by chunk with gc_jax's key rule, in one differentiable graph.

    Without an rng the chunking does not matter and the batch is encoded at once.
    """
    if rng is None:
        return encode(params, x, None)
    batch = jax.tree.leaves(x)[0].shape[0]
    parts = []
    for c, start in enumerate(range(0, batch, chunk_size)):
        chunk = jax.tree.map(lambda v, s=start: v[s : s + chunk_size], x)
        key = jax.random.fold_in(jax.random.fold_in(rng, index), c)
        parts.append(encode(params, chunk, key))
    return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)


def full_batch_value_and_grad(
    loss_fn: Callable[..., Any],
    encoders: Callable | Sequence[Callable],
    chunk_size: int | Sequence[int],
    params: Any,
    *inputs: Any,
    rng: jax.Array | None = None,
    has_aux: bool = False,
    **loss_kwargs: Any,
):
    """Plain ``jax.value_and_grad`` of the loss over the whole batch."""
    n = len(inputs)
    encs = encoders if isinstance(encoders, Sequence) else [encoders] * n
    sizes = chunk_size if isinstance(chunk_size, Sequence) else [chunk_size] * n

    def total(p):
        reps = [
            chunked_reps(e, p, x, s, rng, i)
            for i, (e, x, s) in enumerate(zip(encs, inputs, sizes, strict=True))
        ]
        return loss_fn(p, *reps, **loss_kwargs)

    return jax.jit(jax.value_and_grad(total, has_aux=has_aux))(params)
