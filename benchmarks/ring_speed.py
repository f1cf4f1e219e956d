"""Step time of the ring losses against the all-gather form, on 8 emulated CPU devices.

One process, interleaved rounds (``common.interleaved_times``): every round runs each
step once, so both forms see the same machine load, and the ratio ring / gather is
taken per round. The step is the loss part of a training step: loss and gradients
with respect to both sides' rows and the loss's scalars, ``block_size`` tiles,
float32 rows; under sharded ``jit`` (explicit mesh axes: the gather form replicates
the rows and every device computes the whole loss) and inside ``shard_map`` with
``axis_name`` (the gather form all-gathers the other side and computes its own rows).

Usage (from the repository root)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m benchmarks.ring_speed            # 8 x 256 rows, d = 64, 11 rounds
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from benchmarks import common


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--per-device", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--losses", nargs="+", default=["contrastive", "clip", "sigmoid"])
    p.add_argument("--json", type=Path, default=common.RESULTS / "ring_speed.json")
    return p.parse_args(argv)


def step(loss: str, method: str, block: int, mesh=None):
    """The jitted step; with ``mesh``: inside ``shard_map`` with ``axis_name``."""
    losses = gc_jax.losses
    kw = {"block_size": block, "method": method}
    if mesh is not None:
        kw["axis_name"] = "data"
    fn = {
        "contrastive": lambda x, y, s: losses.contrastive_loss(x, y, temperature=s, **kw),
        "clip": lambda x, y, s: losses.clip_loss(x, y, s, **kw),
        "sigmoid": lambda x, y, s: losses.sigmoid_loss(x, y, s, -10.0, **kw),
    }[loss]
    grad = jax.value_and_grad(fn, (0, 1, 2))
    if mesh is not None:
        rows = P("data")
        specs = {"in_specs": (rows, rows, P()), "out_specs": (P(), (rows, rows, P()))}
        grad = jax.shard_map(grad, mesh=mesh, **specs)
    return jax.jit(grad)


def main(argv=None) -> None:
    args = parse_args(argv)
    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("data",))
    rows = NamedSharding(mesh, P("data"))
    kx, ky = jax.random.split(jax.random.key(0))
    shape = (devices * args.per_device, args.dim)
    x = jax.device_put(jax.random.normal(kx, shape) / args.dim**0.5, rows)
    y = jax.device_put(jax.random.normal(ky, shape) / args.dim**0.5, rows)
    layouts = {"jit": None, "shard_map": mesh}
    fns = {
        f"{layout}/{loss}/{method}": functools.partial(
            step(loss, method, args.block, layouts[layout]), x, y, jnp.float32(1.0)
        )
        for layout in layouts
        for loss in args.losses
        for method in ("gather", "ring")
    }
    print(common.machine())
    times = common.interleaved_times(
        {k: (lambda f=f: f()) for k, f in fns.items()}, (), args.rounds
    )
    out = {"meta": {"command": common.command("ring_speed", sys.argv[1:]), "devices": devices,
                    "machine": common.machine(), **vars(args), "json": common.shown(args.json)},
           "losses": {}}  # fmt: skip
    for name in [f"{layout}/{loss}" for layout in layouts for loss in args.losses]:
        ring, gather = times.wall[f"{name}/ring"], times.wall[f"{name}/gather"]
        ratio = common.ratio_range(ring, gather)
        row = {"ring_s": common.median(ring), "gather_s": common.median(gather),
               "ratio_median": ratio[0], "ratio_min": ratio[1], "ratio_max": ratio[2]}  # fmt: skip
        out["losses"][name] = row
        print(
            f"{name:22s} gather {row['gather_s'] * 1e3:8.1f} ms  ring {row['ring_s'] * 1e3:8.1f} "
            f"ms  ring/gather median {row['ratio_median']:.2f} "
            f"(range {row['ratio_min']:.2f}-{row['ratio_max']:.2f}, {args.rounds} rounds)"
        )
    common.write_json(args.json, out, default=str)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
