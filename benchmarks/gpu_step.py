"""Real training steps of the BERT-base dual encoder on an accelerator: time and peak memory.

Runs ``benchmarks/bert.py``'s step (two BERT-base towers, bfloat16 compute, float32
parameters, blockwise InfoNCE) for a few real iterations and reports, per variant
and batch size, the median step time and the device's peak memory
(``jax.devices()[0].memory_stats()["peak_bytes_in_use"]``). Every variant runs in a
fresh process, so the peaks do not mix; within one process batches grow, so each
peak is that batch's.

Modes:

* ``--compare B``: gc_jax, plain full batch and per-layer remat at one batch ``B``
  that fits them all (median step time and peak memory of each);
* ``--grow B1 B2 ...``: gc_jax alone at growing batches, until one fails (out of
  memory) or ``--budget-s`` runs out: the largest batch it trains;
* ``--compile-only B1 ...``: compiled memory (``memory_analysis()``) of gc_jax on
  this backend, nothing run.

On a CPU use ``--tiny`` (a 2-layer model) to check that the script works.

Usage::

    python -m benchmarks.gpu_step --compare 512 --grow 16384 65536 262144
    python -m benchmarks.gpu_step --tiny --compare 64 --grow 128 256   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import bert, common

GIB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--compare", type=int, help="batch for gc_jax vs full batch vs remat")
    p.add_argument("--grow", type=int, nargs="*", default=[], help="gc_jax batches, growing")
    p.add_argument("--compile-only", type=int, nargs="*", default=[])
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--grow-chunk", type=int, default=128, help="chunk for --grow")
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-time cap for --grow")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # variant, run in a child process
    p.add_argument("--batches", type=int, nargs="*", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def worker(args: argparse.Namespace, cfg: bert.BertConfig) -> None:
    """Child process: one variant at growing batches; one JSON line per batch."""
    chunk = args.grow_chunk if args.worker == "gc_jax (grow)" else args.chunk
    step = jax.jit(bert.steps(cfg, chunk, args.block)[args.worker.split(" (")[0]])
    params = bert.init_params(cfg, jax.random.key(0))
    start = time.perf_counter()
    for rows in args.batches:
        key = jax.random.key(rows)
        q = bert.random_batch(cfg, rows, cfg.query_len, key)
        p = bert.random_batch(cfg, rows, cfg.passage_len, jax.random.fold_in(key, 1))
        t0 = time.perf_counter()
        loss, _ = jax.block_until_ready(step(params, q, p))  # compile + first step
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, q, p))
            times.append(time.perf_counter() - t0)
        print(json.dumps({
            "variant": args.worker, "batch": rows, "chunk": chunk, "loss": float(loss),
            "finite": bool(jnp.isfinite(loss)), "first_s": first,
            "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "peak_bytes": peak_bytes(), "device": str(jax.devices()[0].device_kind),
        }), flush=True)  # fmt: skip
        if time.perf_counter() - start > args.budget_s:
            break


def run_child(args: argparse.Namespace, variant: str, batches: list[int], timeout: float) -> list:
    cmd = [sys.executable, "-m", "benchmarks.gpu_step", "--worker", variant,
           "--batches", *map(str, batches), "--chunk", str(args.chunk),
           "--grow-chunk", str(args.grow_chunk), "--block", str(args.block),
           "--steps", str(args.steps), "--budget-s", str(args.budget_s),
           *(["--tiny"] if args.tiny else [])]  # fmt: skip
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.95")
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=common.ROOT
        )
        stdout, code = out.stdout, out.returncode
        err = out.stderr.strip().splitlines()[-1:] if out.returncode else []
    except subprocess.TimeoutExpired as e:
        stdout, code, err = (
            (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
            "timeout",
            [],
        )
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    for r in rows:
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / GIB:.2f} GiB"
        print(f"  {r['variant']:18s} B={r['batch']:>7d} chunk {r['chunk']:>4d}: median "
              f"{r['median_s'] * 1e3:9.1f} ms (min {r['min_s'] * 1e3:.1f}, max "
              f"{r['max_s'] * 1e3:.1f}; first incl. compile {r['first_s']:.1f} s), peak {peak}, "
              f"loss {r['loss']:.4f}", flush=True)  # fmt: skip
    if code:
        print(
            f"  {variant}: stopped after {len(rows)} batch(es): exit {code} {' '.join(err)[:300]}"
        )
    return rows


def compile_only(args: argparse.Namespace, cfg: bert.BertConfig) -> list:
    params = bert.abstract_params(cfg)
    step = bert.steps(cfg, args.chunk, args.block)["gc_jax"]
    out = []
    for rows in args.compile_only:
        q = bert.abstract_batch(cfg, rows, cfg.query_len)
        p = bert.abstract_batch(cfg, rows, cfg.passage_len)
        m = jax.jit(step).lower(params, q, p).compile().memory_analysis()
        total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
        sizes = (m.argument_size_in_bytes, m.temp_size_in_bytes, m.output_size_in_bytes, total)
        args_, temp, outs, total_ = (x / GIB for x in sizes)
        print(f"  compiled gc_jax B={rows} chunk {args.chunk}: args {args_:.2f} GiB, temp "
              f"{temp:.2f}, outputs {outs:.2f}, total {total_:.2f} GiB", flush=True)  # fmt: skip
        out.append({"batch": rows, "total_bytes": total, "temp_bytes": m.temp_size_in_bytes})
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = bert.TINY if args.tiny else bert.BertConfig()
    if args.worker:
        return worker(args, cfg)
    print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); "
          f"{cfg.describe()}; blockwise loss block {args.block}", flush=True)  # fmt: skip
    results: dict = {}
    if args.compile_only:
        results["compile_only"] = compile_only(args, cfg)
    if args.compare:
        print(f"compare at B={args.compare} (gc_jax chunk {args.chunk}), {args.steps} timed steps:")
        results["compare"] = [
            row
            for variant in ("gc_jax", "full batch", "per-layer remat")
            for row in run_child(args, variant, [args.compare], timeout=args.budget_s)
        ]
        by = {r["variant"]: r for r in results["compare"]}
        if "gc_jax" in by:
            for other in ("full batch", "per-layer remat"):
                if other in by:
                    ratio = by["gc_jax"]["median_s"] / by[other]["median_s"]
                    print(f"  gc_jax / {other}: median step time ratio {ratio:.3f}")
    if args.grow:
        print(f"gc_jax at growing batches (chunk {args.grow_chunk}), {args.steps} timed steps:")
        results["grow"] = run_child(args, "gc_jax (grow)", args.grow, timeout=args.budget_s + 300)
    if args.json:
        common.write_json(args.json, results)


if __name__ == "__main__":
    main()
