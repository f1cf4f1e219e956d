"""Did a change to the losses change what they compile to? Fingerprints of every loss form.

For a refactor of ``gc_jax/losses`` the strongest before/after check is the compiled
program itself: for each loss form (dense, blockwise, gather and ring on 8 emulated
CPU devices; InfoNCE, GTE's directions, SigLIP, CLIP, MaxSim) this compiles the loss's
value and gradients with XLA:CPU and prints a fingerprint of the optimised HLO (sha1
of its instruction lines: no metadata, no source-location tables, so renamed Python
functions do not count), its length, and ``memory_analysis().temp_size_in_bytes``.
The ``step_*`` forms compile a whole cached step (``cached_value_and_grad``, an MLP
encoder) with the blockwise loss: a loss alone, its rows arguments the compiler must
keep, can hold less in a way the step does not (a gradient written over its rows'
copy becomes, in the step, a gradient written over the cache itself).
Run it in the trees before and after a change: an equal fingerprint is the same
program. ``--time N`` also runs each form ``N`` times and prints the median wall and
process-CPU time of a step (CPU time is the steadier figure on a shared machine;
alternate before/after processes to compare). ``--step-rows R`` instead compiles only
the whole cached steps, at ``R`` pairs (an MLP encoder, chunks of 4,096, blocks of
1,024), on XLA:CPU and, with ``--tpu v5e:1x1``, for a TPU chip (libtpu's compile-only
devices: nothing runs). ``--options`` instead fingerprints ``contrastive_loss``'s options
(GTE's directions, ids, a guide, hardness, a bank, per-direction partitions) and the
other losses with and without ids in every form (dense, blockwise; gather, ring and
one tile per ring block on 8 devices): 80 programs.

Usage (from the repository root)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.loss_programs
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m benchmarks.loss_programs --time 5 --json /tmp/after.json
    python -m benchmarks.loss_programs --step-rows 65536 --tpu v5e:1x1
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.loss_programs --options
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import gc_jax
from benchmarks import loss_option_grid as option_grid
from gc_jax import losses

DEVICES = 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--time", type=int, default=0, help="steps to time per form (0: none)")
    p.add_argument("--only", nargs="+", default=None, help="forms to run (default: all)")
    p.add_argument("--step-rows", type=int, default=0, help="whole steps only, at this size")
    p.add_argument("--tpu", default=None, help="with --step-rows: also this TPU topology")
    p.add_argument("--options", action="store_true", help="the options x forms grid instead")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.options and args.step_rows:
        p.error("--options fingerprints the loss forms; --step-rows compiles whole steps")
    return args


def fingerprint(compiled) -> tuple[str, int]:
    """sha1 (10 hex digits) and length of the optimised HLO's instruction lines."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    lines = [
        line for line in text.splitlines() if re.match(r"\s*(%|ROOT|ENTRY|\}|HloModule)", line)
    ]
    program = "\n".join(lines)
    return hashlib.sha1(program.encode()).hexdigest()[:10], len(program)


def _grad(loss, argnums=(0, 1)):
    return lambda a, b: jax.value_and_grad(loss, argnums)(a, b)


def _sharded(loss, mesh):
    """Value and gradients inside ``shard_map`` over ``mesh``'s ``"d"`` axis."""
    rows = P("d")
    return jax.shard_map(
        _grad(loss), mesh=mesh, in_specs=(rows, rows), out_specs=(P(), (rows, rows))
    )


