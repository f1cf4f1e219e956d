"""The largest BERT-base dual-encoder batch that fits one TPU chip, by the TPU compiler.

Nothing runs on a TPU: libtpu (``pip install -e ".[tpu]"``) compiles for compile-only
devices of a real topology (``jax.experimental.topologies``) on this CPU machine. A
step that does not fit fails at ``.compile()`` with ``RESOURCE_EXHAUSTED`` (its
message gives the temporaries it would need); a step that compiles fits when what its
buffer assignment allocates (arguments + allocated temporaries + outputs, read from an
XLA dump: what the chip holds, and what the compiler's own check follows) is at most
the HBM the compiler offers a program on that chip (read from the same error message).
``memory_analysis()``'s total is recorded too: on the TPU compiler its temporaries can
exceed the allocation by whole batch-sized buffers (docs/benchmarks/largest_batch.md).

The model is ``benchmarks/bert.py``'s: two BERT-base towers (12 x 768, float32
parameters, bfloat16 compute), queries of 32 tokens and passages of 128, InfoNCE with
the blockwise loss (``block_size=4096``). Modes, each ``(loss, grads)`` of the same loss:

* ``full``: plain ``jax.value_and_grad`` over the whole batch;
* ``remat``: the same with every Transformer block under ``jax.checkpoint``;
* ``gc_f32``: ``gc_jax.cached_value_and_grad``, chunk 32, ``cache_dtype=float32``;
* ``gc_bf16``: the same with the encoder's own bfloat16 cache (gc_jax's default).

Search: batches lie on a grid of powers of two and their halfway points
(1, 2, 3, 4, 6, 8, 12, 16, 24, ...): resolution a factor 1.5 or 1.33. Memory is affine
in the batch, so two compiles (fitting or not: a failed compile's message still gives
its temporaries) predict the boundary; then the grid points around it are compiled
until a fitting batch and the next grid point that does not fit are both measured.
Per-row bytes are the slope of the affine fit of the allocated totals between the two
largest batches that compiled (when only the largest fit compiled, half of it is
compiled too); the fixed part is its value at batch 0. The table prints them for
gc_jax only: near the HBM limit the compiler rematerialises the baselines by itself,
so their memory is not affine in the batch there.

Results are written to ``--json`` after every compile, merged into what the file
already holds (so chips and modes can be re-run one at a time).

Usage (one command per chip; about 2-3 min per BERT-base compile on 2 cores)::

    python -m benchmarks.tpu_compile --chips v5e
    python -m benchmarks.tpu_compile --chips v6e v4 v5p --modes gc_bf16 gc_f32
    python -m benchmarks.tpu_compile --quick --budget-gib 0.05   # a tiny model, seconds
    python -m benchmarks.tpu_compile --chips v5p --modes gc_bf16 --start 16777216 25165824
"""

from __future__ import annotations

import argparse
import json
import os
import time
from importlib import metadata
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several compile-only users

import jax
import jax.numpy as jnp

import gc_jax
from benchmarks import bert, common

GIB, KIB = 2**30, 2**10
RESULTS = common.RESULTS / "tpu_compile.json"
# One chip each: (topology, chip config). v4 and v5p run their two cores as one device.
CHIPS = {
    "v5e": ("v5e:1x1", "default"),
    "v6e": ("v6e:1x1", "default"),
    "v4": ("v4:1x1x1", "megacore"),
    "v5p": ("v5:1x1x1", "megacore"),
}
MODES = ("full", "remat", "gc_f32", "gc_bf16")
# Where each mode's search starts (two batches): near a v5e chip's boundary, as earlier
# runs of this script put it.
START = {"full": (512, 768), "remat": (2048, 3072), "gc_f32": (2**20, 3 * 2**19),
         "gc_bf16": (2**21, 3 * 2**20)}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chips", nargs="+", choices=list(CHIPS), default=list(CHIPS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--json", type=Path, default=RESULTS)
    p.add_argument("--budget-gib", type=float, help="fit below this instead of the chip's HBM")
    p.add_argument("--quick", action="store_true", help="a tiny model (checks the search)")
    p.add_argument(
        "--start",
        nargs=2,
        type=int,
        metavar="ROWS",
        help="the two batches the search compiles first (default: near v5e's)",
    )
    return p.parse_args(argv)  # fmt: skip


