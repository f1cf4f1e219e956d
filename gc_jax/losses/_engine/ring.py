"""The ring across devices: the one schedule every ring loss runs.

:func:`around` (forward) and :func:`around_back` (backward) are the schedule;
``engine`` visits each block with a spec's families. Every score
(``scores``) travels: the dot product's blocks as arrays, MaxSim's as tokens and masks.

Nothing batch-sized is gathered.

Inside ``shard_map``/``pmap`` every device keeps its own rows of ``x`` and ``ys``. The
blocks of ``ys`` travel around the ring of the ``axis_name`` devices with
``lax.ppermute``: at step ``s`` device ``p`` holds device ``p - s``'s block, and before
it computes on that block it sends it on to ``p + 1`` (double buffering: the transfer
of the next block overlaps the computation on this one). Each step is one
:func:`blockwise.sweep` of this device's queries against the block it holds,
so the per-row statistics (the online log-sum-exp of the softmax losses) are updated
exactly as in the single-device blockwise loss, tile by tile.

*Custom VJP*: the backward runs on the ring too, ring-attention style. Each step
recomputes the tiles of this device's queries against the block it holds
(``blockwise.backward``): ``dx`` and the scalars' gradients stay here, and the
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

from collections.abc import Callable
from typing import Any

import jax

from gc_jax._base import AxisName
from gc_jax.losses._engine.order import after


def shift(v: Any, axis_name: AxisName) -> Any:
    """``v`` (an array) of device ``p - 1``, on every device ``p`` (a ring of ``axis_name``)."""
    size = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(v, axis_name, [(p, (p + 1) % size) for p in range(size)])


def send(tree: Any, axis_name: AxisName) -> Any:
    """``tree`` of device ``p - 1``, on every device ``p``: one ``ppermute`` per leaf,
    each after the one before (independent collectives may deadlock XLA:CPU, ``order``)."""
    leaves, treedef = jax.tree.flatten(tree)
    sent = []
    for leaf in leaves:
        sent.append(shift(after(leaf, sent[-1]) if sent else leaf, axis_name))
    return jax.tree.unflatten(treedef, sent)


def around(visit: Callable, here: Any, state: Any, axis_name: AxisName | None) -> Any:
    """The forward schedule: ``state = visit(block, state, own)`` for every device's block.

    Step 0 visits this device's own block (``own`` true: the one holding the targets);
    at every later step the block held is first sent on (double buffering), then
    visited. The last block is not sent on. ``axis_name`` None: one device, visited once.
    """
    if axis_name is None:
        return visit(here, state, True)
    size = jax.lax.axis_size(axis_name)
    if size == 1:
        return visit(here, state, True)
    arriving = send(here, axis_name)
    state = visit(here, state, True)

    def step(_, carry):
        here, state = carry
        return send(here, axis_name), visit(here, state, False)

    here, state = jax.lax.fori_loop(1, size - 1, step, (arriving, state))
    return visit(here, state, False)


def around_back(visit: Callable, here: Any, acc: Any, state: Any, axis_name: AxisName | None):
    """The backward schedule: ``(acc, state) = visit(block, acc, state, own)`` around the ring.

    ``acc`` is the gradient of the block visited: it travels one step behind its block
    and, after the full circle, one last ``ppermute`` brings it home, to the block's
    owner. ``acc`` and ``state`` may be None at step 0 (``visit`` then starts them).
    Returns ``(this device's block's gradient, state)``. ``axis_name`` None: one device,
    its block visited once (``acc`` stays here).
    """
    if axis_name is None:
        return visit(here, acc, state, True)
    size = jax.lax.axis_size(axis_name)
    arriving = send(here, axis_name) if size > 1 else here
    acc, state = visit(here, acc, state, True)
    if size == 1:
        return acc, state

    def step(_, carry, send_on=True):
        here, behind, state = carry
        arriving = send(here, axis_name) if send_on else here
        # The gradient of the block here. Not chained after the block's send: chained, the
        # TPU compiler keeps one more float32 accumulator per chip (docs/benchmarks/
        # losses.md, "Before and after the loss engine changes").
        behind = shift(behind, axis_name)
        behind, state = visit(here, behind, state, False)
        return arriving, behind, state

    carry = jax.lax.fori_loop(1, size - 1, step, (arriving, acc, state))
    _, acc, state = step(size - 1, carry, send_on=False)
    return shift(acc, axis_name), state
