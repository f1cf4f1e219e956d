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
* ``--compile-only B1 ...``: compiled memory (``memory_analysis()``) of gc_jax (or of
  ``--compile-variants``) on this backend, nothing run, and the bytes per row added
  between the last two batches.

The parent process never touches the device: compiling there would autotune on the
GPU, through an allocator that by default reserves 75 % of the device for as long as
the process lives, and leave the children the rest (``--compile-only`` did so before).
``--attention cudnn`` runs every variant with cuDNN's fused attention (bfloat16, GPU).

On a CPU use ``--tiny`` (a 2-layer model) to check that the script works.

Usage::

    python -m benchmarks.gpu_step --compare 512 --grow 16384 65536 262144
    python -m benchmarks.gpu_step --tiny --compare 64 --grow 128 256   # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import bert, common

GIB = 2**30
VARIANTS = ("gc_jax", "full batch", "per-layer remat")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--compare", type=int, help="batch for gc_jax vs full batch vs remat")
    p.add_argument("--grow", type=int, nargs="*", default=[], help="gc_jax batches, growing")
    p.add_argument("--compile-only", type=int, nargs="*", default=[])
    p.add_argument("--compile-variants", nargs="+", default=["gc_jax"], choices=VARIANTS)
    p.add_argument("--attention", default="xla", choices=bert.ATTENTION)
    p.add_argument("--buffers", type=int, default=0, help="--compile-only: N largest temp shapes")
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


def memory_stats() -> dict:
    """The device's peak bytes in use and the allocator's limit (None on a CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return {"peak_bytes": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit")}


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
            **memory_stats(), "device": str(jax.devices()[0].device_kind),
        }), flush=True)  # fmt: skip
        if time.perf_counter() - start > args.budget_s:
            break


def run_child(args: argparse.Namespace, variant: str, batches: list[int], timeout: float) -> list:
    cmd = [sys.executable, "-m", "benchmarks.gpu_step", "--worker", variant,
           "--batches", *map(str, batches), "--chunk", str(args.chunk),
           "--grow-chunk", str(args.grow_chunk), "--block", str(args.block),
           "--steps", str(args.steps), "--budget-s", str(args.budget_s),
           "--attention", args.attention, "--compile-variants", *args.compile_variants,
           "--buffers", str(args.buffers),
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
    for r in rows if variant != "compile" else []:
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


def compile_only(args: argparse.Namespace, cfg: bert.BertConfig) -> None:
    """Child process: compiled memory of each variant at each batch; one JSON line each."""
    params = bert.abstract_params(cfg)
    for variant in args.compile_variants:
        step = bert.steps(cfg, args.chunk, args.block)[variant]
        for rows in args.batches:
            q = bert.abstract_batch(cfg, rows, cfg.query_len)
            p = bert.abstract_batch(cfg, rows, cfg.passage_len)
            with tempfile.TemporaryDirectory() as dump:
                options = {"xla_dump_to": dump} if args.buffers else None
                m = jax.jit(step).lower(params, q, p).compile(options).memory_analysis()
                largest = temp_shapes(dump)[: args.buffers] if args.buffers else []
            total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
            print(json.dumps({"variant": variant, "batch": rows, "chunk": args.chunk,
                              "total_bytes": total, "temp_bytes": m.temp_size_in_bytes,
                              "argument_bytes": m.argument_size_in_bytes,
                              "output_bytes": m.output_size_in_bytes,
                              "device": jax.devices()[0].device_kind,
                              "largest_temp_shapes": largest}), flush=True)  # fmt: skip


_VALUE = re.compile(r"value: <\d+ \S+ @\d+> \(size=(\d+),offset=(\d+)\): (\S+?)\{")


def temp_shapes(dump: str) -> list[tuple[str, int, int]]:
    """``(shape, bytes, values)`` per shape in the buffer assignment's temp allocation,
    largest first: the bytes of the union of the ranges its values occupy (values of one
    shape that reuse the same bytes count once; ranges shared by shapes count for each)."""
    found = glob.glob(f"{dump}/*after_optimizations-buffer-assignment.txt")
    text = Path(found[0]).read_text() if found else ""
    temp = re.search(r"^allocation \d+: size \d+,[^\n]*preallocated-temp:\n((?: value:.*\n)*)",
                     text, re.M)  # fmt: skip
    ranges: dict[str, list[tuple[int, int]]] = {}
    for size, offset, shape in _VALUE.findall(temp[1] if temp else ""):
        ranges.setdefault(shape, []).append((int(offset), int(offset) + int(size)))
    out = []
    for shape, spans in ranges.items():
        covered, end = 0, -1
        for a, b in sorted(spans):
            covered += max(0, b - max(a, end))
            end = max(end, b)
        out.append((shape, covered, len(spans)))
    return sorted(out, key=lambda x: -x[1])


def show_compiled(rows: list) -> None:
    for r in rows:
        sizes = (r[f"{k}_bytes"] / GIB for k in ("argument", "temp", "output", "total"))
        chunk = f" chunk {r['chunk']}" if r["variant"] == "gc_jax" else ""
        print("  compiled {} B={}{}: args {:.2f} GiB, temp {:.2f}, outputs {:.2f}, total {:.2f} "
              "GiB".format(r["variant"], r["batch"], chunk, *sizes), flush=True)  # fmt: skip
        for shape, size, count in r.get("largest_temp_shapes", []):
            print(f"    {size / 2**20:10.1f} MiB  {shape} ({count} values)")
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        if len(mine) >= 2:
            a, b = mine[-2], mine[-1]
            per_row = (b["total_bytes"] - a["total_bytes"]) / (b["batch"] - a["batch"])
            print(
                f"  {variant}: {per_row / 2**20:.2f} MiB per row (B={a['batch']} to {b['batch']})"
            )


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = bert.TINY if args.tiny else bert.BertConfig()
    cfg = dataclasses.replace(cfg, attention=args.attention)
    if args.worker == "compile":
        return compile_only(args, cfg)
    if args.worker:
        return worker(args, cfg)
    # No jax.devices() here: the device is the children's (each row names it).
    print(f"JAX {jax.__version__}; {cfg.describe()}; blockwise loss block {args.block}", flush=True)
    results: dict = {}
    if args.compile_only:
        results["compile_only"] = run_child(args, "compile", args.compile_only, args.budget_s)
        show_compiled(results["compile_only"])
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
