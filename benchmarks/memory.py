"""Compiled temp memory of one training step vs batch size (nothing is executed).

For every batch size the step ``(params, queries, documents) -> (loss, grads)`` is
jitted, lowered with ``ShapeDtypeStruct``s and compiled; the number reported is
``compiled.memory_analysis().temp_size_in_bytes``: XLA's buffer for everything that
is neither an argument nor an output (activations, logits, the cache, gradients in
flight). Deterministic for a given JAX/XLA version and backend.

Variants (the same InfoNCE loss, ``gc_jax.losses.contrastive_loss``):

* ``full``: plain ``jax.value_and_grad`` over the full batch;
* ``remat``: the same with the whole encoder under ``jax.checkpoint`` (one remat block);
* ``remat_layers``: every hidden layer under ``jax.checkpoint`` instead;
* ``gc``: ``gc_jax.cached_value_and_grad`` with the dense loss;
* ``remat_layers_block``: per-layer remat with the blockwise loss (the strongest
  non-caching baseline here);
* ``gc_block``: ``gc_jax`` with the blockwise loss (``block_size=``).

The blockwise variants are skipped, and reported absent, if ``contrastive_loss``
takes no ``block_size``.

``--floor``: what gc_jax's memory floor is made of. With an O(batch) loss (a linear
read-out of the representations, so no ``B x B`` logits), the temp memory of
``gc_jax.cached_value_and_grad`` at ``--rows`` rows per input should be the cache plus
about one chunk's activations plus the gradient accumulator. It varies the number of
inputs (``--inputs``: 1, 2, 3 batches through one tied encoder), the depth of the MLP
(``--depths``, hence the parameter count) and the chunk (``--chunks``), and prints the
temp memory beside the parameter size and one chunk's activations (the temp memory of
a plain full-batch gradient over ``chunk`` rows of one input).

Usage::

    python -m benchmarks.memory --plot benchmarks/plots/memory_vs_batch.png
    python -m benchmarks.memory --quick
    python -m benchmarks.memory --floor
    python -m benchmarks.memory --floor --quick
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import gc_jax
from benchmarks import common

MIB = 2**20
VARIANTS = ["full", "remat", "remat_layers", "gc", "remat_layers_block", "gc_block"]
LABELS = {
    "full": "full batch (jax.value_and_grad), dense loss",
    "remat": "full batch, whole encoder under jax.checkpoint",
    "remat_layers": "full batch, each layer under jax.checkpoint",
    "gc": "gc_jax, dense loss",
    "remat_layers_block": "full batch, each layer remat, blockwise loss",
    "gc_block": "gc_jax, blockwise loss",
}
STYLES = {
    "full": ("o", "-"),
    "remat": ("s", "-"),
    "remat_layers": ("D", "-"),
    "gc": ("^", "-"),
    "remat_layers_block": ("D", "--"),
    "gc_block": ("^", "--"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    common.add_model_args(p, depth=12)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--block-size", type=int, default=512, help="tile of the blockwise loss")
    p.add_argument(
        "--batches", type=int, nargs="+", default=[256 * 2**i for i in range(9)]
    )  # 256 .. 65536
    p.add_argument("--plot", type=Path, default=None, help="write a log-log PNG here")
    p.add_argument("--json", type=Path, default=None, help="write the raw table here")
    p.add_argument("--quick", action="store_true", help="small model and batches")
    p.add_argument("--floor", action="store_true", help="the floor: inputs, depth, chunk")
    p.add_argument("--depths", type=int, nargs="+", default=[6, 12, 24], help="--floor")
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 256], help="--floor")
    p.add_argument("--inputs", type=int, nargs="+", default=[1, 2, 3], help="--floor")
    p.add_argument("--rows", type=int, default=2048, help="--floor: rows per input")
    args = p.parse_args(argv)
    if args.floor and (args.plot or args.json):
        p.error("--floor prints its table only: no --plot or --json")
    if args.quick and args.floor:
        args.depths, args.chunks, args.inputs, args.rows = [2], [32], [1, 2], 128
        args.width = args.dim_in = 64
    elif args.quick:
        args.depth, args.width, args.dim_in, args.dim_out = 4, 128, 128, 32
        args.chunk, args.block_size, args.batches = 64, 64, [64, 256, 1024]
    return args


def measure(args: argparse.Namespace, cfg: common.ModelConfig) -> dict[str, dict[int, int]]:
    steps = common.make_steps(args.chunk, args.block_size, VARIANTS)
    params = common.param_shapes(cfg)
    table: dict[str, dict[int, int]] = {name: {} for name in steps}
    header = " | ".join(f"{name} MiB" for name in steps)
    print(f"| batch | {header} | cache MiB | dense logits MiB |")
    print("|---:|" + "---:|" * (len(steps) + 2))
    for batch in args.batches:
        start = time.perf_counter()
        for name, step in steps.items():
            table[name][batch] = common.temp_bytes(step, params, batch, cfg.dim_in, cfg.dtype)
        cache = 2 * batch * cfg.dim_out * 4  # the two inputs' float32 representations
        logits = batch * batch * 4
        cells = " | ".join(f"{table[name][batch] / MIB:,.1f}" for name in steps)
        print(
            f"| {batch} | {cells} | {cache / MIB:,.1f} | {logits / MIB:,.1f} |"
            f"  <!-- compiled in {time.perf_counter() - start:.0f}s -->",
            flush=True,
        )
    return table


def plot(path: Path, table: dict[str, dict[int, int]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=120)
    for name, row in table.items():
        batches = sorted(row)
        marker, line = STYLES[name]
        ax.plot(
            batches,
            [row[b] / MIB for b in batches],
            marker=marker,
            linestyle=line,
            label=LABELS[name],
        )
    batches = sorted(next(iter(table.values())))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size B (queries; as many documents)")
    ax.set_ylabel("compiled temp memory (MiB)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    common.save_figure(fig, path)


def readout(params: Any, *reps: jax.Array) -> jax.Array:
    """An O(batch) loss: the mean first coordinate of every input's representations."""
    del params
    return sum(jnp.mean(r[:, 0]) for r in reps)


