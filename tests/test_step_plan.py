"""``gc_jax.plan_step``: the chunk size and ``keep=`` that fit a memory budget, fastest.

Fit is read from XLA:CPU's compiled memory (``memory_analysis()``), never from
timings; every plan's step is checked against plain ``jax.value_and_grad`` of the full
batch under ``jax.jit``. The "never slower than the default" promise is checked on the
plan's own measurements (``plan.tried``), not against a clock here.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import pytest

import gc_jax
from gc_jax._chunk_size import compiled_bytes

TOL = {"rtol": 2e-5, "atol": 2e-6}
DEPTH, WIDTH, ROWS = 4, 256, 2048
BUDGET = "24MiB"


def layer(x, w):
    return jnp.tanh(x @ w)


def encode(params, x, key):
    return functools.reduce(layer, params, x)


def alignment(params, q, d):
    return -jnp.mean(jnp.sum(q * d, axis=-1))


def make(chunk_size, keep):
    return gc_jax.cached_value_and_grad(alignment, encode, chunk_size, keep=keep)


def make_with_policy(chunk_size, keep, policy):
    """A plain ``jax.value_and_grad`` step through ``chunked_encoder(policy=, keep=)``
    (each input's call keeps ``keep`` of its chunks)."""
    cached = gc_jax.chunked_encoder(encode, chunk_size, policy=policy, keep=keep)
    total = lambda p, q, d: alignment(p, cached(p, q), cached(p, d))
    return jax.value_and_grad(total)


def batch():
    keys = jax.random.split(jax.random.key(0), DEPTH + 2)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys[:DEPTH]]
    q, d = (jax.random.normal(k, (ROWS, WIDTH)) for k in keys[DEPTH:])
    return params, q, d


def full_batch(params, q, d):
    total = lambda p, q, d: alignment(p, encode(p, q, None), encode(p, d, None))
    return jax.jit(jax.value_and_grad(total))(params, q, d)


def step_bytes(step, *args) -> int:
    return compiled_bytes(jax.jit(step).lower(*args).compile())


def assert_exact(plan, args):
    if plan.policy is None:
        got = jax.jit(make(plan.chunk_size, plan.keep))(*args)
    else:
        got = jax.jit(make_with_policy(plan.chunk_size, plan.keep, plan.policy))(*args)
    chex.assert_trees_all_close(got, full_batch(*args), **TOL)


def test_flops_plan_keeps_the_most_that_fit():
    """``by="flops"``: the plan fits, one more kept chunk does not, and it is exact."""
    args = batch()
    plan = gc_jax.plan_step(make, args, [256, 512], budget_bytes=BUDGET, by="flops")
    assert plan.bytes <= 24 * 2**20 and plan.seconds is None
    assert 0 < plan.keep < plan.chunks, plan[:8]
    assert step_bytes(make(plan.chunk_size, plan.keep + 1), *args) > 24 * 2**20
    assert plan.flops > plan.reencoded > 0
    compiled = {(size, keep) for size, keep, *_ in plan.tried}
    assert {(plan.chunk_size, 0), (plan.chunk_size, plan.keep)} <= compiled
    assert_exact(plan, args)


def test_timed_plan_is_never_slower_than_the_default_as_measured():
    """``by="time"`` (what ``"auto"`` picks on this CPU): the default's plan, ``keep=1`` at
    the largest chunk size that fits, is timed beside the candidates, and the plan's
    median is the smallest of those measured."""
    args = batch()
    plan = gc_jax.plan_step(make, args, [256, 512], budget_bytes=BUDGET, reps=2)
    timed = {(size, keep): s for size, keep, _, _, s in plan.tried if s is not None}
    largest = max(size for size, keep, _, b, _ in plan.tried if b and b <= 24 * 2**20)
    assert (largest, 1) in timed, plan.tried
    assert plan.seconds == min(timed.values()) <= timed[(largest, 1)]
    assert_exact(plan, args)


