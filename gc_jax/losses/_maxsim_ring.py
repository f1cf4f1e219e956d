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
import jax.numpy as jnp

from gc_jax import _distributed
from gc_jax._base import AxisName
from gc_jax.losses import _maxsim_tiles, _ring
from gc_jax.losses._maxsim_tiles import Side
from gc_jax.losses._strategies import Softmax

_shift = _ring.shift  # ppermute to the next device: a pytree (tokens, mask) travels whole


def _forward(block, axis_name, x: Side, y: Side, targets, scale):
    size = jax.lax.axis_size(axis_name)
    sweep = lambda y, targets, carry: _maxsim_tiles.sweep(block, x, y, targets, scale, carry)
    carry = _maxsim_tiles.init(x, y, dtype=scale.dtype)
    if size == 1:
        return Softmax.finish(sweep(y, targets, carry))
    elsewhere = jnp.full_like(targets, -1)  # no column of another device's block is a target

    def step(_, state):  # steps 1 .. size - 2: send the block on, then compute on it
        here, carry = state
        return _shift(here, axis_name), sweep(here, elsewhere, carry)

    arriving = _shift(y, axis_name)
    carry = sweep(y, targets, carry)  # step 0: this device's own documents
    here, carry = jax.lax.fori_loop(1, size - 1, step, (arriving, carry))
    return Softmax.finish(sweep(here, elsewhere, carry))  # the last block is not sent on


def _backward(block, axis_name, x: Side, y: Side, targets, scale, lse, g):
    size = jax.lax.axis_size(axis_name)
    acc = scale.dtype

    def visit(here, targets):
        dx, dy, dscale = _maxsim_tiles.backward(block, x, here, targets, scale, lse, g)
        return dx.astype(acc), dy.astype(acc), dscale

    def step(_, state, send=True):
        """Sends this block on and the previous block's accumulator, then computes."""
        here, behind, (dx, dscale) = state
        arriving = _shift(here, axis_name) if send else here
        behind = _shift(behind, axis_name)  # now this block's accumulator
        ddx, dy, ddscale = visit(here, jnp.full_like(targets, -1))
        return arriving, behind + dy, (dx + ddx, dscale + ddscale)

    arriving = _shift(y, axis_name) if size > 1 else y
    dx, dy, dscale = visit(y, targets)  # step 0: this device's own documents
    state = (arriving, dy, (dx, dscale))
    if size > 1:
        state = jax.lax.fori_loop(1, size - 1, step, state)
        state = step(size - 1, state, send=False)
    _, dy, (dx, dscale) = state
    dy = _shift(dy, axis_name) if size > 1 else dy  # home: the block's owner
    dx, dscale = (_ring.after(v, dy) for v in (dx, dscale))
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
