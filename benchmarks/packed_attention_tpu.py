"""Does ``gc_jax.packing.attention`` compile for a TPU chip, and what does it cost there?

Compile only (libtpu's compile-only devices, ``jax.experimental.topologies``; nothing
runs): the value and gradient of ``packing.attention`` over a packed chunk of
``--lines`` lines of ``--length`` tokens (``--heads`` heads of ``--head-dim``,
bfloat16), its rows ``--rows`` tokens long, for each ``--implementations``. Prints the
compile time and ``cost_analysis()``'s FLOPs per row length.

The TPU compiler does not count a Pallas kernel's FLOPs: the splash form's figure is
what surrounds the kernel, not the kernel. Splash skips only the blocks its *static*
mask leaves out; segment ids mask inside the blocks it computes, so with a full mask
it computes every block of a packed line.

With ``--data heldout|heldout2``: the documents of issue 36's held-out shapes, packed
as ``TokenPacking(--lines * L, --segments)`` packs them, scaled by each
``--scale`` (a factor on every length). For each chunk, the branch the ``"blocked"``
form takes (the share of score blocks it computes), and the attention FLOPs of the
packed step (value and gradient, every chunk): the dense form's, the blocked form's
(each branch compiled alone on the TPU compiler, times the chunks that take it) and
the rows' own (each row's attention alone, compiled at its length). With
``--buckets``: also the dense form over lines of a few lengths, as
``TokenPacking(buckets=...)`` packs them (``fit``: ``TokenPacking.for_lengths`` with
``attention_width`` the heads' width, fitted to the batch itself), each line length's
chunk compiled alone, times its chunks.

Usage::

    python -m benchmarks.packed_attention_tpu --topology v5e:1x1
    python -m benchmarks.packed_attention_tpu --data heldout --scale 0.5 1 2
    python -m benchmarks.packed_attention_tpu --data heldout --buckets fit
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from gc_jax import TokenPacking, packing


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--topology", default="v5e:1x1")
    p.add_argument("--lines", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rows", type=int, nargs="+", default=[512, 128, 64])
    p.add_argument("--implementations", nargs="+", default=["xla", "splash"])
    p.add_argument("--data", choices=["heldout", "heldout2"], help="a held-out batch, packed")
    p.add_argument("--scale", type=float, nargs="+", default=[1.0], help="--data: length factors")
    p.add_argument("--segments", type=int, default=16, help="--data: rows per line at most")
    p.add_argument("--block-size", type=int, default=32, help="--data: the blocked form's blocks")
    p.add_argument("--buckets", nargs="+",
                   help="--data: also lines of these lengths (ints), or 'fit'")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-rounds", type=int, default=0,
                   help="--data: also time xla and blocked on XLA:CPU, rounds")  # fmt: skip
    return p.parse_args(argv)


def packed_chunk(lines: int, length: int, row: int) -> dict:
    """A chunk of ``lines`` lines, each packed with rows of ``row`` tokens, every token kept."""
    segments = (np.arange(length) // row + 1).astype(np.int32)
    return {
        "attention_mask": np.ones((lines, length), np.int32),
        "segment_ids": np.tile(segments, (lines, 1)),
        "position_ids": np.tile(np.arange(length) % row, (lines, 1)).astype(np.int32),
    }


def document_lengths(data: str, rng, scale: float) -> tuple[np.ndarray, int]:
    """One batch of the held-out shape's document lengths (as ``benchmarks.token_budget``
    draws them: ``heldout`` 256 rows of at most 512, log-normal median 90, sigma 0.75;
    ``heldout2`` 192 of at most 384, two modes), times ``scale`` (clipped to the padded
    length), and the padded length."""
    if data == "heldout":
        padded, lengths = 512, rng.lognormal(np.log(90), 0.75, 256)
    else:
        short = np.round(rng.lognormal(np.log(48), 0.5, 192))
        padded, lengths = 384, np.where(rng.random(192) < 0.65, short, rng.integers(160, 385, 192))
    return np.clip(np.round(lengths * scale), 1, padded).astype(np.int64), padded


def chunk_segments(lengths: np.ndarray, padded: int, lines: int, segments: int) -> list:
    """Each chunk's segment ids, ``int32[lines, padded]``, as ``TokenPacking`` places the
    rows (a chunk's lines past the data repeat the last line)."""
    placed = TokenPacking(tokens=lines * padded, segments=segments).lines(lengths, padded)
    rows = []
    for line in placed[padded]:
        ids = np.concatenate([np.full(lengths[r], k + 1) for k, r in enumerate(line)])
        rows.append(np.pad(ids, (0, padded - len(ids))).astype(np.int32))
    rows += [rows[-1]] * (-len(rows) % lines)
    return [np.stack(rows[i : i + lines]) for i in range(0, len(rows), lines)]


def attention_flops(device, shape, fn, *extra) -> float:
    """``cost_analysis()`` FLOPs of the value and gradient of ``fn(q, k, v, *extra)`` in
    ``q, k, v`` (``extra``: the shapes and dtypes of more, undifferentiated inputs)."""
    spec = common.on_device(device, jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    extra = [common.on_device(device, jax.ShapeDtypeStruct(*e)) for e in extra]
    total = lambda q, k, v, *more: jnp.sum(fn(q, k, v, *more).astype(jnp.float32))
    compiled = jax.jit(jax.value_and_grad(total, (0, 1, 2))).lower(spec, spec, spec, *extra)
    cost = compiled.compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def branch_flops(args, device, padded: int) -> list[float]:
    """FLOPs of each branch of the blocked form over one chunk (the last: dense), the
    block pairs given (their count, which picks the branch, is :func:`pairs_flops`)."""
    shape, block = (args.lines, padded, args.heads, args.head_dim), args.block_size
    ids, n = (shape[:2], jnp.int32), padded // block
    pairs = ((args.lines, n, n), jnp.bool_)
    flops = []
    for cap in packing._caps(args.lines * n * n):
        fn = lambda q, k, v, ids, pairs, cap=cap: packing._block_pairs(
            q, k, v, ids, ids, pairs, block=block, cap=cap)  # fmt: skip
        flops.append(attention_flops(device, shape, fn, ids, pairs))
    dense = lambda q, k, v, ids: packing._dense(q, k, v, ids, ids)
    return [*flops, attention_flops(device, shape, dense, ids)]


def pairs_flops(args, device, padded: int) -> float:
    """FLOPs of finding a chunk's block pairs (the blocked form's every branch)."""
    shape = (args.lines, padded)
    fn = jax.jit(lambda ids: jnp.sum(packing._pairs(ids, ids, args.block_size)))
    spec = common.on_device(device, jax.ShapeDtypeStruct(shape, jnp.int32))
    cost = fn.lower(spec).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def row_flops(args, device, length: int, cache: dict) -> float:
    """FLOPs of one row's attention alone, at its own length."""
    if length not in cache:
        fn = lambda q, k, v: packing._dense(q, k, v, *(jnp.ones(q.shape[:2], jnp.int32),) * 2)
        cache[length] = attention_flops(device, (1, length, args.heads, args.head_dim), fn)
    return cache[length]


def bucket_flops(args, device, lengths: np.ndarray, padded: int) -> tuple:
    """The line lengths of ``--buckets`` and the dense form's attention FLOPs over the
    chunks of lines of those lengths that ``TokenPacking`` encodes for ``lengths``."""
    tokens, width = args.lines * padded, args.heads * args.head_dim
    if args.buckets == ["fit"]:
        packed = TokenPacking.for_lengths(lengths, tokens, padded, attention_width=width)
    else:
        packed = TokenPacking(tokens, args.segments, buckets=tuple(map(int, args.buckets)))
    packed = TokenPacking(tokens, args.segments, buckets=packed.buckets)  # --segments rows
    dense = lambda q, k, v, ids: packing._dense(q, k, v, ids, ids)
    flops = 0.0
    for (lines, n), chunks in packed.chunk_counts(lengths, padded).items():
        ids = ((lines, n), jnp.int32)
        flops += chunks * attention_flops(device, (lines, n, args.heads, args.head_dim), dense, ids)
    return packed.bucket_lengths(padded), flops


def cpu_times(args, chunks: list, padded: int) -> dict:
    """CPU seconds (process time) of the value and gradient of every chunk's attention,
    ``"xla"`` and ``"blocked"`` interleaved, over ``--cpu-rounds`` rounds after a warm-up."""
    cpu = jax.devices("cpu")[0]
    shape = (3, args.lines, padded, args.heads, args.head_dim)
    q, k, v = jax.device_put(jax.random.normal(jax.random.key(0), shape), cpu)

    def step(implementation):
        def total(q, k, v, ids):
            chunk = {"attention_mask": (ids > 0).astype(jnp.int32), "segment_ids": ids}
            out = packing.attention(q, k, v, chunk, implementation=implementation,
                                    block_size=args.block_size)  # fmt: skip
            return jnp.sum(out**2)

        return jax.jit(jax.value_and_grad(total, (0, 1, 2)))

    steps = {name: step(name) for name in ("xla", "blocked")}
    times = {name: [] for name in steps}
    for r in range(args.cpu_rounds + 1):
        for name, fn in steps.items():
            start = time.process_time()
            for ids in chunks:
                jax.block_until_ready(fn(q, k, v, jax.device_put(ids, cpu)))
            if r:  # round 0 compiles
                times[name].append(time.process_time() - start)
    return times


def held_out(args, device) -> None:
    """The packed step's attention FLOPs on a held-out batch, per ``--scale``."""
    rows_cache = {}
    print(f"{args.data}: documents packed into chunks of {args.lines} lines, "
          f"{args.segments} rows a line at most; blocks of {args.block_size}; value and "
          "gradient, bfloat16, FLOPs by cost_analysis() on the TPU compiler")  # fmt: skip
    for scale in args.scale:
        rng = np.random.default_rng(args.seed)  # one batch, every scale
        lengths, padded = document_lengths(args.data, rng, scale)
        branches = branch_flops(args, device, padded)
        caps = packing._caps(args.lines * (padded // args.block_size) ** 2)
        chunks = chunk_segments(lengths, padded, args.lines, args.segments)
        taken = [int(np.searchsorted(caps, int(jnp.sum(packing._pairs(c, c, args.block_size)))))
                 for c in chunks]  # fmt: skip
        blocked = sum(branches[t] for t in taken) + len(chunks) * pairs_flops(args, device, padded)
        dense = branches[-1] * len(chunks)
        own = sum(row_flops(args, device, int(n), rows_cache) for n in lengths)
        padding = 1 - lengths.sum() / (len(lengths) * padded)
        print(f"  scale {scale:g}: {len(lengths)} rows, median {np.median(lengths):.0f} of "
              f"{padded} tokens ({padding:.0%} padding), {len(chunks)} chunks, branches "
              f"taken {taken} (of {len(branches)})")  # fmt: skip
        print(f"    dense lines {dense:.3e}, blocked {blocked:.3e} ({blocked / dense:.2f} of "
              f"dense), rows alone {own:.3e} ({own / dense:.2f} of dense)", flush=True)  # fmt: skip
        if args.buckets:
            widths, flops = bucket_flops(args, device, lengths, padded)
            print(f"    dense lines of {widths} tokens {flops:.3e} ({flops / dense:.2f} of "
                  "dense)", flush=True)  # fmt: skip
        if args.cpu_rounds:
            for name, t in cpu_times(args, chunks, padded).items():
                print(f"    XLA:CPU, {name}: {np.median(t):.3f} CPU s a batch "
                      f"({min(t):.3f}-{max(t):.3f}, {len(t)} rounds)", flush=True)  # fmt: skip


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
    if args.data:
        return held_out(args, device)
    print(f"{args.topology}: {args.lines} lines x {args.length} tokens, {args.heads} heads "
          f"of {args.head_dim}, bfloat16; value and gradient")  # fmt: skip
    for row in args.rows:
        for implementation in args.implementations:
            r = compile_one(args, device, implementation, row)
            print(f"  rows of {row:4d} tokens, {implementation:7s}: {r['flops']:.3e} FLOPs "
                  f"counted, compiled in {r['compile_s']:.1f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
