"""Compiled memory of one training step of a BERT-base dual encoder, batch 2^12 to 2^20.

Nothing is executed: every step is jitted, lowered with ``ShapeDtypeStruct``s and
compiled, and XLA's ``memory_analysis()`` gives the bytes of its arguments
(parameters and the batch), temporaries and outputs (loss and gradients).

The model (``benchmarks/bert.py``): two BERT-base towers (12 layers, width 768,
float32 parameters, bfloat16 compute), queries of 32 tokens and passages of 128,
one passage per query, InfoNCE with the blockwise loss (``block_size=4096``).

Per-row bytes are the growth of the total from the second-largest to the largest
batch, divided by the rows added. The *floor* is what any exact step must hold per
row: the token ids and masks (``(32 + 128) x (4 + 1)`` bytes) plus, for both towers,
the bfloat16 representation and its bfloat16 gradient (``4 x 768 x 2`` bytes). The
*in-place floor* has three such rows, not four: the blockwise loss writes the second
tower's gradient over its cache.

``--platform tpu`` compiles for one TPU v5e chip with the real TPU compiler, compile
only (libtpu's topology devices; no TPU needed): the chip offers 15.75 GiB, and a step
that does not fit fails to compile (recorded as such, with the compiler's figure).

Usage::

    python -m benchmarks.extreme_batch                 # gc_jax 2^12..2^20, baselines to 2^16
    python -m benchmarks.extreme_batch --quick         # a tiny model, seconds
    python -m benchmarks.extreme_batch --platform tpu --log2-batches 20 21 --baseline-max-log2 0
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import bert, common

GIB, KIB = 2**30, 2**10
LIMIT = 16 * GIB  # one TPU v5e chip's HBM
TPU_LIMIT = int(15.75 * GIB)  # what a v5e chip offers to programs (the TPU compiler's limit)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--log2-batches", type=int, nargs="+", default=[12, 14, 16, 18, 20])
    p.add_argument(
        "--baseline-max-log2",
        type=int,
        default=16,
        help="largest log2 batch compiled for the full-batch baselines",
    )
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--json", type=Path, help="write the table as JSON here")
    p.add_argument("--quick", action="store_true", help="a tiny model and batches")
    p.add_argument("--layers", type=int, default=12, help="layers per tower (a cheaper proxy)")
    p.add_argument(
        "--platform",
        choices=["cpu", "tpu"],
        default="cpu",
        help="cpu: this machine's XLA:CPU; tpu: one v5e chip, compile only (needs libtpu)",
    )
    return p.parse_args(argv)  # fmt: skip


def floor_per_row(cfg: bert.BertConfig, rows_of_reps: int = 4) -> int:
    """Bytes per row: the inputs plus ``rows_of_reps`` bfloat16 representation rows.

    4: both towers' representations and their gradients (issue 9's floor); 3: the
    second tower's gradient written over its cache (what gc_jax's blockwise loss does).
    """
    inputs = (cfg.query_len + cfg.passage_len) * (4 + 1)
    reps = rows_of_reps * cfg.width * jnp.dtype(cfg.compute_dtype).itemsize
    return inputs + reps


def v5e_chip() -> jax.Device:
    """One TPU v5e chip, compile only: the real TPU compiler, no TPU needed."""
    (device,) = common.tpu_devices("v5e:1x1")
    return device


def _does_not_fit(err: Exception, start: float) -> dict:
    """The TPU compiler's out-of-memory error, as a row: its temporaries' figure."""
    if (found := common.out_of_memory(err)) is None:
        raise err
    return {"arguments": 0, "temp": int(found[0]), "outputs": 0, "aliased": 0,
            "total": None, "compile_s": time.perf_counter() - start, "oom": True}  # fmt: skip


def analyse(step, params, queries, passages, dump: bool = False) -> dict:
    """Compiled memory of ``step``; with ``dump``, also what the buffer assignment allocates."""
    start = time.perf_counter()
    lowered = jax.jit(step).lower(params, queries, passages)
    try:
        compiled, allocated = (
            common.compile_with_allocation(lowered) if dump else (lowered.compile(), None)
        )
    except jax.errors.JaxRuntimeError as err:
        return _does_not_fit(err, start)
    m = compiled.memory_analysis()
    sizes = {
        "arguments": m.argument_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
        "total": common.total_bytes(m),
    }
    if allocated is not None:  # what the chip would hold: the allocated temp instead
        sizes["allocated_total"] = sizes["total"] - sizes["temp"] + allocated
    sizes["compile_s"] = time.perf_counter() - start
    return sizes


def fixed_overhead_bound(cfg: bert.BertConfig, chunk: int, device=None) -> tuple[int, int]:
    """Temp bytes of one chunk's VJP of the biggest tower (compiled alone), and the bound.

    The bound on the step's temp memory at a small batch: that VJP plus two buffers
    the size of all the step's parameters (the accumulator and one chunk's
    gradient), +10 %.
    """
    params = common.on_device(device, bert.abstract_params(cfg))
    tower = bert.passage_tower(cfg)  # passages are the longer input
    batch = common.on_device(device, bert.abstract_batch(cfg, chunk, cfg.passage_len))
    ct = common.on_device(device, jax.ShapeDtypeStruct((chunk, cfg.width), cfg.compute_dtype))
    vjp = lambda p, x, ct: jax.vjp(lambda p: tower(p, x, None), p)[1](ct)
    one = jax.jit(vjp).lower(params, batch, ct).compile().memory_analysis().temp_size_in_bytes
    return one, int(1.1 * (one + 2 * common.nbytes(params)))


def run(cfg: bert.BertConfig, args: argparse.Namespace, device=None, limit=LIMIT) -> dict:
    params = common.on_device(device, bert.abstract_params(cfg))
    variants = bert.steps(cfg, args.chunk, args.block)
    results: dict = {name: {} for name in variants}
    for log2 in args.log2_batches:
        rows = 2**log2
        q = common.on_device(device, bert.abstract_batch(cfg, rows, cfg.query_len))
        p = common.on_device(device, bert.abstract_batch(cfg, rows, cfg.passage_len))
        for name, step in variants.items():
            if name != "gc_jax" and log2 > args.baseline_max_log2:
                continue
            results[name][rows] = analyse(step, params, q, p, dump=device is not None)
            r = results[name][rows]
            allocated = r.get("allocated_total")
            allocated = "" if allocated is None else f"; allocated {allocated / GIB:.2f} GiB"
            if r.get("oom"):
                print(f"  {name:16s} B=2^{log2:<2d} does not fit: the TPU compiler's HLO "
                      f"temporaries {r['temp'] / GIB:.2f} GiB > 15.75 GiB", flush=True)  # fmt: skip
                continue
            print(
                f"  {name:16s} B=2^{log2:<2d} args {r['arguments'] / GIB:7.2f} GiB  temp "
                f"{r['temp'] / GIB:7.2f}  out {r['outputs'] / GIB:5.2f}  total "
                f"{r['total'] / GIB:7.2f} GiB{'  > limit' if r['total'] > limit else ''}"
                f"{allocated}  (compiled in {r['compile_s']:.0f} s)",
                flush=True,
            )
    return results


def per_row(sizes: dict, key: str = "total") -> float | None:
    rows = sorted(r for r, v in sizes.items() if v.get(key) is not None)
    if len(rows) < 2:
        return None
    a, b = rows[-2], rows[-1]
    return (sizes[b][key] - sizes[a][key]) / (b - a)


def report(cfg: bert.BertConfig, args: argparse.Namespace, results: dict, limit: int) -> None:
    floor, in_place = floor_per_row(cfg), floor_per_row(cfg, 3)
    print(f"\nfloor: {floor} B per row ({floor / KIB:.2f} KiB); with the second tower's")
    print(f"gradient written over its cache: {in_place} B ({in_place / KIB:.2f} KiB)")
    print(f"\n| variant | batch | arguments GiB | temp GiB | outputs GiB | total GiB "
          f"| <= {limit / GIB:.2f} GiB |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, sizes in results.items():
        for rows, r in sorted(sizes.items()):
            if r["total"] is None:
                print(f"| {name} | 2^{rows.bit_length() - 1} | | {r['temp'] / GIB:.2f} (compiler) "
                      "| | | no (fails to compile) |")  # fmt: skip
                continue
            print(
                f"| {name} | 2^{rows.bit_length() - 1} | {r['arguments'] / GIB:.2f} | "
                f"{r['temp'] / GIB:.2f} | {r['outputs'] / GIB:.2f} | {r['total'] / GIB:.2f} | "
                f"{'yes' if r['total'] <= limit else 'no'} |"
            )
    print("\n| variant | per-row bytes (last two batches) | vs floor | vs in-place floor |")
    print("|---|---:|---:|---:|")
    for name, sizes in results.items():
        for key, label in (("total", ""), ("allocated_total", ", allocated")):
            growth = per_row(sizes, key)
            if growth is not None:
                print(
                    f"| {name}{label} | {growth:,.0f} ({growth / KIB:.2f} KiB) | "
                    f"{growth / floor:.3f} | {growth / in_place:.3f} |"
                )


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = bert.BertConfig(layers=args.layers)
    if args.quick:
        cfg = bert.TINY
        args.log2_batches, args.baseline_max_log2, args.chunk, args.block = [8, 10], 10, 16, 128
    device, limit = (v5e_chip(), TPU_LIMIT) if args.platform == "tpu" else (None, LIMIT)
    target = "one TPU v5e chip (TPU compiler)" if device else f"backend {jax.default_backend()}"
    print(f"JAX {jax.__version__}, {target}; {cfg.describe()}")
    print(f"gc_jax chunk {args.chunk}, blockwise loss block {args.block}; compile only")
    one, bound = fixed_overhead_bound(cfg, args.chunk, device)
    print(
        f"one chunk's VJP of the passage tower (compiled alone): temp {one / GIB:.2f} GiB; "
        f"fixed-overhead bound (that + 2 parameter-sized buffers, +10 %): {bound / GIB:.2f} GiB"
    )
    results = run(cfg, args, device, limit)
    report(cfg, args, results, limit)
    smallest = min(results["gc_jax"])
    temp = results["gc_jax"][smallest]["temp"]
    print(
        f"\ngc_jax temp at B={smallest}: {temp / GIB:.2f} GiB "
        f"({'within' if temp <= bound else 'ABOVE'} the fixed-overhead bound {bound / GIB:.2f} GiB)"
    )
    if args.json:
        table = {k: {str(r): v for r, v in s.items()} for k, s in results.items()}
        out = {"config": cfg.describe(), "platform": args.platform, "results": table}
        common.write_json(args.json, out)


if __name__ == "__main__":
    main()
