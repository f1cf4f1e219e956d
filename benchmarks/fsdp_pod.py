"""A Qwen3-shaped embedder with FSDP weights on a TPU pod: gc_jax against the plain step.

Compile only (libtpu's compile-only devices of a real slice; nothing runs). The model is
``examples/large_embedder.py`` (0.6B, 4B, 8B shapes, vocabulary 151,936), trained
either fully (every weight differentiated: FSDP float32 master weights, AdamW moments
sharded like them) or with LoRA (bfloat16 base, frozen; adapters trained). Queries of
64 and documents of 512 tokens, one hard negative per query; the ring loss.

Steps compared, at a global batch of ``pairs``:

* ``plain``: ``jax.value_and_grad`` of the loss over the whole batch (per-layer remat).
* ``gc``: ``gc_jax.cached_value_and_grad`` with ``--chunk`` query rows (and twice as
  many document rows: the same pairs) per device per chunk; the weights gathered layer
  by layer inside every chunk (``encoder_view="global"``).
* ``gc-auto``: ``gc`` with the default ``encoder_view="auto"`` (it must choose
  ``"global"``: the weights are FSDP-sharded in their explicit types).
* ``gc-local``: the same, the weights gathered whole once per step and each device
  encoding its own rows (``encoder_view="local"``); full fine-tuning only.

For each: whether the compiler accepts it, the per-chip memory by the buffer assignment
(arguments + outputs + preallocated temp), and every collective of the step with its
bytes per chip, counted through the loops' trip counts (the layer scan inside the chunk
loops), split into what runs per chunk and per step.

    PYTHONPATH=examples python -m benchmarks.fsdp_pod --size 0.6b --topology v5e:16x16 \\
        --pairs 4096 --chunk 8

Results are appended to ``benchmarks/results/fsdp_pod.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from benchmarks import common, example_modules

le = example_modules.large_embedder

RESULTS = Path(__file__).parent / "results" / "fsdp_pod.json"
CHIPS = {  # topology name -> (config, host bounds, chips, HBM GiB the compiler offers)
    "v5e:16x16": ("default", (2, 2, 1), 256, 15.75),
    "v5e:8x16": ("default", (2, 2, 1), 128, 15.75),
    "v5:4x4x8": ("megacore", (2, 2, 1), 128, 95.0),
    "v5:4x4x4": ("megacore", (2, 2, 1), 64, 95.0),
    "v6e:16x16": ("default", (2, 2, 1), 256, 31.25),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["0.6b", "4b", "8b"], default="0.6b")
    parser.add_argument("--topology", choices=sorted(CHIPS), default="v5e:16x16")
    parser.add_argument("--pairs", type=int, nargs="+", default=[4096])
    parser.add_argument(
        "--chunk", type=int, default=8,
        help="query rows per device per chunk (documents: twice as many, the same pairs)",
    )  # fmt: skip
    parser.add_argument(
        "--steps",
        nargs="+",
        choices=["plain", "gc", "gc-auto", "gc-local"],
        default=["plain", "gc"],
    )
    parser.add_argument("--train", choices=["full", "lora"], default="full")
    parser.add_argument("--query-tokens", type=int, default=64)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--hlo-dir", type=Path, default=None, help="save each optimised HLO")
    parser.add_argument("--report", action="store_true", help="print the results' table")
    parser.add_argument("--plot", type=Path, default=None, help="with --report: a figure")
    return parser.parse_args(argv)


def mesh_of(topology: str) -> Mesh:
    config, bounds, _, _ = CHIPS[topology]
    devices = common.tpu_devices(topology, config, bounds)
    return Mesh(np.array(devices), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def trained_and_frozen(size: le.Size, train: str) -> tuple:
    """Shapes of what is trained and what is frozen: the float32 base and no adapters
    (``full``), or the adapters and a bfloat16 base (``lora``)."""
    base, lora = le.base_shapes(size), le.lora_shapes(size)
    if train == "full":
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), base), lora
    return lora, base


def _encoder(size: le.Size, train: str, frozen):
    if train == "full":
        return lambda p, batch, key=None: le.encode(size, p, None, batch, key)
    return lambda p, batch, key=None: le.encode(size, frozen, p, batch, key)


def make_step(kind: str, size: le.Size, train: str, chunk: int):
    opt = optax.adamw(1e-4)

    def step(params, opt_state, frozen, q, d):
        encode = _encoder(size, train, frozen)
        if kind == "plain":
            total = lambda p: le.loss_fn(p, encode(p, q), encode(p, d))
            loss, grads = jax.value_and_grad(total)(params)
        else:  # a chunk holds the same pairs' queries and documents
            view = {"gc": "global", "gc-auto": "auto", "gc-local": "local"}[kind]
            grad_fn = gc_jax.cached_value_and_grad(
                le.loss_fn, encode, chunk_size=(chunk, 2 * chunk), encoder_view=view
            )
            if kind == "gc-local":  # the weights gathered once per step
                params = jax.tree.map(lambda w: jax.sharding.reshard(w, P()), params)
            loss, grads = grad_fn(params, q, d)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, opt


def shapes_on(mesh: Mesh, tree, specs):
    return jax.tree.map(
        lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
        tree,
        specs,
    )


def inputs(mesh: Mesh, size: le.Size, train: str, pairs: int, args) -> tuple:
    params, frozen = trained_and_frozen(size, train)
    base_specs = le.base_specs(size)
    replicated = lambda t: jax.tree.map(lambda _: P(), t)
    if train == "full":
        params = shapes_on(mesh, params, base_specs)
    else:
        params = shapes_on(mesh, params, replicated(params))
        frozen = shapes_on(mesh, frozen, base_specs)
    rows = NamedSharding(mesh, P("data"))
    text = lambda n, t: {
        k: jax.ShapeDtypeStruct((n, t), jnp.int32, sharding=rows)
        for k in ("token_ids", "padding_mask")
    }
    return params, frozen, text(pairs, args.query_tokens), text(2 * pairs, args.doc_tokens)


# -- reading the compiled step -----------------------------------------------------------

_WHILE = re.compile(r"while\(.*?condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CALLED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_CONST = re.compile(r"s32\[\]\S* constant\((\d+)\)")
_KINDS = "all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all"
_COLL = re.compile(rf"= (.*?) ({_KINDS})(-start)?\(")
_SHAPE = re.compile(r"(bf16|f32|s32|u32|f16|pred|u8|s8)\[([0-9,]*)\]")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "u8": 1, "s8": 1}


def computations(hlo: str) -> dict[str, str]:
    """Every computation's text, by name (``ENTRY`` under its own name too)."""
    out = {}
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) ", block)
        if m:
            out["ENTRY" if m.group(1) else m.group(2)] = block
    return out


