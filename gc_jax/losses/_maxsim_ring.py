"""MaxSim across devices on a ring: the documents' blocks (tokens and masks) travel.

The schedule is ``_ring``'s (see there), with ``_maxsim_tiles``' sweep and backward
on each block that reaches the device: at step ``s`` device ``p`` holds device
``p - s``'s documents (their tokens and their mask), sends them on, and updates its
queries' online log-sum-exp with them. The backward runs on the ring too: the
queries' gradient and the temperature's stay here, each block's document gradient
travels one step behind it and one last ``ppermute`` brings it home. Per device:
this device's queries, two blocks of documents and their gradients, whatever the
number of devices.
"""

from __future__ import annotations

import functools

import jax

from gc_jax import _distributed
from gc_jax._base import AxisName
from gc_jax.losses import _maxsim_tiles, _ring
from gc_jax.losses._maxsim_tiles import Side
from gc_jax.losses._order import after
from gc_jax.losses._strategies import Softmax


def _forward(block, axis_name, x: Side, y: Side, targets, scale):
    def visit(here, carry, own):  # another device's block holds no row's target
        return _maxsim_tiles.sweep(block, x, here, targets if own else None, scale, carry)

    carry = _maxsim_tiles.init(x, y, dtype=scale.dtype)
    return Softmax.finish(_ring.around(visit, y, carry, axis_name))


def _backward(block, axis_name, x: Side, y: Side, targets, scale, lse, g):
    acc = scale.dtype

    def visit(here, behind, grads, own):
        t = targets if own else None
        dx, dy, dscale = _maxsim_tiles.backward(block, x, here, t, scale, lse, g)
        dy, new = dy.astype(acc), (dx.astype(acc), dscale)
        if behind is None:  # step 0
            return dy, new
        return behind + dy, tuple(u + v for u, v in zip(grads, new, strict=True))

    # The documents' block travels as (tokens, mask); its gradient is the tokens' alone.
    dy, (dx, dscale) = _ring.around_back(visit, y, None, None, axis_name)
    dx, dscale = after((dx, dscale), dy)  # every ppermute before the psum
    return dx.astype(x.tokens.dtype), dy.astype(y.tokens.dtype), dscale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rowwise(block, axis_name, q, q_mask, d, d_mask, targets, scale):
    return _forward(block, axis_name, Side(q, q_mask), Side(d, d_mask), targets, scale)[0]


def _rowwise_fwd(block, axis_name, q, q_mask, d, d_mask, targets, scale):
    loss, lse = _forward(block, axis_name, Side(q, q_mask), Side(d, d_mask), targets, scale)
    return loss, (q, q_mask, d, d_mask, targets, scale, lse)


def _rowwise_bwd(block, axis_name, res, g):
    q, q_mask, d, d_mask, targets, scale, lse = res
    x, y = Side(q, q_mask), Side(d, d_mask)
    dq, dd, dscale = _backward(block, axis_name, x, y, targets, scale, lse, g)
    return dq, None, dd, None, None, dscale


_rowwise.defvjp(_rowwise_fwd, _rowwise_bwd)


def rows(x: Side, y: Side, targets, scale, block_size: int, axis_name: AxisName) -> jax.Array:
    """Per-row losses of this device's queries against every device's documents.

    Args:
      x: this device's queries (tokens ``[n, T, dim]``, bool mask ``[n, T]``).
      y: this device's documents (tokens ``[m, S, dim]``, bool mask ``[m, S]``), the
        same ``m`` on every device.
      targets: the index into *this device's* documents of each query's positive.
      scale: logit multiplier (scalar in the accumulation dtype, differentiable).
      block_size: rows per tile on either side, within a device.
      axis_name: the ``shard_map``/``pmap`` axis (or tuple of axes) of the ring.

    Returns:
      The per-query losses, ``[n]``.
    """
    scale, targets = _distributed.vary_like((scale, targets), x, y)
    return _rowwise(block_size, axis_name, x.tokens, x.mask, y.tokens, y.mask, targets, scale)
