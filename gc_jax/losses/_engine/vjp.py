"""The one custom VJP of the tiled losses: :func:`rowwise`.

Every blockwise and ring form of every loss runs through it. An *engine* (static,
hashable: the loss's strategy, score, families, tile size and ring axis) computes the
per-row losses and what the backward needs of them (``forward``: one statistic per
row, e.g. each row's log-sum-exp), and the inputs' cotangents from that statistic
(``backward``, which recomputes every tile). The forward saves the inputs and the
statistic only: nothing per tile, nothing ``rows x rows``.

The one engine is ``engine.Engine`` (a :class:`Differentiable`): a ``families.Spec``
(one family of logits or several, e.g. GTE's directions, a guide, a bank; its strategy
and its score) on one device, over the gathered columns, or on a ring of devices.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import jax


class Differentiable(Protocol):
    """How a tiled loss computes its per-row losses and differentiates them (static)."""

    def forward(self, inputs: Any) -> tuple[jax.Array, Any]:
        """``(per-row losses, statistic)`` of ``inputs`` (a pytree of arrays)."""

    def backward(self, inputs: Any, stat: Any, g: jax.Array) -> Any:
        """The cotangent of ``inputs`` (its structure; None where there is none) for
        the per-row cotangents ``g``."""


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def rowwise(engine: Differentiable, inputs: Any) -> jax.Array:
    """The per-row losses ``engine.forward(inputs)[0]``, differentiated by ``engine``.

    Args:
      engine: a static, hashable :class:`Differentiable`.
      inputs: its inputs, a pytree of arrays (integer ones get no cotangent).

    Returns:
      The per-row losses.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from typing import NamedTuple
      >>> class Squares(NamedTuple):  # sum of squares per row, its gradient by hand
      ...     def forward(self, x):
      ...         return jnp.sum(x * x, axis=1), None
      ...     def backward(self, x, stat, g):
      ...         return 2 * x * g[:, None]
      >>> x = jnp.arange(6.0).reshape(2, 3)
      >>> jax.grad(lambda x: rowwise(Squares(), x).sum())(x).tolist()
      [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
    """
    return engine.forward(inputs)[0]


def _forward(engine: Differentiable, inputs: Any) -> tuple[jax.Array, tuple]:
    loss, stat = engine.forward(inputs)
    return loss, (inputs, stat)


def _backward(engine: Differentiable, res: tuple, g: jax.Array) -> tuple:
    inputs, stat = res
    return (engine.backward(inputs, stat, g),)


rowwise.defvjp(_forward, _backward)
