"""Row-wise blockwise losses across devices on a ring: nothing batch-sized is gathered.

Inside ``shard_map``/``pmap`` every device keeps its own rows of ``x`` and ``ys``. The
blocks of ``ys`` travel around the ring of the ``axis_name`` devices with
``lax.ppermute``: at step ``s`` device ``p`` holds device ``p - s``'s block, and before
it computes on that block it sends it on to ``p + 1`` (double buffering: the transfer
of the next block overlaps the computation on this one). Each step is one
:func:`_blockwise.sweep` of this device's queries against the block it holds,
so the per-row statistics (the online log-sum-exp of the softmax losses) are updated
exactly as in the single-device blockwise loss, tile by tile.

*Custom VJP*: the backward runs on the ring too, ring-attention style. Each step
recomputes the tiles of this device's queries against the block it holds
(``_blockwise.backward``): ``dx`` and the scalars' gradients stay here, and the
block's ``dys`` is added to an accumulator that travels with the block, one step
behind it (the accumulator of the block held at step ``s - 1`` is sent at the start of
step ``s``, so that transfer also overlaps a step's computation). After the full circle
each block's accumulator is one device short of home, and one last ``ppermute`` brings
it there: ``dys`` holds every device's contribution to this device's rows, which is
what the all-gather form's reduce-scatter gives.

Per device the forward holds ``x``, two blocks of ``ys`` (the one computed on and the
one arriving) and the per-row statistics; the backward adds ``dx`` and two ``dys``
accumulators in the accumulation dtype (at least float32, so that ``P`` devices'
contributions are summed without bfloat16 rounding). None of it grows with the number
of devices. Communication per step: one block of ``ys`` forward; one block and one
accumulator backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses import _blockwise, _tiles
from gc_jax.losses._strategies import Strategy

Scalar = jax.Array


def shift(v: jax.Array, axis_name: AxisName) -> jax.Array:
    """``v`` of device ``p - 1``, on every device ``p`` (a ring of ``axis_name``)."""
    size = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(v, axis_name, [(p, (p + 1) % size) for p in range(size)])


def after(v: jax.Array, *deps: jax.Array) -> jax.Array:
    """``v``, computed only once ``deps`` are: ``v + 0 * sum(deps)``.

    Orders collectives that would otherwise be independent: the ring's last
    ``ppermute`` before the scalars' gradient ``psum``, one ring of the clip loss
    before the other. XLA:CPU in jaxlib 0.10 expands ``optimization_barrier`` away
    before scheduling, runs independent collectives concurrently and keys them all
    alike (``op_id=1``): devices entering two of them in different orders wait for
    each other until the process aborts. ``x * 0`` is kept for floats (NaN and
    infinity), so the dependency survives; it adds zero to finite values.
    """
    zero = sum(jnp.sum(d).astype(v.dtype) for d in deps) * jnp.zeros((), v.dtype)
    return v + zero


def _elsewhere(targets: jax.Array) -> jax.Array:
    """Targets for a block from another device: no column is any row's target."""
    return jnp.full_like(targets, -1)


def _forward(kind, block, axis_name, x, ys, targets, scale, bias):
    """Per-row losses and statistics of this device's ``x`` against every device's ``ys``."""
    size = jax.lax.axis_size(axis_name)
    sweep = lambda ys, targets, carry: _blockwise.sweep(
        kind, block, x, ys, targets, scale, bias, carry
    )
    carry = _blockwise.init(kind, x, ys, dtype=scale.dtype)
    if size == 1:
        return kind.finish(sweep(ys, targets, carry))
    elsewhere = _elsewhere(targets)

    def step(_, state):  # steps 1 .. size - 2: send the block on, then compute on it
        here, carry = state
        arriving = shift(here, axis_name)
        return arriving, sweep(here, elsewhere, carry)

    arriving = shift(ys, axis_name)
    carry = sweep(ys, targets, carry)  # step 0: this device's own block, with the targets
    here, carry = jax.lax.fori_loop(1, size - 1, step, (arriving, carry))
    return kind.finish(sweep(here, elsewhere, carry))  # the last block is not sent on


