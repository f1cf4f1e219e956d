"""Per-chip memory of the loss part of a SPLADE step on a v5e chip and a v5e-256 pod.

Compile only (libtpu's compile-only TPU devices, ``jax.experimental.topologies``;
nothing runs, no TPU needed). The step is the loss part of a gradient-cache step:
``jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))`` over the cached representations
of queries and documents, ``[B, V]`` bfloat16, sharded over every chip under ``jit``
with explicit mesh axes. For a sparse (SPLADE) encoder ``V`` is the vocabulary
(30,522, BERT's) and the loss is ``contrastive_loss`` plus SPLADE's FLOPS regulariser
on each side (``sparse_regularizer``, weights 3e-4 and 1e-4); the dense case is
``V = 768`` and ``contrastive_loss`` alone (``--dense-regularizer`` adds the same
regulariser there too).

For each slice (``1``: v5e 1x1, one chip; ``256``: v5e 16x16), width, form
(``method="gather"`` or ``"ring"``; on one chip there is nothing to gather or pass, and
only ``gather`` is compiled) and global batch (2^12, 2^14, 2^16 rows by default) it
records the per-chip memory by the buffer assignment (arguments + outputs +
preallocated HBM temp, read from an XLA dump: what the chip holds, which the
compiler's own fit check follows), ``memory_analysis()``'s temp for comparison, and
the largest all-gather. Where the compiler refuses a program that does not fit a
v5e chip (15.75 GiB), the temp in its message is recorded. The summary gives the
bytes per row: the slope of the per-chip total between consecutive batches that
compiled, per row of the global batch and per row held by each chip.

Usage::

    python -m benchmarks.sparse_pod                        # every point, ~10-20 min
    python -m benchmarks.sparse_pod --chips 1 --widths 768 --batches 4096   # one point
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from benchmarks import common, ring_pod

GIB = 2**30
TOPOLOGIES = {1: "v5e:1x1", 256: "v5e:16x16"}
HOSTS = {1: (1, 1, 1), 256: (2, 2, 1)}
VOCAB = 30_522  # BERT's WordPiece vocabulary, SPLADE's
DENSE = 768
TEMPERATURE = 0.05
WEIGHTS = (3e-4, 1e-4)  # SPLADE v2's FLOPS weights, queries and documents


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chips", type=int, nargs="+", default=sorted(TOPOLOGIES), choices=TOPOLOGIES)
    p.add_argument("--widths", type=int, nargs="+", default=[DENSE, VOCAB])
    p.add_argument("--methods", nargs="+", default=["gather", "ring"])
    p.add_argument("--batches", type=int, nargs="+", default=[2**12, 2**14, 2**16])
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--dense-regularizer", action="store_true",
                   help="add the FLOPS regulariser at the dense width too")  # fmt: skip
    p.add_argument("--json", type=Path, default=common.RESULTS / "sparse_pod.json")
    p.add_argument("--update", action="store_true", help="merge into the existing JSON")
    return p.parse_args(argv)


def mesh_of(chips: int) -> Mesh:
    devices = common.tpu_devices(TOPOLOGIES[chips], host_bounds=HOSTS[chips])
    return Mesh(np.array(devices), ("data",), axis_types=(AxisType.Explicit,))


def loss_of(method: str, block: int, regularize: bool):
    """``(q, d) -> loss``: InfoNCE, plus SPLADE's FLOPS regulariser on each side."""

    def loss(q, d):
        value = gc_jax.losses.contrastive_loss(
            q, d, temperature=TEMPERATURE, block_size=block, method=method
        )
        if regularize:
            value += gc_jax.losses.sparse_regularizer(
                q, d, query_weight=WEIGHTS[0], doc_weight=WEIGHTS[1]
            )
        return value

    return loss


