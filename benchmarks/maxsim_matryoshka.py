"""Memory and time of ``gc_jax.losses.maxsim_loss`` and ``gc_jax.losses.matryoshka``.

MaxSim (ColBERT late interaction, InfoNCE over the batch): the compiled temp memory of
the loss's value and gradient (w.r.t. both sides' token vectors) at ``--rows`` rows of
``--tokens`` tokens of ``--dim`` features, blockwise for each ``--blocks`` (compiled,
never run), and of the dense form at ``--dense-rows``; then the step time of the dense
and blockwise forms at ``--time-rows`` rows (interleaved rounds).

Matryoshka: the step time and temp memory of ``matryoshka(contrastive_loss, dims)``
against ``contrastive_loss`` at full width (value and gradient w.r.t. both sides,
blockwise), at ``--mrl-rows`` rows of ``--mrl-dims[0]`` features.

Usage (from the repository root)::

    python -m benchmarks.maxsim_matryoshka           # B = 16,384, T = 32, d = 128
    python -m benchmarks.maxsim_matryoshka --quick   # seconds; numbers meaningless
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import common
from gc_jax.losses import contrastive_loss, matryoshka, maxsim_loss

MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--dense-rows", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--time-rows", type=int, default=256)
    p.add_argument("--mrl-rows", type=int, default=4096)
    p.add_argument("--mrl-dims", type=int, nargs="+", default=[768, 512, 256, 128, 64])
    p.add_argument("--mrl-block", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a sanity run")
    p.add_argument("--json", type=Path, default=common.RESULTS / "maxsim_matryoshka.json")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.tokens, args.dim, args.blocks = [256], 8, 16, [32]
        args.dense_rows, args.time_rows, args.rounds = [64], 64, 2
        args.mrl_rows, args.mrl_dims, args.mrl_block = 256, [64, 32, 16], 64
    return args


def maxsim_grad(block_size: int | None):
    def loss(q, d, q_mask, d_mask):
        return maxsim_loss(
            q, d, q_mask=q_mask, d_mask=d_mask, temperature=0.05, block_size=block_size
        )

    return jax.jit(jax.value_and_grad(loss, (0, 1)))


def maxsim_inputs(rows: int, tokens: int, dim: int, dtype=jnp.float32, key=None):
    """Unit token vectors, ~25% of the document tokens and ~50% of the query tokens masked
    (shapes only without ``key``)."""
    shapes = [(rows, tokens, dim)] * 2
    if key is None:
        masks = [jax.ShapeDtypeStruct((rows, tokens), jnp.bool_)] * 2
        return [jax.ShapeDtypeStruct(s, dtype) for s in shapes] + masks
    kq, kd, kmq, kmd = jax.random.split(key, 4)
    unit = lambda v: (v / jnp.linalg.norm(v, axis=-1, keepdims=True)).astype(dtype)
    q, d = unit(jax.random.normal(kq, shapes[0])), unit(jax.random.normal(kd, shapes[1]))
    q_mask = jax.random.bernoulli(kmq, 0.5, (rows, tokens)).at[:, 0].set(True)
    d_mask = jax.random.bernoulli(kmd, 0.75, (rows, tokens)).at[:, 0].set(True)
    return [q, d, q_mask, d_mask]


def temp_mib(fn, *shapes) -> float:
    return fn.lower(*shapes).compile().memory_analysis().temp_size_in_bytes / MiB


def maxsim_memory(args) -> list[dict]:
    out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for rows in args.rows:
            for block in args.blocks:
                shapes = maxsim_inputs(rows, args.tokens, args.dim, dtype)
                mib = temp_mib(maxsim_grad(block), *shapes)
                out.append({"form": "blockwise", "dtype": jnp.dtype(dtype).name, "rows": rows,
                            "block": block, "temp_mib": mib})  # fmt: skip
                print(f"maxsim blockwise {jnp.dtype(dtype).name:8s} B={rows:6d} block={block:4d}"
                      f"  temp {mib:9.1f} MiB")  # fmt: skip
    for rows in args.dense_rows:
        mib = temp_mib(maxsim_grad(None), *maxsim_inputs(rows, args.tokens, args.dim))
        out.append({"form": "dense", "dtype": "float32", "rows": rows, "temp_mib": mib})
        print(f"maxsim dense     float32  B={rows:6d}             temp {mib:9.1f} MiB")
    return out


def maxsim_speed(args) -> dict:
    inputs = maxsim_inputs(args.time_rows, args.tokens, args.dim, key=jax.random.key(0))
    forms = {"dense": None, **{f"block {b}": b for b in args.blocks if b <= args.time_rows}}
    fns = {name: functools.partial(maxsim_grad(b), *inputs) for name, b in forms.items()}
    times = common.interleaved_times(
        {k: (lambda f=f: f()) for k, f in fns.items()}, (), args.rounds
    )
    out = {}
    for name, wall in times.wall.items():
        out[name] = {"median_s": common.median(wall), "min_s": min(wall), "max_s": max(wall)}
        print(f"maxsim step B={args.time_rows} {name:10s} median {common.median(wall):.3f} s "
              f"(range {min(wall):.3f}-{max(wall):.3f}, {args.rounds} rounds)")  # fmt: skip
    return out


def matryoshka_cost(args) -> dict:
    """Full-width contrastive_loss against matryoshka over ``--mrl-dims`` (blockwise)."""
    rows, width = args.mrl_rows, args.mrl_dims[0]

    def grad(dims, normalize=True):
        loss = functools.partial(contrastive_loss, temperature=0.05, block_size=args.mrl_block)
        loss = loss if dims is None else matryoshka(loss, dims, normalize=normalize)
        return jax.jit(jax.value_and_grad(loss, (0, 1)))

    n, dims = len(args.mrl_dims), tuple(args.mrl_dims)
    grads = {
        "single width": grad(None),
        f"matryoshka {n} widths": grad(dims),
        f"matryoshka {n} widths, normalize=False": grad(dims, normalize=False),
    }
    shape = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    kx, ky = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(kx, (rows, width)), jax.random.normal(ky, (rows, width))
    fns = {k: functools.partial(g, x, y) for k, g in grads.items()}
    times = common.interleaved_times(
        {k: (lambda f=f: f()) for k, f in fns.items()}, (), args.rounds
    )
    out = {}
    for name, g in grads.items():
        wall = times.wall[name]
        out[name] = {"temp_mib": temp_mib(g, shape, shape), "median_s": common.median(wall),
                     "min_s": min(wall), "max_s": max(wall)}  # fmt: skip
        print(f"{name:40s} B={rows} d={width} block={args.mrl_block}: temp "
              f"{out[name]['temp_mib']:7.1f} MiB, step median {out[name]['median_s']:.3f} s "
              f"(range {min(wall):.3f}-{max(wall):.3f}, {args.rounds} rounds)")  # fmt: skip
    names = list(grads)
    ratio = common.ratio_range(times.wall[names[1]], times.wall[names[0]])
    out["time_ratio"] = {"median": ratio[0], "min": ratio[1], "max": ratio[2]}
    print(
        f"matryoshka / single width step time: median {ratio[0]:.2f} "
        f"(range {ratio[1]:.2f}-{ratio[2]:.2f})"
    )
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    print(common.machine())
    meta = {"command": common.command("maxsim_matryoshka", sys.argv[1:])}
    out = {"meta": {**meta, "machine": common.machine(), **vars(args)}}
    out["meta"]["json"] = common.shown(args.json)
    out["maxsim_memory"] = maxsim_memory(args)
    out["maxsim_speed"] = maxsim_speed(args)
    out["matryoshka"] = matryoshka_cost(args)
    out["meta"]["load_after"] = common.load()
    print(common.load())
    common.write_json(args.json, out, default=str)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