def _backward(kind, block, axis_name, x, ys, targets, scale, bias, stat, g):
    """Cotangents of ``x, ys, scale, bias``; ``dys`` comes home after the full circle."""
    size = jax.lax.axis_size(axis_name)
    acc = scale.dtype

    def visit(here, targets):
        dx, dys, dscale, dbias = _blockwise.backward(
            kind, block, x, here, targets, scale, bias, stat, g
        )
        return dx.astype(acc), dys.astype(acc), dscale, dbias

    def add(a, b):
        return tuple(u + v for u, v in zip(a, b, strict=True))

    def step(_, state, send=True):
        """Sends this block on and the previous block's accumulator, then computes."""
        here, behind, grads = state
        arriving = shift(here, axis_name) if send else here
        behind = shift(behind, axis_name)  # now this block's accumulator
        dx, dys, dscale, dbias = visit(here, _elsewhere(targets))
        return arriving, behind + dys, add(grads, (dx, dscale, dbias))

    arriving = shift(ys, axis_name) if size > 1 else ys
    dx, dys, dscale, dbias = visit(ys, targets)  # step 0: this device's own block
    state = (arriving, dys, (dx, dscale, dbias))
    if size > 1:
        state = jax.lax.fori_loop(1, size - 1, step, state)
        state = step(size - 1, state, send=False)
    _, dys, (dx, dscale, dbias) = state
    dys = shift(dys, axis_name) if size > 1 else dys  # home: the block's owner
    dx, dscale, dbias = (after(v, dys) for v in (dx, dscale, dbias))
    return dx.astype(x.dtype), dys.astype(ys.dtype), dscale, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _rowwise(kind, block, axis_name, x, ys, targets, scale, bias):
    return _forward(kind, block, axis_name, x, ys, targets, scale, bias)[0]


def _rowwise_fwd(kind, block, axis_name, x, ys, targets, scale, bias):
    loss, stat = _forward(kind, block, axis_name, x, ys, targets, scale, bias)
    return loss, (x, ys, targets, scale, bias, stat)


def _rowwise_bwd(kind, block, axis_name, res, g):
    x, ys, targets, scale, bias, stat = res
    grads = _backward(kind, block, axis_name, x, ys, targets, scale, bias, stat, g)
    dx, dys, dscale, dbias = grads
    return dx, dys, None, dscale, dbias


_rowwise.defvjp(_rowwise_fwd, _rowwise_bwd)


def rows(
    kind: Strategy,
    x: jax.Array,
    ys: jax.Array,
    targets: jax.Array,
    scale: float | jax.Array,
    bias: float | jax.Array,
    block_size: int,
    axis_name: AxisName,
) -> jax.Array:
    """Per-row losses of this device's ``x`` against the ``ys`` of every device on the ring.

    Args:
      kind: the row-wise loss (``_strategies.Softmax`` or ``_strategies.Sigmoid``).
      x: this device's queries, ``[n, d]``.
      ys: this device's candidates, ``[m, d]`` (the same ``m`` on every device).
      targets: the index into *this device's* ``ys`` of each query's positive.
      scale: logit multiplier (scalar, differentiable).
      bias: added to every logit (scalar, differentiable).
      block_size: rows per tile on either side, within a device.
      axis_name: the ``shard_map``/``pmap`` axis (or tuple of axes) of the ring.

    Returns:
      The per-query losses, ``[n]``. Differentiates like this device's rows' losses
      (``ys``'s gradient sums every device's contribution, as an all-gather's would).
    """
    acc = _blockwise.accumulation_dtype(x, ys, scale, bias)
    scalars = (jnp.asarray(scale, acc), jnp.asarray(bias, acc))
    scale, bias, targets = _tiles.varying_like((*scalars, targets), x, ys)
    return _rowwise(kind, block_size, axis_name, x, ys, targets, scale, bias)
