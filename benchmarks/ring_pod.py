"""Per-chip memory and collectives of the loss step on TPU v5e slices: gather vs ring.

Compile only (libtpu's compile-only TPU devices, ``jax.experimental.topologies``;
nothing runs, no TPU needed). The step is the loss part of a
gradient-cache step: the representations are its inputs (``[B, 768]`` bfloat16,
sharded over every chip of the slice under ``jit`` with explicit mesh axes), and it
returns the loss and its gradients with respect to both representations and the
loss's scalars (temperature, logit scale and bias), with ``block_size=4096``.

For each loss (``contrastive``, ``clip``, ``sigmoid``), form (``method="gather"``:
all-gather the other side, today's form; ``method="ring"``: gc_jax's ring) and slice
(v5e 4x4 = 16 chips, 8x8 = 64, 16x16 = 256), it compiles two batches: a fixed
per-chip batch (65,536 rows per chip, so global 2^20 .. 2^24) and a fixed global
batch (2^20). It prints XLA's per-chip temporary memory (when the program does not
fit in a v5e's 15.75 GiB the compiler refuses it and the figure is read from its
message) and the collectives of the optimised HLO: how many of each kind, and the
largest all-gather in bytes (a batch-sized all-gather is the gather form's cost).

The options of issue 26 (``--losses contrastive_options maxsim``) are compiled at the
fixed per-chip batch only: ``contrastive_options`` is InfoNCE with GTE's four
directions, false-negative ids (int32 per row) and guide filtering (``[B, 384]``
bfloat16 guide representations, margin 0.1); ``maxsim`` is the multi-vector loss on
``[B, 32, --maxsim-dim]`` bfloat16 token vectors with token masks, 16,384 rows per
chip and blocks of 128 rows.

Usage::

    python -m benchmarks.ring_pod                   # the full table, JSON and plot
    python -m benchmarks.ring_pod --chips 16 --losses contrastive   # one point
    python -m benchmarks.ring_pod --losses contrastive_options maxsim --methods ring \
        --json benchmarks/results/ring_pod_options.json \
        --plot benchmarks/plots/ring_pod_options.png
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from benchmarks import common

GIB = 2**30
HBM = 15.75 * GIB  # what a v5e chip offers a program
TOPOLOGIES = {16: "v5e:4x4", 64: "v5e:8x8", 256: "v5e:16x16"}
PLAIN = ("contrastive", "clip", "sigmoid")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chips", type=int, nargs="+", default=sorted(TOPOLOGIES))
    p.add_argument(
        "--losses",
        nargs="+",
        default=list(PLAIN),
        choices=[*PLAIN, "contrastive_options", "maxsim"],
    )
    p.add_argument("--methods", nargs="+", default=["gather", "ring"])
    p.add_argument("--per-chip", type=int, default=65_536)
    p.add_argument("--global-batch", type=int, default=2**20)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--block", type=int, default=4096)
    p.add_argument(
        "--maxsim-per-chip",
        type=int,
        default=16_384,
        help="maxsim: rows per chip (each row is TOKENS x --maxsim-dim)",
    )
    p.add_argument("--maxsim-dim", type=int, default=128)
    p.add_argument("--maxsim-block", type=int, default=128)
    p.add_argument("--json", type=Path, default=common.RESULTS / "ring_pod.json")
    p.add_argument("--plot", type=Path, default=common.PLOTS / "ring_pod.png")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON")
    p.add_argument(
        "--update",
        action="store_true",
        help="replace only these points in the existing JSON (each keeps its commit)",
    )
    return p.parse_args(argv)


def setting(loss: str, args) -> tuple[int, int, int]:
    """``(rows per chip, dim, block size)`` of ``loss``."""
    if loss == "maxsim":
        return args.maxsim_per_chip, args.maxsim_dim, args.maxsim_block
    return args.per_chip, args.dim, args.block


def mesh_of(chips: int) -> Mesh:
    devices = common.tpu_devices(TOPOLOGIES[chips], host_bounds=(2, 2, 1))
    return Mesh(np.array(devices), ("data",), axis_types=(AxisType.Explicit,))


def step_of(loss: str, method: str, block: int):
    """``(x, y, *scalars, *extras) -> (loss, grads of x, y and every scalar)``.

    Returns the step, the scalars' values and a function of ``(batch, dim)`` giving
    the loss's extra inputs (ids, guide representations, token masks) as shapes.
    """
    losses = gc_jax.losses
    none = lambda batch, dim: ()
    fn, scalars, extras = {
        "contrastive": (lambda x, y, t, **kw: losses.contrastive_loss(x, y, temperature=t, **kw),
                        (0.05,), none),
        "clip": (losses.clip_loss, (np.log(1 / 0.07),), none),
        "sigmoid": (losses.sigmoid_loss, (np.log(10.0), -10.0), none),
        "contrastive_options": (_contrastive_options, (0.05,), _options_inputs),
        "maxsim": (_maxsim, (0.05,), _maxsim_inputs),
    }[loss]  # fmt: skip
    fn = functools.partial(fn, block_size=block, method=method)
    return jax.value_and_grad(fn, tuple(range(2 + len(scalars)))), scalars, extras


def _contrastive_options(x, y, t, query_ids, doc_ids, gx, gy, **kw):
    """GTE's four directions, false-negative ids and guide filtering, all at once."""
    return gc_jax.losses.contrastive_loss(
        x, y, temperature=t, directions=DIRECTIONS, query_ids=query_ids, doc_ids=doc_ids,
        guide=(gx, gy), margin=0.1, **kw,
    )  # fmt: skip


DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def _options_inputs(batch: int, dim: int) -> tuple:
    ids = jax.ShapeDtypeStruct((batch,), jnp.int32)
    guide = jax.ShapeDtypeStruct((batch, GUIDE_DIM), jnp.bfloat16)
    return ids, ids, guide, guide


GUIDE_DIM = 384  # a small guide model's width (e.g. MiniLM)


def _maxsim(q, d, t, q_mask, d_mask, **kw):
    return gc_jax.losses.maxsim_loss(q, d, q_mask=q_mask, d_mask=d_mask, temperature=t, **kw)


def _maxsim_inputs(batch: int, dim: int) -> tuple:
    mask = jax.ShapeDtypeStruct((batch, TOKENS), jnp.bool_)
    return mask, mask


TOKENS = 32  # MaxSim: token vectors per row (ColBERT-style, [rows, TOKENS, --maxsim-dim])


_COLLECTIVE = re.compile(
    r"= (.*) (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(-start)?\("
)
_SHAPE = re.compile(r"(bf16|f32|s32|u32|f16|pred|u8|s8)\[([0-9,]*)\]")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "u8": 1, "s8": 1}


def collectives(hlo: str) -> dict:
    """Counts of each collective in the optimised HLO, and the largest all-gather's bytes."""
    counts: dict = {}
    largest_gather = 0
    for shape, kind, _ in _COLLECTIVE.findall(hlo):
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "all-gather":
            size = max(
                (_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                 for t, dims in _SHAPE.findall(shape)),
                default=0,
            )  # fmt: skip
            largest_gather = max(largest_gather, size)
    return {"counts": counts, "largest_all_gather_bytes": largest_gather}