def grid(i: int) -> int:
    """The ``i``-th grid point: 2^(i/2) for even ``i``, 3 * 2^((i-3)/2) for odd."""
    return 2 ** (i // 2) if i % 2 == 0 else 3 * 2 ** ((i - 3) // 2)


def grid_floor(rows: float) -> int:
    """The index of the largest grid point at most ``rows``."""
    i = 0
    while grid(i + 1) <= rows:
        i += 1
    return i


def modes(cfg: bert.BertConfig, chunk: int, block: int) -> dict:
    loss = bert.loss_fn(block)
    encoders = [bert.query_tower(cfg), bert.passage_tower(cfg)]
    base = bert.steps(cfg, chunk, block)
    return {
        "full": base["full batch"],
        "remat": base["per-layer remat"],
        "gc_f32": gc_jax.cached_value_and_grad(loss, encoders, chunk, cache_dtype=jnp.float32),
        "gc_bf16": gc_jax.cached_value_and_grad(loss, encoders, chunk),
    }


def compile_at(step, cfg, device, rows: int, budget: float | None) -> dict:
    """Compile ``step`` at ``rows`` for ``device``; sizes, compile time and whether it fits."""
    params = common.on_device(device, bert.abstract_params(cfg))
    q = common.on_device(device, bert.abstract_batch(cfg, rows, cfg.query_len))
    p = common.on_device(device, bert.abstract_batch(cfg, rows, cfg.passage_len))
    args = common.nbytes((params, q, p))
    outs = 4 + common.nbytes(params)  # loss + float32 gradients
    start = time.perf_counter()
    try:
        compiled, allocated = common.compile_with_allocation(jax.jit(step).lower(params, q, p))
    except jax.errors.JaxRuntimeError as e:
        if (found := common.out_of_memory(e)) is None:
            raise
        temp, hbm = found
        return {"fits": False, "compiled": False, "temp": temp, "total": args + temp + outs,
                "allocated_total": args + temp, "hbm": hbm,
                "compile_s": time.perf_counter() - start}  # fmt: skip
    m = compiled.memory_analysis()
    total = common.total_bytes(m)
    allocated_total = total - m.temp_size_in_bytes + allocated
    # The compiler refuses a program that does not fit its HBM (RESOURCE_EXHAUSTED); its
    # check follows the buffer assignment (allocated), not memory_analysis' temp, which
    # on the TPU compiler can exceed it by whole batch-sized buffers
    # (docs/benchmarks/largest_batch.md).
    fits = budget is None or allocated_total <= budget
    took = time.perf_counter() - start
    return {"fits": fits, "compiled": True, "temp": m.temp_size_in_bytes, "total": total,
            "allocated_total": allocated_total, "compile_s": took}  # fmt: skip


def affine(points: dict[int, dict]) -> tuple[float, float]:
    """(fixed bytes, bytes per row) through the two largest batches measured."""
    (a, ra), (b, rb) = sorted(points.items())[-2:]
    size = lambda r: r.get("allocated_total", r["total"])  # what the chip holds
    slope = (size(rb) - size(ra)) / (b - a)
    return size(ra) - slope * a, slope


def search(probe, start: tuple[int, int], limit: float) -> dict:
    """Compile grid batches until a fit and the next grid point's no-fit are both known."""
    seen = {grid_floor(r): probe(grid(grid_floor(r))) for r in start}  # by grid index
    while True:
        lo = max((i for i in seen if seen[i]["fits"]), default=-1)
        hi = min((i for i in seen if not seen[i]["fits"] and i > lo), default=None)
        if hi == lo + 1:
            break
        fixed, slope = affine({grid(i): seen[i] for i in seen})
        guess = grid_floor((limit - fixed) / slope) if slope > 0 else lo + 2
        guess = max(guess, lo + 1)  # every index strictly between lo and hi is unseen
        guess = guess if hi is None else min(guess, hi - 1)
        seen[guess] = probe(grid(guess))
    if sum(r["compiled"] for r in seen.values()) < 2 and lo >= 2:  # for bytes per row
        seen[lo - 2] = probe(grid(lo - 2))  # half the largest fit
    # Reported: the fit through compiled batches only (a refused compile's figure is the
    # compiler's temporaries + arguments, a different measure); None with fewer than 2.
    compiled = {grid(i): seen[i] for i in seen if seen[i]["compiled"]}
    fixed, slope = affine(compiled) if len(compiled) >= 2 else (None, None)
    return {"largest_fit": grid(lo) if lo >= 0 else None, "first_no_fit": grid(hi),
            "per_row_bytes": slope, "fixed_bytes": fixed,
            "compiles": {str(grid(i)): seen[i] for i in sorted(seen)}}  # fmt: skip


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def topology_device(chip: str) -> jax.Device:
    (device,) = common.tpu_devices(*CHIPS[chip])
    return device


def save_live(args, table: dict, entry: dict, mode: str, compiles: dict) -> None:
    entry["modes"][mode] = {"compiles": compiles, "complete": False}
    common.write_json(args.json, table)


def measure(args, cfg, mode: str, step, device, limit: float, on_compile) -> dict:
    """Search one chip and mode; ``on_compile(compiles so far)`` after every compile."""
    live: dict = {}

    def probe(rows):
        r = live[str(rows)] = compile_at(step, cfg, device, rows, limit)
        on_compile(live)
        fits = "fits" if r["fits"] else "no fit"
        print(f"    B={rows:>9,d}  allocated {r['allocated_total'] / GIB:7.2f} GiB  "
              f"(memory_analysis {r['total'] / GIB:7.2f} GiB)  {fits:6s}"
              f" ({r['compile_s']:.0f} s)", flush=True)  # fmt: skip
        return r

    start = (16, 64) if args.quick else args.start or START[mode]
    return dict(search(probe, start, limit), complete=True)


def run(args: argparse.Namespace, cfg: bert.BertConfig) -> dict:
    table = load(args.json)
    table.update(config=cfg.describe(), chunk=args.chunk, block=args.block,
                 jax=jax.__version__, libtpu=metadata.version("libtpu"))  # fmt: skip
    steps = modes(cfg, args.chunk, args.block)
    for chip in args.chips:
        device = topology_device(chip)
        hbm = gc_jax.device_memory(device)  # what the compiler offers a program
        limit = args.budget_gib * GIB if args.budget_gib else hbm
        entry = table.setdefault("chips", {}).setdefault(chip, {"modes": {}})
        entry.update(topology=CHIPS[chip], device_kind=device.device_kind, hbm=hbm, limit=limit)
        print(f"{chip} ({device.device_kind}, {CHIPS[chip]}): {hbm / GIB:.2f} GiB", flush=True)
        for mode in args.modes:
            live = lambda r, m=mode, e=entry: save_live(args, table, e, m, r)
            entry["modes"][mode] = measure(args, cfg, mode, steps[mode], device, limit, live)
            common.write_json(args.json, table)
            print(f"  {chip} {mode}: largest fit {entry['modes'][mode]['largest_fit']}", flush=True)
    return table


def report(table: dict) -> None:
    print(f"\n{table['config']}; gc_jax chunk {table['chunk']}, loss block {table['block']};")
    print(f"JAX {table['jax']}, libtpu {table['libtpu']}; compile only\n")
    print("| chip | HBM for programs | mode | largest batch that fits | next grid batch "
          "(no fit) | bytes per row | fixed GiB | median compile s |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for chip, entry in table.get("chips", {}).items():
        for mode, r in entry["modes"].items():
            if not r.get("complete"):
                continue
            times = sorted(c["compile_s"] for c in r["compiles"].values() if c["compiled"])
            median = times[len(times) // 2] if times else float("nan")
            fit = f"{r['largest_fit']:,}" if r["largest_fit"] else "none"
            compiled = {int(b): c for b, c in r["compiles"].items() if c["compiled"]}
            fixed, slope = affine(compiled) if len(compiled) >= 2 else (None, None)
            if not mode.startswith("gc"):  # the compiler rematerialises near the HBM: not affine
                fixed = slope = None
            per_row = "-" if slope is None else f"{slope:,.0f}"
            fixed = "-" if fixed is None else f"{fixed / GIB:.2f}"
            print(f"| {chip} | {entry['hbm'] / GIB:.2f} GiB | {mode} | {fit} | "
                  f"{r['first_no_fit']:,} | {per_row} | {fixed} | {median:.0f} |")  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = bert.BertConfig()
    if args.quick:
        cfg = bert.TINY
        args.chunk, args.block = 16, 128
    print(f"JAX {jax.__version__}; {cfg.describe()}; chunk {args.chunk}", flush=True)
    report(run(args, cfg))


if __name__ == "__main__":
    main()