def test_policies_are_tried_and_the_plan_is_exact():
    """``policies=``: ``make_step(chunk_size, keep, policy)`` gets each policy; saving
    nothing in pass 2 lets at least as many chunks be kept in the same budget."""
    args = batch()
    nothing = jax.checkpoint_policies.nothing_saveable
    dots = jax.checkpoint_policies.dots_saveable
    plan = gc_jax.plan_step(make_with_policy, args, [256], budget_bytes=BUDGET, by="flops",
                            policies=[dots, nothing])  # fmt: skip
    assert plan.policy in (dots, nothing)
    most = {}
    for _size, keep, policy, nbytes, _ in plan.tried:
        if nbytes is not None and nbytes <= 24 * 2**20:
            most[policy] = max(most.get(policy, 0), keep)
    assert set(most) == {dots, nothing} and most[nothing] >= most[dots], plan.tried
    chex.assert_trees_all_close(
        jax.jit(make_with_policy(plan.chunk_size, plan.keep, plan.policy))(*args),
        full_batch(*args), **TOL)  # fmt: skip


# --------------------------------------------------------------- token plans


def token_case():
    import test_token_chunks as case

    params, encoders = case.make_params(), case.towers(tied=False)
    q, d = case.text_batch(20, "uniform", 1), case.text_batch(20, "long", 2)
    make_step = lambda c, k: gc_jax.cached_value_and_grad(case.loss_fn, encoders, c, keep=k)
    want = case.full_batch(case.loss_fn, encoders, params, q, d)
    budgets = [gc_jax.TokenBudget(tokens=t, buckets=case.BUCKETS) for t in (96, 48)]
    return make_step, (params, q, d), want, budgets


@pytest.mark.slow  # about 30 s each: every kept count of two budgets compiles
@pytest.mark.parametrize("by", ["flops", "time"])
def test_token_budgets_are_candidates(by):
    """Token plans are ordered by their tokens; ``keep`` counts the last bucket's chunks;
    the plan is exact."""
    make_step, args, want, budgets = token_case()
    plan = gc_jax.plan_step(make_step, args, budgets, budget_bytes="64MiB", by=by, reps=2)
    assert plan.chunk_size in budgets and 0 <= plan.keep <= plan.chunks
    assert plan.tried[0][0].tokens == 96  # the larger plan compiled first
    got = jax.jit(make_step(plan.chunk_size, plan.keep))(*args)
    chex.assert_trees_all_close(got, want, **TOL)


def test_timing_token_plans_needs_the_batch():
    make_step, (params, q, d), _, budgets = token_case()
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (q, d))
    with pytest.raises(ValueError, match="needs the real batch"):
        gc_jax.plan_step(make_step, (params, *shapes), budgets, budget_bytes="64MiB", by="time")


def test_token_plans_and_rows_do_not_mix():
    make_step, args, _, budgets = token_case()
    with pytest.raises(TypeError, match="mix token plans"):
        gc_jax.plan_step(make_step, args, [budgets[0], 8], by="flops")


# --------------------------------------------------------------- named errors


def test_nothing_fits_names_the_budget():
    with pytest.raises(ValueError, match="no candidate fits a budget of 1,024 bytes"):
        gc_jax.plan_step(make, batch(), [256], budget_bytes=1024, by="flops")


def test_by_must_be_known():
    with pytest.raises(ValueError, match='by must be "auto", "time" or "flops"'):
        gc_jax.plan_step(make, batch(), [256], by="fastest")


def test_a_step_that_drops_keep_is_named():
    drops = lambda c, k: gc_jax.cached_value_and_grad(alignment, encode, c)
    with pytest.raises(ValueError, match="accepted keep=2\\*\\*31 - 1; pass keep= on"):
        gc_jax.plan_step(drops, batch(), [256], budget_bytes=BUDGET, by="flops")