def compile_point(loss: str, method: str, chips: int, batch: int, dim: int, block: int) -> dict:
    mesh = mesh_of(chips)
    step, scalars, extras = step_of(loss, method, block)
    shape = (batch, TOKENS, dim) if loss == "maxsim" else (batch, dim)
    rows = lambda s: NamedSharding(mesh, P("data", *[None] * (len(s.shape) - 1)))
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    s = [jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))] * len(scalars)
    more = [jax.ShapeDtypeStruct(e.shape, e.dtype, sharding=rows(e)) for e in extras(batch, dim)]
    start = time.perf_counter()
    out = {"loss": loss, "method": method, "chips": chips, "batch": batch,
           "per_chip": batch // chips}  # fmt: skip
    try:
        compiled = jax.jit(step).lower(x, x, *s, *more).compile()
    except Exception as e:  # the compiler refuses a program that does not fit
        if (found := common.out_of_memory(e)) is None:
            raise
        out.update(fits=False, temp_bytes=found[0])
    else:
        m = compiled.memory_analysis()
        out.update(fits=True, temp_bytes=m.temp_size_in_bytes,
                   argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                   **collectives(compiled.as_text()))  # fmt: skip
    out["compile_s"] = round(time.perf_counter() - start, 1)
    return out


def plot(results: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    maxsim = any(r["loss"] == "maxsim" for r in results)
    for ax, (title, pick) in zip(axes, [
        (f"fixed per-chip batch ({args.per_chip:,} rows per chip"
         + (f"; maxsim {args.maxsim_per_chip:,})" if maxsim else ")"),
         lambda r: r["per_chip"] == setting(r["loss"], args)[0]),
        (f"fixed global batch ({args.global_batch:,} rows)",
         lambda r: r["loss"] in PLAIN and r["batch"] == args.global_batch),
    ], strict=True):  # fmt: skip
        for loss in dict.fromkeys(r["loss"] for r in results):
            for method, style in (("gather", "--"), ("ring", "-")):
                mine = [r for r in results if r["loss"] == loss and r["method"] == method]
                pts = sorted((r["chips"], r["temp_bytes"] / GIB) for r in mine if pick(r))
                if pts:
                    chips, gib = zip(*pts, strict=True)
                    ax.plot(chips, gib, style, marker="o", label=f"{loss}, {method}")
        ax.axhline(HBM / GIB, color="grey", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="v5e chips", title=title)
        chips = sorted({r["chips"] for r in results})
        ax.set_xticks(chips, [str(c) for c in chips])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    axes[0].set_ylabel("per-chip temp memory (GiB), TPU compiler")
    labelled = [ax for ax in axes if ax.get_legend_handles_labels()[0]]
    labelled[-1].legend(fontsize=7)
    for ax in axes:
        ax.set_visible(ax in labelled)  # the new losses: no fixed-global-batch panel
    common.save_figure(fig, path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.replot:
        plot(json.loads(args.json.read_text())["results"], args, args.plot)
        return
    points = []
    for chips in args.chips:
        for loss in args.losses:
            per_chip, _, _ = setting(loss, args)
            batches = [per_chip * chips]
            if loss in PLAIN:  # the new losses: the per-chip batch only (is it flat?)
                batches.append(args.global_batch)
            for batch in dict.fromkeys(batches):
                for method in args.methods:
                    points.append((loss, method, chips, batch))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=common.ROOT).stdout.strip()  # fmt: skip
    results = []
    for loss, method, chips, batch in points:
        _, dim, block = setting(loss, args)
        r = compile_point(loss, method, chips, batch, dim, block)
        r["commit"] = commit
        results.append(r)
        print(
            f"{loss:12s} {method:6s} chips={chips:4d} batch=2^{int(np.log2(batch)):2d} "
            f"per-chip={batch // chips:7d} temp={r['temp_bytes'] / GIB:7.2f} GiB "
            f"fits={r['fits']!s:5s} {r.get('counts', '')} "
            f"largest all-gather={r.get('largest_all_gather_bytes', '-')} B "
            f"({r['compile_s']} s)",
            flush=True,
        )
    command = common.command("ring_pod", sys.argv[1:])
    meta = {"commands": [command], "jax": jax.__version__, "dim": args.dim,
            "block_size": args.block}  # fmt: skip
    if args.update:
        old = json.loads(args.json.read_text())
        key = lambda r: (r["loss"], r["method"], r["chips"], r["batch"])
        new = {key(r) for r in results}
        results = [r for r in old["results"] if key(r) not in new] + results
        meta["commands"] = [*old["meta"]["commands"], command]
    common.write_json(args.json, {"meta": meta, "results": results})
    print(f"wrote {args.json}")
    plot(results, args, args.plot)


if __name__ == "__main__":
    main()