def temp_mib(fn: Any, params: Any, *shapes: jax.ShapeDtypeStruct) -> float:
    compiled = jax.jit(fn).lower(params, *shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes / MIB


def floor_row(args: argparse.Namespace, depth: int, chunk: int) -> str:
    """One row of the floor's table: ``depth`` layers, ``chunk`` rows a chunk."""
    cfg = common.ModelConfig(depth, args.width, args.dim_in, args.dim_out)
    params = common.param_shapes(cfg)
    rows = jax.ShapeDtypeStruct((chunk, cfg.dim_in), cfg.dtype)
    one_chunk = temp_mib(jax.grad(lambda p, x: readout(p, common.encode(p, x))), params, rows)
    x = jax.ShapeDtypeStruct((args.rows, cfg.dim_in), cfg.dtype)
    step = gc_jax.cached_value_and_grad(readout, common.encode, chunk)
    mem = [temp_mib(step, params, *[x] * n) for n in args.inputs]
    pairs = zip(mem, mem[1:], args.inputs, args.inputs[1:], strict=False)
    steps = [(b - a) / (m - n) for a, b, n, m in pairs]
    return (
        f"| {depth} | {common.num_params(cfg) * 4 / MIB:.1f} | {chunk} | {one_chunk:.1f} | "
        + " | ".join(f"{m:.1f}" for m in mem)
        + f" | {', '.join(f'{s:.1f}' for s in steps)} |"
    )


def floor(args: argparse.Namespace) -> None:
    """``--floor``: gc_jax's temp memory against the inputs, the depth and the chunk."""
    print(f"machine: {common.machine()}")
    print(f"batch {args.rows} per input, MLP width {args.width}; temp_size_in_bytes in MiB")
    cols = " | ".join(f"{n} input{'s' if n > 1 else ''}" for n in args.inputs)
    print(f"| depth | params MiB | chunk | one chunk's fwd+bwd MiB | {cols} | per extra input |")
    print("|---:|---:|---:|---:|" + "---:|" * (len(args.inputs) + 1))
    for depth in args.depths:
        for chunk in args.chunks:
            print(floor_row(args, depth, chunk), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.floor:
        return floor(args)
    cfg = common.model_config(args)
    print(f"machine: {common.machine()}")
    print(f"model: {cfg.describe()}")
    print(f"chunk {args.chunk}, block_size {args.block_size}; temp_size_in_bytes in MiB:")
    if not common.has_block_size():
        print("contrastive_loss has no block_size=: blockwise variants ABSENT")
    table = measure(args, cfg)
    if args.plot:
        title = (
            f"Compiled temp memory of one step, {cfg.depth}-layer MLP width {cfg.width}, "
            f"InfoNCE\n(XLA memory_analysis on {jax.default_backend().upper()}; "
            f"gc_jax chunk {args.chunk}, blockwise tile {args.block_size})"
        )
        plot(args.plot, table, title)
    if args.json:
        common.write_json(args.json, {"model": cfg.describe(), "temp_bytes": table})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
