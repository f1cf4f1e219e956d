"""The fastest chunk size and ``keep=`` whose compiled step fits a memory budget.

:func:`plan_step` compiles candidate steps ahead of time, as
:func:`gc_jax.largest_chunk_size` does (``gc_jax._chunk_size``), for each chunk size
the most chunks pass 1 can keep (``keep=``), and picks the fastest plan that fits: by
measured step time where the step can run here, by the compiler's FLOPs where it
cannot (a TPU topology's compile-only devices).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from gc_jax import _validation
from gc_jax._base import PyTree
from gc_jax._chunk_size import (
    _budget,
    _budget_device,
    _candidates,
    _out_of_memory,
    _place,
    _target,
    compiled_bytes,
    device_budget,
)
from gc_jax._chunks import plan as _plan


class StepPlan(NamedTuple):
    """The plan :func:`plan_step` chose, and what it measured.

    Attributes:
      chunk_size: the chunk size.
      keep: the chunks pass 1 keeps (``keep=`` of ``cached_value_and_grad``).
      policy: the remat policy (None where none was asked for).
      bytes: its compiled bytes per device.
      seconds: its median measured step time, or None (not run: ``by="flops"``).
      flops: the step's FLOPs from the compiler's cost analysis, or None (counted
        with ``by="flops"`` only, where the step with every chunk kept compiles; else
        plans are ranked by the share of chunks they re-encode).
      reencoded: of those, the FLOPs of the forwards pass 2 re-encodes (None as
        ``flops``).
      chunks: the chunks of the batch at ``chunk_size`` (``keep`` of them kept).
      tried: every candidate compiled, ``(chunk_size, keep, policy, bytes or None,
        seconds or None)``; bytes None: out of the compiler's memory.
    """

    chunk_size: Any
    keep: int
    policy: Any
    bytes: int
    seconds: float | None
    flops: float | None
    reencoded: float | None
    chunks: int
    tried: tuple = ()


class _Compiled(NamedTuple):
    bytes: int | None
    flops: float | None
    compiled: Any


def _compile(step, args, kwargs, mesh) -> _Compiled:
    """``step`` compiled: its bytes and FLOPs (bytes None: out of the compiler's memory)."""
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    try:
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            compiled = jitted.lower(*args, **kwargs).compile()
    except jax.errors.JaxRuntimeError as e:
        if _out_of_memory(e):
            return _Compiled(None, None, None)
        raise
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    flops = float(cost["flops"]) if cost and "flops" in cost else None
    return _Compiled(compiled_bytes(compiled), flops, compiled)


def _chunks(compile_at: Callable[[int], Any]) -> int:
    """How many chunks ``keep=`` can name: the step says, traced with more
    (``gc_jax._chunks.plan.TooManyKept``)."""
    try:
        compile_at(2**31 - 1)
    except _plan.TooManyKept as e:
        return e.chunks
    raise ValueError(
        "plan_step: make_step(chunk_size, keep) accepted keep=2**31 - 1; pass keep= on to "
        "gc_jax.cached_value_and_grad, make_train_step or chunked_encoder."
    )


def _made(make_step, chunk_size, keep, policy):
    return (
        make_step(chunk_size, keep) if policy is _NO_POLICY else make_step(chunk_size, keep, policy)
    )


_NO_POLICY = object()


def _most_kept(measure, chunks: int, budget: float) -> tuple[int | None, dict]:
    """The largest ``keep`` in ``0..chunks`` that fits (compiled bytes grow with it):
    ``(keep or None, {keep: _Compiled})``. Doubling from 1, then bisection: about
    ``2 log2(keep)`` compiles, none with many more kept chunks (unrolled) than fit."""
    seen: dict[int, _Compiled] = {}

    def fits(keep: int) -> bool:
        seen[keep] = measure(keep)
        return seen[keep].bytes is not None and seen[keep].bytes <= budget

    if not fits(0):
        return None, seen
    lo, hi = 0, 1  # lo fits; hi is the next to try
    while hi <= chunks and fits(hi):
        lo, hi = hi, 2 * hi
    if lo == chunks:
        return lo, seen
    hi = min(hi, chunks + 1)  # hi does not fit (or is past every chunk)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, seen


def _times(compiled: list, args, kwargs, reps: int) -> list[float]:
    """Median seconds of each compiled step over ``reps`` interleaved rounds (one untimed
    call each first); arguments given as shapes are zeros."""

    def concrete(x):
        if isinstance(x, jax.Array):
            return x
        return jax.device_put(jnp.zeros(x.shape, x.dtype), x.sharding)

    args, kwargs = jax.tree.map(concrete, (args, kwargs))
    for c in compiled:
        jax.block_until_ready(c(*args, **kwargs))
    times = [[] for _ in compiled]
    for r in range(reps):
        order = range(len(compiled)) if r % 2 == 0 else reversed(range(len(compiled)))
        for i in order:
            tick = time.perf_counter()
            jax.block_until_ready(compiled[i](*args, **kwargs))
            times[i].append(time.perf_counter() - tick)
    return [float(np.median(t)) for t in times]


def _runs_here(target: jax.Device | Mesh | None, args: PyTree) -> bool:
    """Whether the step's devices are this process's own (not compile-only)."""
    chip = _budget_device(target, args)
    try:
        return chip in jax.local_devices(backend=chip.platform)
    except RuntimeError:  # no such backend here: a topology's compile-only devices
        return False


def _timing_args(tried: list, placed: tuple, given: tuple) -> tuple:
    """What the plans are timed on: zeros of the placed shapes for chunks of rows (their
    cost does not depend on the values); the batch itself, placed, for token plans."""
    if not _plan.by_tokens(tried[0]):
        return placed
    return jax.tree.map(lambda a, x: jax.device_put(x, a.sharding), placed, given)


def _check_token_timing(tried: list, by: str, args: tuple, kwargs: dict) -> None:
    """Token plans' chunks follow the batch's lengths: timed on zeros (arguments given as
    shapes) every row would be empty, and the timing would say nothing."""
    leaves = jax.tree.leaves((args, kwargs))
    if (
        by == "time"
        and _plan.by_tokens(tried[0])
        and any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    ):
        raise ValueError(
            'plan_step: timing token plans (by="time") needs the real batch, since their '
            "chunks follow its lengths; pass arrays as args (not jax.ShapeDtypeStruct), or "
            'by="flops" to rank the plans by the chunks they re-encode.'
        )


def _check_by(by: Any, reps: Any) -> None:
    if by not in ("auto", "time", "flops"):
        raise ValueError(f'by must be "auto", "time" or "flops"; got {by!r}.')
    _validation.positive_int(reps, "reps")


def plan_step(
    make_step: Callable[..., Callable[..., Any]],
    args: Sequence[PyTree],
    candidates: int | Iterable[Any],
    *,
    kwargs: dict[str, Any] | None = None,
    budget_bytes: float | str | None = None,
    device: jax.Device | Mesh | Sequence[jax.Device] | None = None,
    policies: Sequence[Any] | None = None,
    by: str = "auto",
    reps: int = 5,
) -> StepPlan:
    """The fastest (chunk size, ``keep``) whose compiled step fits in memory.

    For each candidate chunk size (and remat policy, if ``policies``), the step is
    compiled ahead of time as :func:`gc_jax.largest_chunk_size` does, and the most chunks
    pass 1 can keep (``keep=``: one forward fewer each, their activations held until
    pass 2) is found by bisection over the compiled bytes, from ``keep=0`` (every
    chunk re-encoded, the least memory) to every chunk. Of the plans that fit, the
    fastest is returned: by measured step time where the devices are this process's
    (``by="time"``, interleaved rounds, the default's ``keep=1`` at the largest chunk
    size timed beside them; chunks of rows run on zeros of the arguments' shapes, token
    plans on the batch given, whose lengths decide their chunks), by the
    compiler's FLOPs (``cost_analysis()``) where they are not, e.g. a TPU topology's
    compile-only devices (``by="flops"``; ties: the larger chunk). Each candidate
    costs about ``2 log2(keep) + 2`` compiles; each is logged at INFO on ``"gc_jax"``.

    Args:
      make_step: ``make_step(chunk_size, keep) -> step`` (``make_step(chunk_size, keep,
        policy)`` with ``policies``), e.g. ``lambda c, k:
        gc_jax.make_train_step(loss_fn, encode, c, keep=k)``.
      args: the step's positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      candidates: chunk sizes to try, as :func:`gc_jax.largest_chunk_size` takes them,
        or token plans (``TokenBudget``, ``TokenPacking``: ``keep`` then counts the last
        bucket's chunks; with ``by="flops"`` plans are ranked by the share of those
        they re-encode).
      kwargs: keyword arguments of the step.
      budget_bytes: bytes per device, as :func:`gc_jax.largest_chunk_size` (default: the
        device's memory).
      device: where to compile, as :func:`gc_jax.largest_chunk_size`.
      policies: remat policies to try (``jax.checkpoint_policies``), passed to
        ``make_step`` as a third argument; None: ``make_step`` takes two.
      by: ``"auto"`` (time where the step can run here, else FLOPs), ``"time"`` or
        ``"flops"``.
      reps: timed rounds per plan (``by="time"``).

    Returns:
      A :class:`StepPlan`: ``chunk_size``, ``keep``, ``policy``, its bytes, seconds
      and FLOPs, and every candidate tried.

    Raises:
      ValueError: no candidate fits (even with ``keep=0``), or as
        :func:`gc_jax.largest_chunk_size`.

    Examples:
      >>> import functools, jax, jax.numpy as jnp, gc_jax
      >>> layer = lambda x, w: jnp.tanh(x @ w)
      >>> encode = lambda params, x, key: functools.reduce(layer, params, x)
      >>> loss = lambda params, q, d: -jnp.mean(jnp.sum(q * d, axis=-1))
      >>> params = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 4
      >>> x = jax.ShapeDtypeStruct((2048, 256), jnp.float32)
      >>> make = lambda c, k: gc_jax.cached_value_and_grad(loss, encode, c, keep=k)
      >>> plan = gc_jax.plan_step(make, (params, x, x), [256, 512], budget_bytes="24MiB",
      ...                         by="flops")
      >>> plan.bytes <= 24 * 2**20, plan.keep / plan.chunks >= 0.5  # half the chunks kept
      (True, True)
      >>> 0.1 < plan.reencoded / plan.flops < 0.2  # the forwards of the others re-encoded
      True
    """
    _check_by(by, reps)
    budget, tried, target = _budget(budget_bytes), _plan_candidates(candidates), _target(device)
    given = (tuple(args), dict(kwargs or {}))
    args = _place(target, given[0])
    kwargs = _place(target, given[1])
    budget = budget or device_budget(target, args, "plan_step")
    mesh = target if isinstance(target, Mesh) else None
    by = ("time" if _runs_here(target, args) else "flops") if by == "auto" else by
    compile_ = lambda size, keep, policy: _compile(
        _made(make_step, size, keep, policy), args, kwargs, mesh
    )
    _check_token_timing(tried, by, *given)
    count_flops = by == "flops" and not _plan.by_tokens(tried[0])
    fits, seen = _fitting_plans(compile_, make_step, tried, policies, budget, count_flops)
    if not fits:
        raise ValueError(
            f"plan_step: no candidate fits a budget of {budget:,.0f} bytes per device, even "
            f"with keep=0; try smaller chunk sizes than {tried!r} or a larger budget_bytes."
        )
    seconds = [None] * len(fits)
    if by == "time":
        fits += _default_plan(fits, seen)
        run = _timing_args(tried, (args, kwargs), given)
        seconds = _times([f.compiled.compiled for f in fits], *run, reps)
        best = min(range(len(fits)), key=lambda i: seconds[i])
    elif all(f.flops is not None for f in fits):  # the fewest FLOPs; of equals, the larger chunk
        best = min(range(len(fits)), key=lambda i: (fits[i].flops, -_rows(fits[i].size)))
    else:  # FLOPs unread (every chunk kept does not compile): the fewest rows re-encoded
        share = lambda f: (f.chunks - f.keep) / f.chunks
        best = min(range(len(fits)), key=lambda i: (share(fits[i]), -_rows(fits[i].size)))
    timed = {(f.size, f.keep, f.policy): t for f, t in zip(fits, seconds, strict=True)}
    shown = lambda p: None if p is _NO_POLICY else p
    table = tuple((s, k, shown(p), c.bytes, timed.get((s, k, p))) for (s, k, p), c in seen.items())
    f = fits[best]
    return StepPlan(f.size, f.keep, shown(f.policy), f.compiled.bytes, seconds[best], f.flops,
                    f.reencoded, f.chunks, table)  # fmt: skip


def _default_plan(fits: list, seen: dict) -> list:
    """The default's plan (``keep=1``) at the largest chunk size that fits, where it is
    not a plan already: timed too, so that the plan is never slower than it, as measured."""
    largest = max(fits, key=lambda f: _rows(f.size))
    compiled = seen.get((largest.size, 1, largest.policy))
    if largest.keep <= 1 or compiled is None:
        return []
    return [largest._replace(keep=1, compiled=compiled, flops=None, reencoded=None)]


def _rows(size: Any) -> int:
    """How large a candidate is: its rows, or a token plan's tokens per chunk."""
    if _plan.by_tokens(size):
        return size.tokens
    return sum(size) if isinstance(size, tuple) else size


def _plan_candidates(candidates: Any) -> list[Any]:
    """Chunk sizes in rows (as :func:`gc_jax.largest_chunk_size` takes them) or token
    plans (``TokenBudget``, ``TokenPacking``), smallest first; not the two mixed."""
    if isinstance(candidates, Iterable) and not isinstance(candidates, str | bytes | Mapping):
        candidates = list(candidates)
        tokens = [_plan.by_tokens(c) for c in candidates]
        if candidates and all(tokens):
            return sorted(candidates, key=lambda c: c.tokens)
        if any(tokens):
            raise TypeError(
                "plan_step: candidates mix token plans (TokenBudget, TokenPacking) and chunk "
                f"sizes in rows: {candidates!r}; pass all token plans, e.g. "
                "[TokenBudget(tokens=2048, ...), TokenBudget(tokens=4096, ...)], or all rows."
            )
    return _candidates(candidates)


class _Fit(NamedTuple):
    size: Any
    keep: int
    policy: Any
    chunks: int
    compiled: _Compiled
    flops: float | None = None
    reencoded: float | None = None


def _fitting_plans(compile_, make_step, tried, policies, budget, count_flops: bool):
    """For each chunk size and policy, the most kept chunks that fit: ``([_Fit],
    {(chunk_size, keep, policy): _Compiled} of every compile)``."""
    log = logging.getLogger("gc_jax")
    fits, seen = [], {}
    for size in reversed(tried):
        for policy in [_NO_POLICY] if policies is None else list(policies):
            chunks = _chunks(lambda k, s=size, p=policy: compile_(s, k, p))

            def measure(keep, size=size, policy=policy):
                tick = time.perf_counter()
                got = compile_(size, keep, policy)
                log.info("plan_step: chunk_size=%r keep=%d: %s bytes (compiled in %.1fs)",
                         size, keep, got.bytes, time.perf_counter() - tick)  # fmt: skip
                return got

            keep, compiled = _most_kept(measure, chunks, budget)
            if keep is not None:
                fit = _Fit(size, keep, policy, chunks, compiled[keep])
                fits.append(_with_flops(fit, compiled, measure) if count_flops else fit)
            seen.update({(size, k, policy): c for k, c in compiled.items()})
    return fits, seen


def _with_flops(fit: _Fit, compiled: dict, measure) -> _Fit:
    """``fit`` with its step's FLOPs and those of the forwards it re-encodes.

    The compiler's cost analysis counts a loop's body once, whatever its trips, so a
    step's FLOPs are read where no loop runs more than once: every chunk kept
    (``keep=chunks``) and one chunk re-encoded (``keep=chunks - 1``); their difference
    is one chunk's forward, re-encoded ``chunks - keep`` times by the plan. Where the
    compiler merged that one chunk's two encodings (no difference; seen on JAX 0.10),
    the forward is half the difference with two re-encoded (``keep=chunks - 2``: one
    chunk's backward counted less), a backward taking twice its forward.
    """
    n = fit.chunks
    for keep in (n, n - 1):
        if keep >= 0 and keep not in compiled:
            compiled[keep] = measure(keep)
    every = compiled[n].flops
    if every is None or compiled[n - 1].flops is None or n < 2:
        return fit._replace(flops=every, reencoded=0.0 if every is not None else None)
    forward = compiled[n - 1].flops - every
    if forward <= 0 and n > 2:
        if n - 2 not in compiled:
            compiled[n - 2] = measure(n - 2)
        forward = (every - compiled[n - 2].flops) / 2
    reencoded = (n - fit.keep) * max(forward, 0.0)
    return fit._replace(flops=every + reencoded, reencoded=reencoded)
