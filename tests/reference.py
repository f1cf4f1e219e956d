"""The full-batch reference gc_jax's cached gradients are tested against."""

from __future__ import annotations

from typing import Any

import jax

from gc_jax.testing import full_batch_value_and_grad as _reference


def full_batch_value_and_grad(
    loss_fn, encoders, chunk_size, params, *inputs, rng=None, has_aux=False, **loss_kwargs
) -> Any:
    """Plain ``jax.value_and_grad`` of the loss over the whole batch, jitted."""
    fn = _reference(loss_fn, encoders, chunk_size, has_aux=has_aux)
    return jax.jit(fn)(params, *inputs, rng=rng, **loss_kwargs)
