"""Ordering by data dependency: a value computed only once others are known.

The loss loops order work that the compiler would otherwise be free to reorder, for two
reasons. **Collectives:** XLA:CPU in jaxlib 0.10 expands ``optimization_barrier`` away
before scheduling, runs independent collectives concurrently and keys them all alike
(``op_id=1``): devices entering two of them in different orders wait for each other
until the process aborts, so the ring's ``ppermute`` s, and a ring's last ``ppermute``
before the scalars' ``psum``, are chained. **Buffers:** a sweep that writes a gradient
over its input's buffer must provably run after the sweep that reads that input.

Both go through a comparison, ``total > inf``, which is never true (NaN included) and
which the compiler cannot fold; unlike ``0 * total`` it stays finite when a dependency
holds an infinity (an empty softmax group's running maximum is ``-inf``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _total(deps: Any) -> jax.Array:
    return sum(jnp.sum(d).astype(jnp.float32) for d in jax.tree.leaves(deps))


def zero_after(*deps: Any) -> jax.Array:
    """The integer 0, computed from every leaf of ``deps``: what uses it runs after them."""
    return jnp.where(_total(deps) > jnp.inf, 1, 0)


def after(tree: Any, *deps: Any) -> Any:
    """``tree``'s leaves, each computed only once every leaf of ``deps`` is (values unchanged).

    Differentiated, the order holds backwards too: ``deps``' cotangents get a zero
    term from ``tree``'s (a select the compiler cannot fold), so the backward of what
    made ``deps`` waits for the backward of what uses ``tree``.
    """
    total = _total(deps)
    zero = jnp.where(total > jnp.inf, total, 0)
    return jax.tree.map(lambda v: v + zero.astype(v.dtype), tree)


def after_on_cpu(tree: Any, *deps: Any) -> Any:
    """:func:`after` on XLA:CPU, where concurrent collectives may deadlock; ``tree``
    unchanged elsewhere (the data dependency costs a copy of ``tree``, and the TPU and
    GPU runtimes order their collectives themselves)."""
    leaves, treedef = jax.tree.flatten(tree)
    ordered = jax.lax.platform_dependent(
        leaves, deps, cpu=lambda v, d: after(v, *d), default=lambda v, d: v
    )
    return jax.tree.unflatten(treedef, ordered)
