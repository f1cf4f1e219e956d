"""Keep what fits: the cached step with ``keep=`` against the plain step, under one memory budget.

The budget is XLA:CPU's compiled memory (arguments + temporaries + outputs) of the
plain full-batch step (``jax.value_and_grad``) at ``--plain-batch`` rows: the largest
batch the plain step fits, by construction (checked: one row block more does not fit).
At 1x, 2x, 4x and 16x that batch (``--multiples``), two cached steps that fit the same
budget are timed against the plain step at its largest batch, per row:

* *today*: ``gc_jax.cached_value_and_grad`` with the default ``keep`` (the last chunk)
  and the largest chunk size that fits (``gc_jax.largest_chunk_size``);
* *planned*: the chunk size and ``keep`` of ``gc_jax.plan_step`` (the most chunks
  kept that fit, per chunk size; the fastest by measured time).

Every step is the MLP of ``benchmarks.common`` (tied towers) with the blockwise InfoNCE
loss (``--block-size``), so the loss itself holds no ``B x B`` matrix. Each batch's
three steps run in ``--reps`` interleaved rounds (odd rounds reversed); reported: the
median and range over rounds of each cached step's time per row over the plain step's
time per row in the same round, and of planned over today. Exactness: each cached
step's loss and gradients against plain ``jax.value_and_grad`` of the full batch
(run at every batch: the CPU has the memory; the budget is the compiled one).

Usage::

    python -m benchmarks.keep                       # 1x 2x 4x 16x of 512 rows
    python -m benchmarks.keep --quick               # a sanity run, seconds
    python -m benchmarks.keep --json benchmarks/results/keep_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import gc_jax
from benchmarks import common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    common.add_model_args(p, depth=6)
    p.add_argument("--plain-batch", type=int, default=512, help="the plain step's largest batch")
    p.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 16])
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256], help="chunk sizes")
    p.add_argument("--block-size", type=int, default=256, help="tile of the blockwise loss")
    p.add_argument("--reps", type=int, default=7, help="timed rounds per batch")
    p.add_argument("--plan-reps", type=int, default=3, help="plan_step's timed rounds")
    p.add_argument("--json", type=Path, default=None, help="write the raw timings here")
    p.add_argument("--quick", action="store_true", help=common.QUICK)
    args = p.parse_args(argv)
    if args.quick:
        args.depth, args.width, args.dim_in, args.dim_out = 2, 64, 64, 32
        args.plain_batch, args.chunks, args.block_size = 64, [16, 32], 32
        args.multiples, args.reps, args.plan_reps = [1, 2], 3, 1
    return args


def steps(block_size: int) -> dict[str, Any]:
    """``plain()``, ``cached(chunk, keep)``: the steps compared, not jitted."""
    loss = common.loss_fn(block_size)
    cached = lambda c, keep=None: gc_jax.cached_value_and_grad(loss, common.encode, c, keep=keep)
    return {"plain": lambda: common.full_batch_step(block_size=block_size), "cached": cached}


def abstract(params, batch: int, cfg: common.ModelConfig) -> tuple:
    x = jax.ShapeDtypeStruct((batch, cfg.dim_in), cfg.dtype)
    return (jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params), x, x)


def budget_of(make, params, cfg, batch: int) -> int:
    """XLA:CPU's compiled bytes of the step: arguments + temporaries + outputs - aliased
    (what ``gc_jax.largest_chunk_size`` and ``gc_jax.plan_step`` compare with a budget)."""
    m = jax.jit(make()).lower(*abstract(params, batch, cfg)).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)  # fmt: skip


def max_diff(a: Any, b: Any) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
               jax.tree.leaves(b), strict=True))  # fmt: skip


def one_batch(args, cfg, made, params, budget: int, multiple: int) -> dict[str, Any]:
    """The plans at ``multiple`` times the plain batch, timed against the plain step."""
    rows, plain_rows = multiple * args.plain_batch, args.plain_batch
    shapes = abstract(params, rows, cfg)
    chunks = [c for c in args.chunks if c <= rows]
    try:
        today = gc_jax.largest_chunk_size(made["cached"], shapes, chunks, budget_bytes=budget)
    except ValueError as e:  # no chunk size fits: say what the smallest needs
        print(f"{multiple}x = {rows:,} rows: {e}")
        return {"multiple": multiple, "rows": rows, "fits": False, "error": str(e)}
    plan = gc_jax.plan_step(made["cached"], shapes, chunks, budget_bytes=budget, by="time",
                            reps=args.plan_reps)  # fmt: skip
    q, d = common.make_batch(cfg, rows, jax.random.key(1))
    fns = {
        "plain": jax.jit(made["plain"]()),
        "today": jax.jit(made["cached"](today)),
        "planned": jax.jit(made["cached"](plan.chunk_size, plan.keep)),
    }
    exact = fns["plain"](params, q, d)  # the full batch, which the CPU's memory holds
    diffs = {k: max_diff(fns[k](params, q, d), exact) for k in ("today", "planned")}
    small = (params, *common.make_batch(cfg, plain_rows, jax.random.key(1)))
    calls = {"plain": lambda: fns["plain"](*small)}
    calls |= {k: (lambda k=k: fns[k](params, q, d)) for k in ("today", "planned")}
    load_before = common.load()
    t = common.interleaved_times(calls, (), args.reps, warmup=1)
    per_row = {
        k: [w / (rows if k != "plain" else plain_rows) for w in v] for k, v in t.wall.items()
    }
    today_bytes = budget_of(lambda: made["cached"](today), params, cfg, rows)
    return {
        "multiple": multiple, "rows": rows, "today_chunk": today, "today_bytes": today_bytes,
        "plan": {"chunk_size": plan.chunk_size, "keep": plan.keep, "chunks": plan.chunks,
                 "bytes": plan.bytes, "tried": [list(map(_plain, x)) for x in plan.tried]},
        "max_abs_diff": diffs, "wall": t.wall, "cpu": t.cpu,
        "planned_over_plain": common.ratio_range(per_row["planned"], per_row["plain"]),
        "today_over_plain": common.ratio_range(per_row["today"], per_row["plain"]),
        "planned_over_today": common.ratio_range(t.wall["planned"], t.wall["today"]),
        "load": [load_before, common.load()],
    }  # fmt: skip


def _plain(x: Any) -> Any:
    return x if isinstance(x, int | float | str | type(None)) else str(x)


def report(results: list[dict], budget: int, args) -> None:
    print(f"\nbudget: {budget:,} bytes (XLA:CPU compiled memory of the plain step at "
          f"{args.plain_batch} rows)")  # fmt: skip
    print(
        "| batch | today: chunk, bytes | planned: chunk, keep of chunks, bytes "
        "| today / plain per row | planned / plain per row | planned / today "
        "| max abs diff (today, planned) | load after |"
    )
    print("|---:|---|---|---|---|---|---|---|")
    fmt = lambda r: f"{r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})"
    for r in results:
        if not r.get("fits", True):
            print(f"| {r['multiple']}x = {r['rows']:,} | no chunk size fits | | | | | | |")
            continue
        p = r["plan"]
        print(
            f"| {r['multiple']}x = {r['rows']:,} | {r['today_chunk']}, {r['today_bytes']:,} "
            f"| {p['chunk_size']}, {p['keep']} of {p['chunks']}, {p['bytes']:,} "
            f"| {fmt(r['today_over_plain'])} | {fmt(r['planned_over_plain'])} "
            f"| {fmt(r['planned_over_today'])} "
            f"| {r['max_abs_diff']['today']:.1e}, {r['max_abs_diff']['planned']:.1e} "
            f"| {r['load'][1]} |"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = common.model_config(args)
    print(common.machine())
    print(cfg.describe())
    print(common.command("keep", sys.argv[1:] if argv is None else argv))
    made = steps(args.block_size)
    params = common.init_params(cfg, jax.random.key(0))
    budget = budget_of(made["plain"], params, cfg, args.plain_batch)
    above = budget_of(made["plain"], params, cfg, args.plain_batch + 64)
    print(f"plain step: {budget:,} bytes at {args.plain_batch} rows, {above:,} at "
          f"{args.plain_batch + 64} ({'does not fit' if above > budget else 'FITS'})")  # fmt: skip
    results = []
    for m in args.multiples:  # each batch's row as soon as it is measured
        results.append(one_batch(args, cfg, made, params, budget, m))
        report(results[-1:], budget, args)
        if args.json:
            common.write_json(args.json, {"budget": budget, "results": results})
    report(results, budget, args)
    if args.json:
        common.write_json(args.json, {"budget": budget, "machine": common.machine(),
                                      "args": vars(args) | {"json": str(args.json)},
                                      "results": results})  # fmt: skip
        print(f"wrote {common.shown(args.json)}")


if __name__ == "__main__":
    main()
