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

``--passes`` (instead): where the step time of gradient caching goes, the headline
configuration's passes timed alone, interleaved, against the full batch's. The pieces
of ``gc_jax.cached_value_and_grad`` are rebuilt from public JAX (the core's
``fori_loop`` / ``dynamic_slice`` pattern, not its private functions):

* ``fwd_full``: the encoder on both inputs, full batch (forward only);
* ``fwd_chunked``: the same chunk by chunk into a cache (gc's pass 1, all chunks);
* ``loss_grad``: the loss and its gradient w.r.t. the two ``[B, dim_out]`` caches;
* ``vjp_chunked``: chunk by chunk, re-encode under ``jax.vjp`` and pull a given
  representation gradient back to the parameters (gc's pass 2, all chunks);
* ``vjp_full``: the same pull-back over the full batch in one ``jax.vjp``;
* ``step_full`` and ``step_gc``: the complete steps, as in the headline.

If the core is efficient, ``step_gc ~ fwd_chunked * (1 - chunk/B) + loss_grad +
vjp_chunked`` (the core keeps the last chunk's forward from pass 1) and
``step_full ~ loss_grad + vjp_full``.

``--commits C [C ...]`` (instead): the headline gc/full ratio for several gc_jax
commits, interleaved. Each commit's ``gc_jax`` is taken with ``git archive`` into a
temporary folder; every one of ``--rounds`` rounds runs one worker process per commit
(alternating the order), whose ``PYTHONPATH`` puts that commit's ``gc_jax`` before this
checkout's ``benchmarks``. Each worker times the full-batch and gc steps of the
headline configuration in ``--reps`` paired, alternating repetitions after
``--warmup`` untimed ones. Reported per commit: the median and range of the paired
gc/full ratios, wall and process CPU time (issue 18's speed regression).

Usage::

    python -m benchmarks.speed                     # headline + batch sweep
    python -m benchmarks.speed --plot benchmarks/plots/time_per_example.png
    python -m benchmarks.speed --quick             # small sanity run, a few seconds
    python -m benchmarks.speed --passes --reps 9   # each pass timed alone
    python -m benchmarks.speed --commits 7634503 951f672 HEAD --rounds 4 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--passes", action="store_true", help="time gc_jax's passes alone instead")
    mode.add_argument("--commits", nargs="+", help="the headline ratio of these commits instead")
    p.add_argument("--rounds", type=int, default=4, help="--commits: worker rounds")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # --commits: one commit's gc_jax
    args = p.parse_args(argv)
    if (args.passes or args.commits) and (args.plot or args.json):
        p.error("--passes and --commits print their tables only: no --plot or --json")
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
    if args.worker:
        return commit_worker(args)
    if args.commits:
        return commits(args)
    if args.quick:
        print(common.QUICK)
    if args.passes:
        return passes(args)
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


# --- --passes: each pass of gc_jax timed alone ----------------------------------------------


def chunked_forward(params: Any, x: jax.Array, chunk: int, dim_out: int) -> jax.Array:
    """Pass 1: every chunk encoded in a ``fori_loop``, written into the cache in place."""

    def body(c: jax.Array, cache: jax.Array) -> jax.Array:
        rows = jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk)
        return jax.lax.dynamic_update_slice_in_dim(
            cache, common.encode(params, rows), c * chunk, axis=0
        )

    cache = jnp.zeros((x.shape[0], dim_out), x.dtype)
    return jax.lax.fori_loop(0, x.shape[0] // chunk, body, cache)


def chunked_vjp(params: Any, x: jax.Array, rep_grad: jax.Array, chunk: int) -> Any:
    """Pass 2: every chunk re-encoded under ``jax.vjp``, parameter gradients summed."""

    def body(c: jax.Array, acc: Any) -> Any:
        rows = jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk)
        g = jax.lax.dynamic_slice_in_dim(rep_grad, c * chunk, chunk)
        _, vjp = jax.vjp(lambda p: common.encode(p, rows), params)
        return jax.tree.map(jnp.add, acc, vjp(g)[0])

    zeros = jax.tree.map(jnp.zeros_like, params)
    return jax.lax.fori_loop(0, x.shape[0] // chunk, body, zeros)


def full_vjp(params: Any, x: jax.Array, rep_grad: jax.Array) -> Any:
    _, vjp = jax.vjp(lambda p: common.encode(p, x), params)
    return vjp(rep_grad)[0]


def pass_fns(chunk: int, dim_out: int) -> dict[str, Any]:
    """The pieces, each ``(params, q, d, reps, rep_grads) -> ...`` and jitted: nothing is
    a compile-time constant that XLA could fold away."""
    loss = common.loss_fn()
    return {
        "fwd_full": lambda p, q, d, r, g: (common.encode(p, q), common.encode(p, d)),
        "fwd_chunked": lambda p, q, d, r, g: (
            chunked_forward(p, q, chunk, dim_out),
            chunked_forward(p, d, chunk, dim_out),
        ),
        "loss_grad": lambda p, q, d, r, g: jax.value_and_grad(lambda r: loss(p, *r))(r),
        "vjp_chunked": lambda p, q, d, r, g: jax.tree.map(
            jnp.add, chunked_vjp(p, q, g[0], chunk), chunked_vjp(p, d, g[1], chunk)
        ),
        "vjp_full": lambda p, q, d, r, g: jax.tree.map(
            jnp.add, full_vjp(p, q, g[0]), full_vjp(p, d, g[1])
        ),
        "step_full": lambda p, q, d, r, g: common.full_batch_step()(p, q, d),
        "step_gc": lambda p, q, d, r, g: common.cached_step(chunk)(p, q, d),
    }


def passes(args: argparse.Namespace) -> None:
    """``--passes``: every piece timed in interleaved rounds, against ``step_full``."""
    if args.batch % args.chunk:
        raise SystemExit("--batch must be a multiple of --chunk here")
    cfg = common.model_config(args)
    params = common.init_params(cfg, jax.random.key(0))
    q, d = common.make_batch(cfg, args.batch, jax.random.key(1))
    reps = (common.encode(params, q), common.encode(params, d))
    grads = jax.grad(lambda r: common.loss_fn()(None, *r))(reps)
    fns = {k: jax.jit(f) for k, f in pass_fns(args.chunk, args.dim_out).items()}
    print(f"machine: {common.machine()}")
    print(f"model: {cfg.describe()}; B={args.batch}, chunk={args.chunk}, {args.reps} rounds")
    timings = common.interleaved_times(fns, (params, q, d, reps, grads), args.reps, args.warmup)
    print(f"after: {common.load()}")
    print_passes(timings, 1 - args.chunk / args.batch)


def print_passes(timings: common.Timings, kept: float) -> None:
    """The pieces' table, their sums against the steps and the backward/forward costs."""
    times, cpu = timings.wall, timings.cpu
    med = {k: common.median(v) for k, v in times.items()}
    full = times["step_full"]
    print("| piece | median wall s | vs step_full (paired) | median CPU s | CPU vs step_full |")
    print("|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        print(
            f"| {name} | {med[name]:.3f} | {common.paired_ratio(ts, full):.3f} | "
            f"{common.median(cpu[name]):.3f} | "
            f"{common.paired_ratio(cpu[name], cpu['step_full']):.3f} |"
        )
    predicted_gc = med["fwd_chunked"] * kept + med["loss_grad"] + med["vjp_chunked"]
    predicted_full = med["loss_grad"] + med["vjp_full"]
    print(
        f"\nsum of pieces: gc ~ {predicted_gc:.3f} s (measured {med['step_gc']:.3f}); "
        f"full ~ {predicted_full:.3f} s (measured {med['step_full']:.3f})"
    )
    bwd = lambda vjp, fwd: (med[vjp] - med[fwd]) / med[fwd]
    print(
        f"backward/forward cost: full batch {bwd('vjp_full', 'fwd_full'):.2f}, "
        f"chunked {bwd('vjp_chunked', 'fwd_chunked'):.2f}; "
        f"chunked/full forward {med['fwd_chunked'] / med['fwd_full']:.2f}, "
        f"chunked/full vjp {med['vjp_chunked'] / med['vjp_full']:.2f}"
    )


# --- --commits: the headline ratio of several commits' gc_jax ------------------------------


def commit_worker(args: argparse.Namespace) -> None:
    """Times the full and gc steps with the ``gc_jax`` of ``--worker`` (first on the path)."""
    import gc_jax

    assert gc_jax.__file__.startswith(args.worker), gc_jax.__file__
    cfg = common.model_config(args)
    made = common.make_steps(args.chunk, None, ["full", "gc"])
    steps = {k: jax.jit(v) for k, v in made.items()}
    params = common.init_params(cfg, jax.random.key(0))
    q, d = common.make_batch(cfg, args.batch, jax.random.key(1))
    t = common.interleaved_times(steps, (params, q, d), args.reps, args.warmup)
    print(json.dumps({k: {"wall": t.wall[k], "cpu": t.cpu[k]} for k in steps}))


def worker_argv(args: argparse.Namespace, src: Path) -> list[str]:
    """The arguments of a worker on ``src``'s ``gc_jax``: this run's model and sizes."""
    sizes = {"--depth": args.depth, "--width": args.width, "--dim-in": args.dim_in,
             "--dim-out": args.dim_out, "--batch": args.batch, "--chunk": args.chunk,
             "--reps": args.reps, "--warmup": args.warmup}  # fmt: skip
    return ["--worker", str(src), *(str(x) for item in sizes.items() for x in item)]


def worker_run(args: argparse.Namespace, src: Path) -> dict[str, Any]:
    """One worker process on ``src``'s ``gc_jax``, then this checkout's ``benchmarks``."""
    cmd = [sys.executable, "-m", "benchmarks.speed", *worker_argv(args, src)]
    path = [str(src), str(common.ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=src.parent, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def commits(args: argparse.Namespace) -> None:
    """``--commits``: ``--rounds`` rounds of one worker per commit, alternating the order."""
    tmp = Path(tempfile.mkdtemp())
    for c in args.commits:
        (tmp / c).mkdir()
        archive = subprocess.run(["git", "archive", c, "gc_jax"], cwd=common.ROOT,
                                 check=True, capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(tmp / c)], input=archive, check=True)
    ratios = {c: {"wall": [], "cpu": []} for c in args.commits}
    for r in range(args.rounds):
        for c in args.commits if r % 2 == 0 else args.commits[::-1]:
            d = worker_run(args, tmp / c)
            for m in ("wall", "cpu"):
                ratios[c][m] += [g / f for g, f in zip(d["gc"][m], d["full"][m], strict=True)]
        print(f"round {r}: load average {os.getloadavg()[0]:.1f}", flush=True)
    for c, x in ratios.items():
        parts = [f"{m} median {statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"
                 for m, v in x.items()]  # fmt: skip
        print(f"{c}: gc/full {', '.join(parts)} (n={len(x['wall'])})")


if __name__ == "__main__":
    main()
