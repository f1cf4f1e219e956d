"""What contrastive_loss's options cost: compiled temp memory at 65,536 rows, and time.

The options of ``gc_jax.losses.contrastive_loss`` beyond plain InfoNCE: GTE's four
directions (``directions=``, one joint partition function), symmetric InfoNCE
(``partition_mode="per_direction"``), false-negative ids (``query_ids``,
``doc_ids``: 64-bit ids as ``gc_jax.losses.text_ids`` makes), GISTEmbed's guide
(``guide=``, its rows ``--guide-dim`` wide) and all of them at once. For each, the
blockwise loss's value and gradient (``block_size``) is compiled from shapes
(never run) at ``--rows`` queries of ``--dim`` floats with ``k`` documents per
query, and XLA:CPU's ``memory_analysis().temp_size_in_bytes`` is set beside the
plain blockwise loss's; the largest array anywhere in the compiled program is
reported too (a ``rows x rows`` one would be 4.3e9 elements at 65,536 rows). With
``--time-rows`` each option's step is also run on this CPU at that batch,
interleaved with the plain step (median and range of the time ratio).

Usage::

    python -m benchmarks.loss_options --json benchmarks/results/loss_options.json
    python -m benchmarks.loss_options --quick
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import common
from gc_jax.losses import contrastive_loss

MIB = 2**20
GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
OPTIONS = {  # name: (static options, per-row arrays)
    "plain": ({}, ()),
    "gte": ({"directions": GTE}, ()),
    "per_direction": (
        {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
        (),
    ),
    "ids": ({}, ("query_ids", "doc_ids")),
    "guide": ({"margin": 0.1}, ("guide",)),
    "all": ({"directions": GTE, "margin": 0.1}, ("query_ids", "doc_ids", "guide")),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=65_536)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--guide-dim", type=int, default=128)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--time-rows", type=int, default=4096, help="0: no timing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--quick", action="store_true", help=common.QUICK)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.dim, args.guide_dim, args.block = 2048, 32, 16, 256
        args.ks, args.dtypes, args.time_rows, args.rounds = [1], ["float32"], 512, 2
    return args


def arrays(rows: int, k: int, guide_dim: int, names: tuple, make: Any) -> dict:
    """The options' per-row arrays, made by ``make(shape, dtype)``."""
    out: dict[str, Any] = {}
    if "query_ids" in names:
        out["query_ids"] = make((rows, 2), jnp.uint32)
        out["doc_ids"] = make((rows * k, 2), jnp.uint32)
    if "guide" in names:
        out["guide"] = (make((rows, guide_dim), jnp.float32),
                        make((rows * k, guide_dim), jnp.float32))  # fmt: skip
    return out


def step(name: str, block: int):
    static, _ = OPTIONS[name]

    def loss(x, y, extra):
        return contrastive_loss(x, y, temperature=0.05, block_size=block, **static, **extra)

    return jax.jit(jax.value_and_grad(loss, (0, 1)))


def largest_array(hlo: str) -> int:
    """Elements of the largest array shape in compiled HLO text."""
    sizes = [1]
    for dims in re.findall(r"\b(?:f|bf|s|u|pred)\d*\[([\d,]+)\]", hlo):
        n = 1
        for d in dims.split(","):
            n *= int(d)
        sizes.append(n)
    return max(sizes)


def memory(args: argparse.Namespace) -> list[dict]:
    shape = jax.ShapeDtypeStruct
    out = []
    for dtype in args.dtypes:
        for k in args.ks:
            x = shape((args.rows, args.dim), jnp.dtype(dtype))
            y = shape((args.rows * k, args.dim), jnp.dtype(dtype))
            plain = None
            for name, (_, names) in OPTIONS.items():
                extra = arrays(args.rows, k, args.guide_dim, names, shape)
                compiled = step(name, args.block).lower(x, y, extra).compile()
                temp = compiled.memory_analysis().temp_size_in_bytes
                plain = temp if name == "plain" else plain
                largest = largest_array(compiled.as_text())
                row = {"option": name, "dtype": dtype, "k": k, "temp_bytes": temp,
                       "vs_plain": temp / plain, "largest_array": largest}  # fmt: skip
                out.append(row)
                print(f"| {name} | {dtype} | {k} | {temp / MIB:.2f} | {temp / plain:.3f} | "
                      f"{row['largest_array']:.3g} |", flush=True)  # fmt: skip
    return out


def timing(args: argparse.Namespace) -> list[dict]:
    keys = iter(jax.random.split(jax.random.key(0), 32))

    def make(shape, dtype):
        if jnp.issubdtype(dtype, jnp.integer):  # ids with duplicates
            return jax.random.randint(next(keys), shape, 0, shape[0] // 2).astype(dtype)
        v = jax.random.normal(next(keys), shape, dtype)
        return v / jnp.linalg.norm(v, axis=-1, keepdims=True)

    rows, k = args.time_rows, 1
    x, y = make((rows, args.dim), jnp.float32), make((rows * k, args.dim), jnp.float32)
    fns = {}
    for name, (_, names) in OPTIONS.items():
        fns[name] = functools.partial(step(name, args.block), x, y,
                                      arrays(rows, k, args.guide_dim, names, make))  # fmt: skip
    wall = common.interleaved_times(fns, (), reps=args.rounds).wall
    out = []
    for name in OPTIONS:
        med, lo, hi = common.ratio_range(wall[name], wall["plain"])
        out.append({"option": name, "rows": rows, "median_s": common.median(wall[name]),
                    "vs_plain": med, "vs_plain_range": [lo, hi]})  # fmt: skip
        print(f"| {name} | {common.median(wall[name]):.3f} | {med:.2f} ({lo:.2f}-{hi:.2f}) |",
              flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"machine: {common.machine()}")
    print(f"\n{args.rows} queries of {args.dim} floats, k documents each, block {args.block}, "
          f"guide {args.guide_dim} wide; value and gradient of x and y, compiled only")  # fmt: skip
    print("| option | dtype | k | temp MiB | vs plain | largest array (elements) |")
    print("|---|---|---:|---:|---:|---:|")
    result: dict[str, Any] = {"command": common.command("loss_options", sys.argv[1:]),
                              "machine": common.machine(), "args": vars(args)}  # fmt: skip
    result["memory"] = memory(args)
    if args.time_rows:
        print(f"\nstep time at {args.time_rows} rows (k = 1), {args.rounds} interleaved rounds")
        print("| option | median s | vs plain: median (range) |")
        print("|---|---:|---:|")
        result["time"] = timing(args)
    if args.json:
        common.write_json(common.ROOT / args.json, result)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
