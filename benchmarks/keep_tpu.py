"""Keep what fits on one TPU v5e chip, compile only: the plan ``gc_jax.plan_step`` chooses.

Nothing runs on a TPU: libtpu compiles for a compile-only v5e chip
(``jax.experimental.topologies``), as ``benchmarks/tpu_compile.py`` does, for the
BERT-base dual encoder of ``benchmarks/bert.py`` (queries of 32 tokens, passages of
128, bfloat16 compute, blockwise InfoNCE). At ``--multiples`` times the plain step's
largest batch on that chip (``--plain-batch``: 768 rows, docs/benchmarks/largest_batch.md),
``gc_jax.plan_step(..., by="flops")`` picks the chunk size (``--chunks``) and the most
chunks kept that fit the chip (its fit: ``memory_analysis()`` within the HBM the
compiler offers, which on libtpu over-counts, so the plan is conservative). Reported
per batch: the plan, its buffer-assignment bytes (what the chip holds) against
today's default (``keep=None``, the same chunk size), and the forward FLOPs each
re-encodes: per tower, the chunks not kept times one chunk's forward FLOPs (the
compiler's cost analysis of the tower on one chunk, which has no loop).

Usage (about 2-6 min per BERT-base compile on 2 cores; about 10 compiles per batch)::

    python -m benchmarks.keep_tpu --json benchmarks/results/keep_tpu_v5e.json
    python -m benchmarks.keep_tpu --multiples 2 --chunks 256
    python -m benchmarks.keep_tpu --multiples 2 --keep 2   # no search: that plan's bytes
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several compile-only users

import jax

import gc_jax
from benchmarks import bert, common

GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--plain-batch", type=int, default=768, help="plain step's largest batch")
    p.add_argument("--multiples", type=int, nargs="+", default=[2, 4])
    p.add_argument("--chunks", type=int, nargs="+", default=[256], help="chunk sizes to plan")
    p.add_argument("--block", type=int, default=4096, help="tile of the blockwise loss")
    p.add_argument("--keep", type=int, default=None,
                   help="no plan search: this keep against today's (first --chunks)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def args_on(device, cfg: bert.BertConfig, rows: int) -> tuple:
    params = common.on_device(device, bert.abstract_params(cfg))
    q = common.on_device(device, bert.abstract_batch(cfg, rows, cfg.query_len))
    p = common.on_device(device, bert.abstract_batch(cfg, rows, cfg.passage_len))
    return params, q, p


def forward_flops(device, cfg: bert.BertConfig, chunk: int) -> list[float]:
    """One chunk's forward FLOPs of each tower (no loop: the cost analysis is exact)."""
    params = common.on_device(device, bert.abstract_params(cfg))
    out = []
    for tower, length in ((bert.query_tower(cfg), cfg.query_len),
                          (bert.passage_tower(cfg), cfg.passage_len)):  # fmt: skip
        x = common.on_device(device, bert.abstract_batch(cfg, chunk, length))
        cost = jax.jit(tower).lower(params, x, None).compile().cost_analysis()
        out.append(float((cost[0] if isinstance(cost, list | tuple) else cost)["flops"]))
    return out


def reencoded(rows: int, chunk: int, keep: int | None, flops: list[float]) -> float:
    """Forward FLOPs pass 2 re-encodes: each tower's chunks not kept (the last tower's
    kept first; ``keep=None``: the last chunk, as the default keeps)."""
    n = -(-rows // chunk)
    left = 1 if keep is None else keep
    total = 0.0
    for f in reversed(flops):
        kept = min(left, n)
        left -= kept
        total += (n - kept) * f  # a short last chunk counted whole: rows divide here
    return total


def one_batch(args, cfg, device, rows: int) -> dict:
    loss = bert.loss_fn(args.block)
    towers = [bert.query_tower(cfg), bert.passage_tower(cfg)]
    make = lambda c, k: gc_jax.cached_value_and_grad(loss, towers, c, keep=k)
    shapes = args_on(device, cfg, rows)
    tick = time.perf_counter()
    if args.keep is None:
        plan = gc_jax.plan_step(make, shapes, args.chunks, device=device, by="flops")
    else:  # no search: the given keep at the first chunk size (two towers' chunks)
        size = args.chunks[0]
        plan = gc_jax.StepPlan(size, args.keep, None, None, None, None, None,
                               2 * -(-rows // size), ())  # fmt: skip
    took = time.perf_counter() - tick
    allocated = {}
    for name, step in (("plan", make(plan.chunk_size, plan.keep)),
                       ("today", make(plan.chunk_size, None))):  # fmt: skip
        compiled, temp = common.compile_with_allocation(jax.jit(step).lower(*shapes))
        m = compiled.memory_analysis()
        allocated[name] = common.total_bytes(m) - m.temp_size_in_bytes + temp
    flops = forward_flops(device, cfg, plan.chunk_size)
    return {
        "rows": rows, "chunk_size": plan.chunk_size, "keep": plan.keep, "chunks": plan.chunks,
        "memory_analysis_bytes": plan.bytes, "allocated": allocated, "plan_s": took,
        "reencoded_flops": {"plan": reencoded(rows, plan.chunk_size, plan.keep, flops),
                            "today": reencoded(rows, plan.chunk_size, None, flops)},
        "chunk_forward_flops": flops, "tried": [list(map(str, t)) for t in plan.tried],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
    logging.getLogger("gc_jax").setLevel(logging.INFO)
    cfg = bert.BertConfig()
    (device,) = common.tpu_devices("v5e:1x1", "default")
    print(common.machine())
    print(common.command("keep_tpu", sys.argv[1:] if argv is None else argv), flush=True)
    results = []
    for m in args.multiples:
        results.append(one_batch(args, cfg, device, m * args.plain_batch))
        r = results[-1]
        print(f"| {m}x = {r['rows']:,} | chunk {r['chunk_size']}, keep {r['keep']} of "
              f"{r['chunks']} | {r['allocated']['plan'] / GIB:.2f} GiB (today "
              f"{r['allocated']['today'] / GIB:.2f}) | re-encoded forward "
              f"{r['reencoded_flops']['plan']:.3e} FLOPs (today "
              f"{r['reencoded_flops']['today']:.3e}) |", flush=True)  # fmt: skip
        if args.json:
            common.write_json(args.json, {"machine": common.machine(), "results": results})


if __name__ == "__main__":
    main()
