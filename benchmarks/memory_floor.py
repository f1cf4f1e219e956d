"""What gradient caching's memory floor is made of: compiled temp memory vs inputs, depth, chunk.

With an O(batch) loss (a linear read-out of the representations, so the loss needs
no ``B x B`` logits), ``gc_jax.cached_value_and_grad``'s temp memory at a fixed
batch should be the cache plus about one chunk's activations plus the gradient
accumulator. This script varies the number of inputs (1, 2, 3 batches through one
tied encoder), the depth of the MLP (hence the parameter count) and the chunk size,
and prints temp memory next to the parameter size and to one chunk's activations
(the temp memory of a plain full-batch gradient over ``chunk`` rows of one input).
Compiled only, nothing is executed.

Usage::

    python -m benchmarks.memory_floor
    python -m benchmarks.memory_floor --quick
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp

import gc_jax
from benchmarks import common

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--depths", type=int, nargs="+", default=[6, 12, 24])
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 256])
    p.add_argument("--inputs", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.depths, args.chunks, args.inputs, args.batch, args.width = [2], [32], [1, 2], 128, 64
    return args


def readout(params: Any, *reps: jax.Array) -> jax.Array:
    """An O(batch) loss: the mean first coordinate of every input's representations."""
    del params
    return sum(jnp.mean(r[:, 0]) for r in reps)


def temp_mib(fn: Any, params: Any, *shapes: jax.ShapeDtypeStruct) -> float:
    compiled = jax.jit(fn).lower(params, *shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes / MIB


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"machine: {common.machine()}")
    print(f"batch {args.batch} per input, MLP width {args.width}; temp_size_in_bytes in MiB")
    cols = " | ".join(f"{n} input{'s' if n > 1 else ''}" for n in args.inputs)
    print(f"| depth | params MiB | chunk | one chunk's fwd+bwd MiB | {cols} | per extra input |")
    print("|---:|---:|---:|---:|" + "---:|" * (len(args.inputs) + 1))
    for depth in args.depths:
        cfg = common.ModelConfig(depth, args.width, args.width, 128)
        params = common.param_shapes(cfg)
        for chunk in args.chunks:
            rows = jax.ShapeDtypeStruct((chunk, cfg.dim_in), cfg.dtype)
            one_chunk = temp_mib(
                jax.grad(lambda p, x: readout(p, common.encode(p, x))), params, rows
            )
            x = jax.ShapeDtypeStruct((args.batch, cfg.dim_in), cfg.dtype)
            mem = [
                temp_mib(
                    gc_jax.cached_value_and_grad(readout, common.encode, chunk), params, *[x] * n
                )
                for n in args.inputs
            ]
            steps = [
                (b - a) / (m - n)
                for a, b, n, m in zip(mem, mem[1:], args.inputs, args.inputs[1:], strict=False)
            ]
            print(
                f"| {depth} | {common.num_params(cfg) * 4 / MIB:.1f} | {chunk} | {one_chunk:.1f} | "
                + " | ".join(f"{m:.1f}" for m in mem)
                + f" | {', '.join(f'{s:.1f}' for s in steps)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
