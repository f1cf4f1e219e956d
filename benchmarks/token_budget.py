"""Equal-row chunks vs token-budget chunks on the dual-encoder example's real data.

The data, tokenizer and model are the example's (``examples/dual_encoder.py``, tiny
model): docstring summaries padded to 32 tokens and code padded to 128, from the
Python sources installed here. Both settings compute the same exact gradient of the
example's loss (InfoNCE, learnable temperature) over a batch of ``--batch`` pairs:

* ``rows``: ``chunk_size=--chunk`` rows at the padded length (the example's old default);
* ``tokens``: ``gc_jax.TokenBudget(--tokens, --buckets)``: chunks of at most 1,024 tokens
  (half a ``rows`` chunk of code), rows trimmed to their bucket.

Printed, for each, in one run: the padded fraction of the tokens encoded (each
encoder pass encodes these tokens; the budget's padding rows count as padding), the
gradient step time (interleaved rounds over the same batches: median and range), the
compiled temp memory on this machine and on the TPU compiler (compile only, ``--tpu``;
the step on one chip of that topology), and the number of compiled chunk shapes.

Usage (from the repository root; ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` in front when another
process holds libtpu)::

    PYTHONPATH=examples python -m benchmarks.token_budget                # CPU time, memory
    PYTHONPATH=examples python -m benchmarks.token_budget --tpu v5e:2x2  # + TPU memory
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import gc_jax
from benchmarks.example_modules import dual_encoder, retrieval_data
from gc_jax import _token_chunks


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=16, help="rows of an equal-row chunk")
    parser.add_argument("--tokens", type=int, default=1024, help="the token budget of a chunk")
    parser.add_argument("--buckets", type=int, nargs="+", default=[16, 32, 64, 96, 128])
    parser.add_argument("--batches", type=int, default=8, help="distinct batches timed")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--tpu", metavar="TOPOLOGY", help="also compile for TPU, e.g. v5e:2x2")
    return parser.parse_args(argv)


def load(args):
    """The example's training pairs, tokenizer and tiny model; ``args.batches`` batches."""
    roots = retrieval_data.source_roots(retrieval_data.DEFAULT_PACKAGES)
    pairs = retrieval_data.mine_pairs(roots)
    split = retrieval_data.split_by_source(pairs, 1000, seed=0)
    model, tokenizer = dual_encoder.build_model("tiny", split.train, seed=0, dropout=0.0)
    data = dual_encoder.tokenize(tokenizer, split.train, dual_encoder.DEFAULTS["tiny"])
    order = np.random.default_rng(0).permutation(len(data))
    batches = [data.rows(order[i * args.batch : (i + 1) * args.batch]) for i in range(args.batches)]
    return model, batches, len(split.train)


def grad_step(model, chunk_size):
    """The example's gradient (no optimizer): ``(params, queries, documents) -> (loss, grads)``."""
    encode_encoder = gc_jax.nnx_encoder(model)
    encode = lambda params, chunk, key: encode_encoder(params["encoder"], chunk, key)

    def loss_fn(params, queries, documents):
        temperature = jnp.exp(params["log_temperature"])
        return gc_jax.losses.contrastive_loss(queries, documents, temperature=temperature)

    return jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, chunk_size))


def encoded_tokens(chunk_size, batch) -> tuple[int, int]:
    """(tokens encoded per pass, real tokens) of one input ``batch`` under ``chunk_size``."""
    mask = np.asarray(batch["attention_mask"])
    real = int(mask.sum())
    if not isinstance(chunk_size, gc_jax.TokenBudget):
        return mask.size, real
    plan = _token_chunks.make_plan(jax.tree.map(jnp.asarray, batch), chunk_size, "batch")
    trips = np.asarray(plan.trips)
    return int(sum(t * r * n for t, r, n in zip(trips, plan.rows, plan.lengths, strict=True))), real


def chunk_shapes(chunk_size, batch) -> list[tuple[int, int]]:
    rows, length = batch["input_ids"].shape
    if isinstance(chunk_size, gc_jax.TokenBudget):
        return list(chunk_size.chunk_shapes(length, rows))
    shapes = {(min(chunk_size, rows), length)}
    if rows % chunk_size:
        shapes.add((rows % chunk_size, length))
    return sorted(shapes)


def tpu_temp_bytes(step, params, batch, topology: str) -> int:
    """Temp memory of the step compiled for one chip of ``topology`` (compile only)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=topology, chips_per_host_bounds=(2, 2, 1)
    )
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    shape = lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=sharding)
    compiled = step.lower(*jax.tree.map(shape, (params, *batch))).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv=None) -> dict:
    args = parse_args(argv)
    model, batches, num_train = load(args)
    params = dual_encoder.initial_params(model)
    settings = {
        "rows": args.chunk,
        "tokens": gc_jax.TokenBudget(tokens=args.tokens, buckets=tuple(args.buckets)),
    }
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {num_train} training pairs")
    print(f"batch {args.batch}, {args.batches} batches, {args.rounds} interleaved rounds")
    results = {}
    for name, chunk_size in settings.items():
        step = grad_step(model, chunk_size)
        compiled = step.lower(params, *batches[0]).compile()
        encoded = np.array([[encoded_tokens(chunk_size, x) for x in b] for b in batches])
        results[name] = {
            "step": compiled,
            "times": [],
            "padded": 1 - encoded[..., 1].sum() / encoded[..., 0].sum(),
            "padded_docs": 1 - encoded[:, 1, 1].sum() / encoded[:, 1, 0].sum(),
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "shapes": [chunk_shapes(chunk_size, x) for x in batches[0]],
        }
        jax.block_until_ready(compiled(params, *batches[0]))  # warm up
    for _ in range(args.rounds):
        for r in results.values():
            tick = time.perf_counter()
            for b in batches:
                out = r["step"](params, *b)
            jax.block_until_ready(out)
            r["times"].append((time.perf_counter() - tick) / len(batches))
    if args.tpu:  # after the timing: compiling for TPU takes the CPU for a while
        for name, chunk_size in settings.items():
            step = grad_step(model, chunk_size)
            results[name]["tpu_temp"] = tpu_temp_bytes(step, params, batches[0], args.tpu)
    report(results, settings, args)
    return results


def report(results, settings, args) -> None:
    base = statistics.median(results["rows"]["times"])
    head = "| chunks | padded tokens (all / code) | step ms (median, range) | vs rows |"
    head += " temp MiB (CPU) |" + (f" temp MiB (TPU {args.tpu}) |" if args.tpu else "")
    print(head + " chunk shapes (queries; code) |")
    for name, r in results.items():
        t = [x * 1000 for x in r["times"]]
        med = statistics.median(t)
        tpu = f" {r['tpu_temp'] / 2**20:.1f} |" if args.tpu else ""
        shapes = "; ".join(", ".join(f"{a}x{b}" for a, b in s) for s in r["shapes"])
        count = sum(len(s) for s in r["shapes"])
        print(
            f"| {name}: {settings[name]} | {r['padded']:.1%} / {r['padded_docs']:.1%} | "
            f"{med:.0f} ({min(t):.0f}-{max(t):.0f}) | {med / base / 1000:.2f}x | "
            f"{r['temp'] / 2**20:.1f} |{tpu} {count}: {shapes} |"
        )


if __name__ == "__main__":
    main()
