"""Step time of gradient caching vs plain full-batch ``jax.value_and_grad``, on this machine.

Part 1 (the headline): one configuration (default: 6-layer MLP of width 512, batch
2048, chunk 256, queries and documents through one tied encoder, InfoNCE). Every
variant is jitted, warmed up (compilation excluded), then timed ``--reps`` times,
interleaved round by round so that all variants see the same machine load. Reported:
median seconds per step, the ratio of medians, the median of the per-round ratios
(each round's variants ran back to back; the headline figure, against the target),
the ratio of the fastest rounds (the least disturbed by other processes), and the
same paired ratio of process CPU time. Also timed in the same rounds: the step a user
writes with ``gc_jax.chunked_encoder`` wrapping the encoder inside a plain
``jax.value_and_grad``, reported against ``cached_value_and_grad`` (median and range
of the paired per-round ratios).

Part 2: time per example vs batch size for full batch, both remats and gradient
caching, same chunk size (``--batches``); ``--plot`` writes it as a PNG.

Usage::

    python -m benchmarks.speed                     # headline + batch sweep
    python -m benchmarks.speed --plot benchmarks/plots/time_per_example.png
    python -m benchmarks.speed --quick             # small sanity run, a few seconds
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import common

LABELS = {
    "full": "full batch (jax.value_and_grad)",
    "remat": "full batch, whole encoder under jax.checkpoint",
    "remat_layers": "full batch, each layer under jax.checkpoint",
    "gc": "gc_jax.cached_value_and_grad",
    "chunked_encoder": "gc_jax.chunked_encoder in jax.value_and_grad",
    "gc_block": "gc_jax, blockwise loss",
}
SWEEP = ["full", "remat", "remat_layers", "gc"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    common.add_model_args(p, depth=6)
    p.add_argument("--batch", type=int, default=2048, help="batch of the headline ratio")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--block-size", type=int, default=512, help="tile of the blockwise loss")
    p.add_argument("--reps", type=int, default=15, help="timed rounds (headline)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--target", type=float, default=1.30, help="target ratio gc / full")
    p.add_argument(
        "--batches",
        type=int,
        nargs="*",
        default=[256, 512, 1024, 2048, 4096, 8192],
        help="batch sizes of the time-per-example sweep (none: skip it)",
    )
    p.add_argument("--sweep-reps", type=int, default=7, help="timed rounds per sweep batch")
    p.add_argument("--plot", type=Path, default=None, help="write the sweep as a PNG here")
    p.add_argument("--json", type=Path, default=None, help="write all raw timings here")
    p.add_argument("--quick", action="store_true", help="tiny model and batches, few reps")
    args = p.parse_args(argv)
    if args.quick:
        args.depth, args.width, args.dim_in, args.dim_out = 2, 64, 64, 32
        args.batch, args.chunk, args.block_size = 256, 64, 64
        args.reps, args.warmup, args.sweep_reps = 3, 1, 2
        args.batches = [64, 128, 256]
    return args


def check_equal(steps: dict[str, Any], args: tuple[Any, ...]) -> dict[str, float]:
    """Max abs difference of each variant's loss and grads from the full batch's."""
    ref = jax.tree.leaves(steps["full"](*args))
    out = {}
    for name, fn in steps.items():
        leaves = jax.tree.leaves(fn(*args))
        diffs = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(ref, leaves, strict=True)]
        out[name] = max(diffs)
    return out


def headline(args: argparse.Namespace, cfg: common.ModelConfig) -> dict[str, Any]:
    names = ["full", "remat", "remat_layers", "gc", "chunked_encoder", "gc_block"]
    made = common.make_steps(args.chunk, args.block_size, names)
    steps = {k: jax.jit(v) for k, v in made.items()}
    params = common.init_params(cfg, jax.random.key(0))
    q, d = common.make_batch(cfg, args.batch, jax.random.key(1))
    errs = check_equal(steps, (params, q, d))
    err = max(errs.values())
    load_before = common.load()
    timings = common.interleaved_times(steps, (params, q, d), args.reps, args.warmup)
    load_after = common.load()
    times, cpu = timings.wall, timings.cpu

    print(f"\n## Step time, B={args.batch}, chunk={args.chunk} ({args.reps} rounds, interleaved)")
    print(f"max |difference| of loss and grads vs full batch: {err:.2e}")
    print("  per variant: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    print(f"before: {load_before}; after: {load_after}")
    print(
        "| variant | median wall s | min wall s | max wall s | ratio of medians "
        "| median paired ratio | ratio of minimums | median CPU s | CPU paired ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    full, full_cpu = times["full"], cpu["full"]
    for name, ts in times.items():
        c = cpu[name]
        print(
            f"| {LABELS[name]} | {common.median(ts):.3f} | {min(ts):.3f} | {max(ts):.3f} "
            f"| {common.median(ts) / common.median(full):.3f} "
            f"| {common.paired_ratio(ts, full):.3f} | {min(ts) / min(full):.3f} "
            f"| {common.median(c):.3f} | {common.paired_ratio(c, full_cpu):.3f} |"
        )
    gc_full = common.paired_ratio(times["gc"], full)
    verdict = "meets" if gc_full <= args.target else "MISSES"
    print(
        f"\ngc / full (median paired wall ratio): {gc_full:.3f}, {verdict} target <= {args.target}"
    )
    for other in ("remat", "remat_layers"):
        ratio = common.paired_ratio(times["gc"], times[other])
        print(f"gc / {other} (median paired wall ratio): {ratio:.3f}")
    ce_gc = common.ratio_range(times["chunked_encoder"], times["gc"])
    ce_gc_cpu = common.ratio_range(cpu["chunked_encoder"], cpu["gc"])
    print(
        "chunked_encoder / gc (paired wall ratio over rounds): "
        f"median {ce_gc[0]:.3f}, range {ce_gc[1]:.3f}-{ce_gc[2]:.3f}; "
        f"CPU: median {ce_gc_cpu[0]:.3f}, range {ce_gc_cpu[1]:.3f}-{ce_gc_cpu[2]:.3f}"
    )
    return {
        "batch": args.batch,
        "chunk": args.chunk,
        "wall": times,
        "cpu": cpu,
        "max_abs_diff": err,
        "max_abs_diff_by_variant": errs,
        "chunked_encoder_over_gc": {"wall": ce_gc, "cpu": ce_gc_cpu},
        "load": [load_before, load_after],
    }


def sweep(args: argparse.Namespace, cfg: common.ModelConfig) -> dict[int, common.Timings]:
    steps = {k: jax.jit(v) for k, v in common.make_steps(args.chunk, None, SWEEP).items()}
    params = common.init_params(cfg, jax.random.key(0))
    out: dict[int, common.Timings] = {}
    print(f"\n## Time per example vs batch, chunk={args.chunk} ({args.sweep_reps} rounds each)")
    print("Medians, in ms per example (one example: a query and its document).")
    cols = " | ".join(f"{name} wall | {name} CPU" for name in SWEEP)
    others = ("full", "remat", "remat_layers")
    ratios = " | ".join(f"gc/{k} wall" for k in others)
    print(f"| batch | {cols} | {ratios} | gc/full CPU | load after |")
    print("|---:|" + "---:|" * (2 * len(SWEEP) + len(others) + 1) + "---|")
    for batch in args.batches:
        q, d = common.make_batch(cfg, batch, jax.random.key(1))
        t = out[batch] = common.interleaved_times(
            steps, (params, q, d), args.sweep_reps, args.warmup
        )
        cells = " | ".join(
            f"{1e3 * common.median(t.wall[k]) / batch:.3f} | "
            f"{1e3 * common.median(t.cpu[k]) / batch:.3f}"
            for k in SWEEP
        )
        ratios = " | ".join(f"{common.paired_ratio(t.wall['gc'], t.wall[k]):.3f}" for k in others)
        cpu_ratio = common.paired_ratio(t.cpu["gc"], t.cpu["full"])
        print(f"| {batch} | {cells} | {ratios} | {cpu_ratio:.3f} | {common.load()} |", flush=True)
    return out


def plot(path: Path, results: dict[int, common.Timings], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), dpi=120, sharey=True)
    for ax, kind in zip(axes, ("wall", "cpu"), strict=True):
        for name, marker in zip(SWEEP, "osD^", strict=True):
            ys = [1e3 * common.median(getattr(results[b], kind)[name]) / b for b in batches]
            ax.plot(batches, ys, marker=marker, label=LABELS[name])
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("batch size B (queries; as many documents)")
        what = "wall-clock time" if kind == "wall" else "process CPU time (all threads)"
        ax.set_ylabel("median ms per example")
        ax.set_title(what, fontsize=10)
        ax.yaxis.set_tick_params(labelleft=True)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.quick:
        print(common.QUICK)
    cfg = common.model_config(args)
    print(f"machine: {common.machine()}")
    print(f"model: {cfg.describe()}; loss: InfoNCE, temperature {common.TEMPERATURE}")
    if not common.has_block_size():
        print("contrastive_loss has no block_size=: the blockwise variant is ABSENT")
    results: dict[str, Any] = {"machine": common.machine(), "model": cfg.describe()}
    results["headline"] = headline(args, cfg)
    if args.batches:
        swept = sweep(args, cfg)
        results["sweep"] = {b: {"wall": t.wall, "cpu": t.cpu} for b, t in swept.items()}
        if args.plot:
            title = (
                f"Training-step time per example: {cfg.depth}-layer MLP width {cfg.width}, "
                f"InfoNCE, gc_jax chunk {args.chunk} ({jax.default_backend().upper()}, "
                f"{common.machine().split(',')[1].strip()}, shared and loaded; "
                f"median of {args.sweep_reps} rounds)"
            )
            plot(args.plot, swept, title)
    if args.json:
        common.write_json(args.json, results)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
