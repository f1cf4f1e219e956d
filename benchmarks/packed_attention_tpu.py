"""Does ``gc_jax.packing.attention`` compile for a TPU chip, and what does it cost there?

Compile only (libtpu's compile-only devices, ``jax.experimental.topologies``; nothing
runs): the value and gradient of ``packing.attention`` over a packed chunk of
``--lines`` lines of ``--length`` tokens (``--heads`` heads of ``--head-dim``,
bfloat16), its rows ``--rows`` tokens long, for each ``--implementations``. Prints the
compile time and ``cost_analysis()``'s FLOPs per row length.

The TPU compiler does not count a Pallas kernel's FLOPs: the splash form's figure is
what surrounds the kernel, not the kernel.

Usage::

    python -m benchmarks.packed_attention_tpu --topology v5e:1x1
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from gc_jax import packing


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--topology", default="v5e:1x1")
    p.add_argument("--lines", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rows", type=int, nargs="+", default=[512, 128, 64])
    p.add_argument("--implementations", nargs="+", default=["xla", "splash"])
    return p.parse_args(argv)


def packed_chunk(lines: int, length: int, row: int) -> dict:
    """A chunk of ``lines`` lines, each packed with rows of ``row`` tokens, every token kept."""
    segments = (np.arange(length) // row + 1).astype(np.int32)
    return {
        "attention_mask": np.ones((lines, length), np.int32),
        "segment_ids": np.tile(segments, (lines, 1)),
        "position_ids": np.tile(np.arange(length) % row, (lines, 1)).astype(np.int32),
    }


def compile_one(args, device, implementation: str, row: int) -> dict:
    chunk = packed_chunk(args.lines, args.length, row)

    def total(q, k, v):
        out = packing.attention(q, k, v, chunk, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32))

    shape = (args.lines, args.length, args.heads, args.head_dim)
    spec = common.on_device(device, jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(total, (0, 1, 2))).lower(spec, spec, spec).compile()
    seconds = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"implementation": implementation, "row_tokens": row, "compile_s": seconds,
            "flops": cost.get("flops")}  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    device = common.tpu_devices(args.topology)[0]
    print(f"{args.topology}: {args.lines} lines x {args.length} tokens, {args.heads} heads "
          f"of {args.head_dim}, bfloat16; value and gradient")  # fmt: skip
    for row in args.rows:
        for implementation in args.implementations:
            r = compile_one(args, device, implementation, row)
            print(f"  rows of {row:4d} tokens, {implementation:7s}: {r['flops']:.3e} FLOPs "
                  f"counted, compiled in {r['compile_s']:.1f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