def _callees(text: str, comps: dict[str, str]) -> list[tuple[str, float]]:
    """``(computation, runs per run of text)``: a loop body its trip count (the largest
    integer constant its condition compares with; loops start at 0 and step by 1), each
    of a conditional's ``k`` branches ``1/k`` (gc_jax's pass-2 switch picks an input,
    and every input's chunk gathers the same weights), anything else called once."""
    out = []
    for cond, body in _WHILE.findall(text):
        trips = [int(c) for c in _CONST.findall(comps.get(cond, ""))]
        out.append((body, max(trips, default=1)))
    for branches in _BRANCHES.findall(text):
        names = [b.strip().lstrip("%") for b in branches.split(",")]
        out += [(b, 1 / len(names)) for b in names]
    out += [(c, 1) for c in _CALLED.findall(text)]
    return out


def multiplicities(hlo: str) -> dict[str, float]:
    """How many times each computation runs per step (trip counts multiplied through
    nested loops)."""
    comps = computations(hlo)
    times = {"ENTRY": 1.0}
    order = ["ENTRY"]
    for name in order:  # computations only call computations defined before them
        for callee, n in _callees(comps.get(name, ""), comps):
            if callee in comps:
                if callee not in times:
                    order.append(callee)
                times[callee] = times.get(callee, 0) + times[name] * n
    return times


