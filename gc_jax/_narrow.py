"""Blocks of narrow floats (bfloat16, float16) moved on their bits on XLA:CPU.

XLA's CPU backend computes bfloat16 and float16 operations in float32, slicing and
dynamic updates included. Reading a block of a narrow batch-sized buffer in a loop
would widen the whole buffer once, outside the loop; writing a block into one
widens, updates and narrows the whole buffer, which then cannot be updated in place
(every write copies it). On the bits (unsigned integers of the same width) only the
block moves. Other platforms slice and update narrow floats natively and get the
plain operation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp

T = TypeVar("T")


def is_narrow(x: jax.Array) -> bool:
    """Whether ``x`` is a float narrower than float32."""
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4


def _bits(v: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(v, jnp.dtype(f"uint{8 * v.dtype.itemsize}"))


def on_cpu_as_bits(plain: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
    """``plain(*args)`` (a slice, or an update of ``args[0]``), on the bits on CPU.

    Every argument must be a narrow float of the same width; the result has the
    dtype of ``args[0]``.
    """

    def as_bits(*args):
        return jax.lax.bitcast_convert_type(plain(*map(_bits, args)), args[0].dtype)

    return jax.lax.platform_dependent(*args, cpu=as_bits, default=plain)


def update_in_place(update: Callable[[T], T], buf: T) -> T:
    """``update(buf)``, run by a loop of two identical turns (``update`` is idempotent).

    Outside a loop XLA:CPU does not write into a narrow-float buffer in place, even on
    the bits, so the update would copy the whole buffer; XLA inlines a loop of one
    turn, hence two. Used for the few writes that happen outside the chunk loops.
    """
    return jax.lax.fori_loop(0, 2, lambda _, b: update(b), buf)