def compile_point(chips: int, width: int, method: str, batch: int, args) -> dict:
    mesh = mesh_of(chips)
    regularize = width != DENSE or args.dense_regularizer
    step = jax.value_and_grad(loss_of(method, args.block, regularize), argnums=(0, 1))
    x = jax.ShapeDtypeStruct((batch, width), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    out = {"chips": chips, "topology": TOPOLOGIES[chips], "width": width,
           "regularizer": regularize, "method": method, "batch": batch,
           "per_chip": batch // chips, "block_size": args.block}  # fmt: skip
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled, temp = common.compile_with_allocation(jax.jit(step).lower(x, x))
    except Exception as e:  # the compiler refuses a program that does not fit
        if (found := common.out_of_memory(e)) is None:
            raise
        out.update(fits=False, temp_bytes=int(found[0]))
        if used := _USED.search(str(e)):  # libtpu 0.0.50: all it would hold, scoped included
            out["used_bytes"] = int(float(used[1]) * common._UNITS[used[2]])
    else:
        m = compiled.memory_analysis()
        args_out = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        out.update(fits=True, temp_bytes=temp, args_out_bytes=args_out,
                   total_bytes=temp + args_out, analysis_temp_bytes=m.temp_size_in_bytes,
                   **ring_pod.collectives(compiled.as_text()))  # fmt: skip
    out["compile_s"] = round(time.perf_counter() - start, 1)
    return out


_USED = re.compile(r"Used ([\d.]+)([KMGT]) of [\d.]+[KMGT] hbm")


def key(r: dict) -> tuple:
    return r["chips"], r["width"], r["regularizer"], r["method"], r["batch"]


def slopes(results: list[dict]) -> list[dict]:
    """Bytes per row between consecutive compiled batches of each (slice, width, form)."""
    out = []
    groups: dict = {}
    for r in results:
        if r["fits"]:
            groups.setdefault(key(r)[:4], []).append(r)
    for (chips, width, reg, method), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["batch"])
        for a, b in itertools.pairwise(rs):
            grow = b["total_bytes"] - a["total_bytes"]
            rows, chip_rows = b["batch"] - a["batch"], b["per_chip"] - a["per_chip"]
            out.append({"chips": chips, "width": width, "regularizer": reg, "method": method,
                        "batches": [a["batch"], b["batch"]],
                        "bytes_per_row": round(grow / rows),
                        "bytes_per_chip_row": round(grow / chip_rows)})  # fmt: skip
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=common.ROOT).stdout.strip()  # fmt: skip
    results = []
    for chips in args.chips:
        methods = args.methods if chips > 1 else ["gather"]
        for width in args.widths:
            for method in methods:
                for batch in args.batches:
                    r = compile_point(chips, width, method, batch, args)
                    r["commit"] = commit
                    results.append(r)
                    total = r.get("total_bytes", r["temp_bytes"]) / GIB
                    print(
                        f"chips={chips:3d} V={width:6d} {method:6s} batch={batch:,}"
                        f" fits={r['fits']!s:5s} {'total' if r['fits'] else 'temp (refused)'}"
                        f"={total:7.3f} GiB temp={r['temp_bytes'] / GIB:7.3f}"
                        f" analysis temp={r.get('analysis_temp_bytes', 0) / GIB:7.3f}"
                        f" all-gather={r.get('largest_all_gather_bytes', '-')}"
                        f" ({r['compile_s']} s)",
                        flush=True,
                    )
    command = common.command("sparse_pod", sys.argv[1:] if argv is None else argv)
    meta = {"commands": [command], "jax": jax.__version__, "libtpu": metadata.version("libtpu"),
            "vocab": VOCAB, "dense": DENSE, "temperature": TEMPERATURE,
            "flops_weights": WEIGHTS}  # fmt: skip
    if args.update and args.json.exists():
        old = json.loads(args.json.read_text())
        new = {key(r) for r in results}
        results = [r for r in old["results"] if key(r) not in new] + results
        meta["commands"] = [*old["meta"]["commands"], command]
    summary = slopes(results)
    for s in summary:
        print(f"chips={s['chips']:3d} V={s['width']:6d} {s['method']:6s} {s['batches']}: "
              f"{s['bytes_per_row']:,} B per row, "
              f"{s['bytes_per_chip_row']:,} B per chip row")  # fmt: skip
    common.write_json(args.json, {"meta": meta, "results": results, "slopes": summary})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