def shape_bytes(shape: str) -> int:
    total = 0
    for t, dims in _SHAPE.findall(shape):
        total += _BYTES[t] * int(np.prod([int(x) for x in dims.split(",") if x] or [1]))
    return total


def collectives(hlo: str) -> dict:
    """Per collective kind: ``[launches, bytes]`` per chip per step, split into those in
    loop bodies (per chunk or per layer: ``looped``) and those run once per step."""
    times = multiplicities(hlo)
    out: dict = {}
    for name, body in computations(hlo).items():
        n = times.get(name, 0)
        for shape, kind, start in _COLL.findall(body):
            size = shape_bytes(shape) / (2 if start else 1)  # a start: (operands, results)
            entry = out.setdefault(kind, {"looped": [0, 0], "once": [0, 0]})
            where = entry["looped" if n > 1 else "once"]
            where[0] += n
            where[1] += n * size
    return {k: {w: [round(c, 1), int(b)] for w, (c, b) in v.items()} for k, v in out.items()}


def compile_point(args, size_name: str, kind: str, pairs: int) -> dict:
    size = le.SIZES[size_name]
    mesh = mesh_of(args.topology)
    step, opt = make_step(kind, size, args.train, args.chunk)
    params, frozen, q, d = inputs(mesh, size, args.train, pairs, args)
    like = lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding)
    opt_state = optax.tree_utils.tree_map_params(  # the moments sharded like the params
        opt, like, jax.eval_shape(opt.init, params), params,
        transform_non_params=lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=NamedSharding(mesh, P())
        ),
    )  # fmt: skip
    chips = CHIPS[args.topology][2]
    out = {"size": size_name, "topology": args.topology, "chips": chips, "train": args.train,
           "step": kind, "pairs": pairs, "pairs_per_chip": pairs // chips,
           "chunk": None if kind == "plain" else args.chunk, "jax": jax.__version__}  # fmt: skip
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, frozen, q, d)
            compiled, temp = common.compile_with_allocation(lowered)
    except Exception as e:  # the compiler refuses a program that does not fit
        if (found := common.out_of_memory(e)) is None:
            raise
        out.update(fits=False, temp_gib=round(found[0] / 2**30, 2))
    else:
        m = compiled.memory_analysis()
        if args.hlo_dir is not None:
            args.hlo_dir.mkdir(parents=True, exist_ok=True)
            name = f"{size_name}-{args.topology}-{args.train}-{kind}-{pairs}.hlo.txt"
            (args.hlo_dir / name.replace(":", "_")).write_text(compiled.as_text())
        args_out = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        out.update(fits=True, temp_gib=round(temp / 2**30, 3),
                   args_out_gib=round(args_out / 2**30, 3),
                   total_gib=round((temp + args_out) / 2**30, 3),
                   collectives=collectives(compiled.as_text()))  # fmt: skip
    out["compile_s"] = round(time.perf_counter() - start, 1)
    return out


# Spec-sheet figures per chip (Google Cloud TPU pages), not measured here: peak bf16
# FLOP/s and inter-chip interconnect bandwidth in bytes/s.
SPEC = {"v5e": (197e12, 1600e9 / 8), "v5": (459e12, 4800e9 / 8), "v6e": (918e12, 3584e9 / 8)}


def forward_flops(size: le.Size, tokens: int) -> float:
    """Forward FLOPs of one sequence of ``tokens``: the layers' matmuls and attention."""
    hd, qd, kvd = size.head_dim, size.heads * size.head_dim, size.kv_heads * size.head_dim
    per_layer = 2 * tokens * (size.dim * (qd + 2 * kvd) + qd * size.dim + 3 * size.dim * size.ffn)
    attention = 4 * tokens * tokens * size.heads * hd
    return size.layers * (per_layer + attention)