def forms() -> dict:
    """``name -> (step, a, b)``: each loss form's value-and-gradient step and its inputs."""
    key = jax.random.split(jax.random.key(0), 4)
    x, y = jax.random.normal(key[0], (512, 32)), jax.random.normal(key[1], (1024, 32))
    q, d = jax.random.normal(key[2], (64, 6, 16)), jax.random.normal(key[3], (128, 8, 16))
    q_mask, d_mask = np.ones((64, 6), bool), np.ones((128, 8), bool)
    d_mask[:, 5:] = False
    gte = ("query_to_doc", "doc_to_query", "query_to_query", "doc_to_doc")
    c, s, m = losses.contrastive_loss, losses.sigmoid_loss, losses.maxsim_loss
    out = {
        "contrastive_dense": (_grad(lambda a, b: c(a, b)), x, y),
        "contrastive_block": (_grad(lambda a, b: c(a, b, block_size=128)), x, y),
        "contrastive_block_bf16": (
            _grad(lambda a, b: c(a, b, block_size=128)),
            x.astype("bfloat16"),
            y.astype("bfloat16"),
        ),
        "contrastive_hn_block": (_grad(lambda a, b: c(a, b, block_size=128)), x[:256], y),
        "gte_block": (_grad(lambda a, b: c(a, b, directions=gte, block_size=128)), x, y),
        "sigmoid_block": (_grad(lambda a, b: s(a, b, 2.0, -1.0, block_size=128)), x, y[:512]),
        "maxsim_block": (
            _grad(lambda a, b: m(a, b, q_mask=q_mask, d_mask=d_mask, block_size=16)),
            q,
            d,
        ),
        "clip_block": (_grad(lambda a, b: losses.clip_loss(a, b, 2.0, block_size=128)), x, y[:512]),
    }
    out |= _steps(key)
    if jax.device_count() < DEVICES:
        return out
    mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    ring = {"axis_name": "d", "method": "ring"}
    out |= {
        "contrastive_ring": (_sharded(lambda a, b: c(a, b, block_size=32, **ring), mesh), x, y),
        "contrastive_gather": (
            _sharded(lambda a, b: c(a, b, block_size=32, axis_name="d", method="gather"), mesh),
            x,
            y,
        ),
        "sigmoid_ring": (
            _sharded(lambda a, b: s(a, b, 2.0, -1.0, block_size=32, **ring), mesh),
            x,
            y[:512],
        ),
        "sigmoid_gather": (
            _sharded(lambda a, b: s(a, b, 2.0, -1.0, block_size=32, axis_name="d"), mesh),
            x,
            y[:512],
        ),
        "clip_ring": (
            _sharded(lambda a, b: losses.clip_loss(a, b, 2.0, block_size=32, **ring), mesh),
            x,
            y[:512],
        ),
        "maxsim_ring": (_sharded(lambda a, b: m(a, b, block_size=8, **ring), mesh), q, d),
    }
    return out


def _encode(w, rows, key):
    return jax.numpy.tanh(rows @ w[0]) @ w[1]


def _step_losses(block: int) -> dict:
    block = {"block_size": block}
    return {
        "step_contrastive": lambda w, a, b: losses.contrastive_loss(a, b, **block),
        "step_sigmoid": lambda w, a, b: losses.sigmoid_loss(a, b, 2.0, -1.0, **block),
        "step_clip": lambda w, a, b: losses.clip_loss(a, b, 2.0, **block),
    }


def step_memory(rows: int, tpu: str | None) -> dict:
    """Temp bytes of whole cached steps at ``rows`` pairs (128-wide reps), compile only."""
    w = (jax.ShapeDtypeStruct((64, 256), "float32"), jax.ShapeDtypeStruct((256, 128), "float32"))
    x = jax.ShapeDtypeStruct((rows, 64), "float32")
    places = {"cpu": lambda tree: tree}
    if tpu:
        from benchmarks import common

        device = common.tpu_devices(tpu)[0]
        places[tpu] = lambda tree: common.on_device(device, tree)
    out = {}
    for name, loss in _step_losses(1024).items():
        step = jax.jit(gc_jax.cached_value_and_grad(loss, _encode, chunk_size=4096))
        for where, place in places.items():
            compiled = step.lower(*place((w, x, x))).compile()
            out[f"{name}_{where}"] = int(compiled.memory_analysis().temp_size_in_bytes)
            print(f"{name:18s} {where:10s} {out[f'{name}_{where}']:>14,} B", flush=True)
    return out


def _steps(key) -> dict:
    """Whole cached steps (an MLP encoder, 4,096 pairs, chunks of 512) with each loss."""
    w = (jax.random.normal(key[0], (32, 128)), jax.random.normal(key[1], (128, 64)))
    inputs = jax.random.normal(key[2], (2, 4096, 32))
    out = {}
    for name, loss in _step_losses(512).items():
        step = gc_jax.cached_value_and_grad(loss, _encode, chunk_size=512)
        out[name] = (lambda a, b, step=step: step(w, a, b), inputs[0], inputs[1])
    return out


def measure(step, args: tuple, runs: int) -> dict:
    compiled = jax.jit(step).lower(*args).compile()
    digest, length = fingerprint(compiled)
    row = {"sha1": digest, "hlo_chars": length}
    row["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
    if runs:
        jax.block_until_ready(compiled(*args))
        wall, cpu = [], []
        for _ in range(runs):
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(compiled(*args))
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        row["wall_s"], row["cpu_s"] = float(np.median(wall)), float(np.median(cpu))
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = {}
    print(f"JAX {jax.__version__}, {jax.device_count()} devices", flush=True)
    if args.step_rows:
        rows = step_memory(args.step_rows, args.tpu)
        if args.json:
            args.json.write_text(json.dumps({"jax": jax.__version__, "steps": rows}, indent=1))
        return 0
    grid = option_grid.forms() if args.options else forms()
    for name, (step, *inputs) in grid.items():
        if args.only and name not in args.only:
            continue
        rows[name] = measure(step, tuple(inputs), args.time)
        print(f"{name:24s} {json.dumps(rows[name])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"jax": jax.__version__, "forms": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