def roofline(point: dict, args) -> dict:
    """Per chip and step: model FLOPs (full fine-tuning: 4 forwards for the plain step
    with per-layer remat, 5 for gc_jax's with more than one chunk per input; with one,
    gc_jax does plain training), collective bytes, and the two times."""
    size = le.SIZES[point["size"]]
    pairs = point["pairs_per_chip"]
    per_pair = forward_flops(size, args.query_tokens) + 2 * forward_flops(size, args.doc_tokens)
    fwd = pairs * per_pair
    one_chunk = point["chunk"] is not None and point["chunk"] >= pairs  # full-batch training
    flops = fwd * (4 if point["step"] == "plain" or one_chunk else 5)
    moved = sum(v["looped"][1] + v["once"][1] for v in point["collectives"].values())
    peak, ici = SPEC[point["topology"].split(":")[0]]
    tokens = pairs * (args.query_tokens + 2 * args.doc_tokens)
    return {"tokens_per_chip": tokens, "collective_bytes_per_token": moved / tokens,
            "compute_s": flops / peak, "communication_s": moved / ici}  # fmt: skip


def report(args) -> None:
    """A table of every fitting point in the results, with its roofline estimate."""
    for p in json.loads(RESULTS.read_text()):
        if not p.get("fits"):
            print(f"{p['size']} {p['topology']} {p['step']} pairs {p['pairs']} "
                  f"chunk {p['chunk']}: does not fit ({p['temp_gib']} GiB temp)")  # fmt: skip
            continue
        r = roofline(p, args)
        bound = "compute" if r["compute_s"] >= r["communication_s"] else "communication"
        print(f"{p['size']} {p['topology']} {p['train']} {p['step']} pairs {p['pairs']} "
              f"chunk {p['chunk']}: {p['total_gib']} GiB/chip, "
              f"{r['collective_bytes_per_token'] / 1024:.1f} KiB/token moved, "
              f"compute {r['compute_s']:.3f} s, communication {r['communication_s']:.3f} s "
              f"({bound}-bound)")  # fmt: skip


def plot(args, path: Path) -> None:
    """Per-chip memory (buffer assignment) and collective bytes per token against the
    per-chip batch, plain and gc_jax, one panel pair per size and slice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in json.loads(RESULTS.read_text()) if p.get("fits")]
    groups = sorted({(p["size"], p["topology"]) for p in points})
    fig, axes = plt.subplots(2, len(groups), figsize=(4 * len(groups), 6), squeeze=False)
    for col, (size, topo) in enumerate(groups):
        mine = [p for p in points if (p["size"], p["topology"]) == (size, topo)]
        series = sorted({(p["step"], p["chunk"] or 0) for p in mine})
        for step, chunk in series:
            same = [p for p in mine if (p["step"], p["chunk"] or 0) == (step, chunk)]
            pts = sorted(((p["pairs_per_chip"], p) for p in same), key=lambda t: t[0])
            x = [n for n, _ in pts]
            label = step if step == "plain" else f"{step}, chunks of {chunk} pairs"
            style = "o-" if step == "plain" else "s--"
            axes[0, col].plot(x, [p["total_gib"] for _, p in pts], style, label=label)
            per_token = [roofline(p, args)["collective_bytes_per_token"] / 1024 for _, p in pts]
            axes[1, col].plot(x, per_token, style, label=label)
        axes[0, col].set_title(f"{size} on {topo}")
        axes[0, col].set_ylabel("GiB per chip")
        axes[1, col].set_ylabel("collective KiB per token")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("pairs per chip")
            ax.legend(fontsize=7)
    common.save_figure(fig, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.report:
        report(args)
        if args.plot is not None:
            plot(args, args.plot)
        return
    for pairs in args.pairs:
        for kind in args.steps:
            point = compile_point(args, args.size, kind, pairs)
            print(json.dumps(point), flush=True)
            results = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
            common.write_json(RESULTS, [*results, point])  # read again: others may append


if __name__ == "__main__":
    main()
