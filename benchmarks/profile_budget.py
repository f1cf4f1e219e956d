"""Where a token-budget step and a packed step spend their time: each piece timed alone.

On one batch of ``benchmarks.token_budget``'s held-out data (``--data heldout`` or
``heldout2``: its encoder, its fitted budget ``fitted`` (or ``--setting``) and its
``packing``), each piece is jitted on its own and timed, interleaved, over ``--rounds``
rounds, against the whole step (``token_budget.grad_step``):

* ``forward``: the encoder's forward on one chunk of each shape the step encodes, times
  its number of chunks (pass 1);
* ``forward+backward``: the same under ``jax.vjp``, pulling a cotangent back to the
  parameters (pass 2);
* ``loss``: the loss and its gradient w.r.t. the two caches ``[B, d]`` and the
  temperature;
* ``plan, loops, scatters``: the step with an encoder that reads nothing of its chunk
  (its output a parameter broadcast to the chunk's rows), less ``loss``: the plan (a
  budget's sort and bucket spans, a packing's scan), both passes' chunk loops, the
  writes of each chunk's rows into the cache and the reads of their cotangents;
* ``gathers``: the step with an encoder that reads every leaf of its chunk, less the
  one above: the gathers of the rows (and, packed, the building of the lines).

The pieces' sum is printed next to the step: what it leaves out is what the pieces
do not capture (fusion across pieces, the chunk loops' dynamic slicing of the
parameters, cache effects). Only public ``gc_jax`` is used.

Usage (from the repository root)::

    PYTHONPATH=examples python -m benchmarks.profile_budget --data heldout --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import gc_jax
from benchmarks import common, token_budget
from benchmarks.example_modules import dual_encoder


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=["heldout", "heldout2", "heldout3"], default="heldout")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--setting", default="fitted", help="the budget: fitted, fitted+flops")
    return parser.parse_args(argv)


def chunk_of(shape: tuple[int, int], segments: int | None) -> dict:
    """A chunk of ``shape`` (lines x tokens): every token kept; packed, ``segments`` rows
    of equal length a line."""
    lines, n = shape
    pos = np.broadcast_to(np.arange(n), shape)
    chunk = {
        "input_ids": (pos % 97 + 1).astype(np.int32),
        "attention_mask": np.ones(shape, np.int32),
    }
    if segments:
        width = n // segments
        chunk["segment_ids"] = (np.minimum(pos // width, segments - 1) + 1).astype(np.int32)
        chunk["position_ids"] = (pos - (chunk["segment_ids"] - 1) * width).astype(np.int32)
        chunk["segment_starts"] = np.broadcast_to(np.arange(segments) * width, (lines, segments))
        chunk["segment_starts"] = chunk["segment_starts"].astype(np.int32)
    return {k: jnp.asarray(v) for k, v in chunk.items()}


def encoder_pieces(model, params, chunks, batch) -> dict:
    """``{name: (jitted function, args, times)}``: pass 1's and pass 2's chunks of each shape."""
    encode = gc_jax.nnx_encoder(model)
    forward = jax.jit(lambda p, x: encode(p, x, None))

    def pull(p, x):
        out, vjp = jax.vjp(lambda p: encode(p, x, None), p)
        return vjp(jnp.ones_like(out))

    backward, pieces = jax.jit(pull), {}
    for side, (c, x) in zip(("queries", "documents"), zip(chunks, batch, strict=True), strict=True):
        segments = getattr(c, "segments", None)
        for shape, count in token_budget.chunk_counts(c, x).items():
            chunk = chunk_of(shape, segments)
            name = f"{side} {shape[0]}x{shape[1]} x{count}"
            pieces[f"forward: {name}"] = (forward, (params["encoder"], chunk), count)
            pieces[f"forward+backward: {name}"] = (backward, (params["encoder"], chunk), count)
    return pieces


def library_steps(chunks, dim: int) -> tuple:
    """Steps whose encoder reads nothing of its chunk, and every leaf of it."""
    rows = lambda x: x["segment_starts"].size if "segment_starts" in x else x["input_ids"].shape[0]
    nothing = lambda p, x, key: jnp.broadcast_to(p["w"], (rows(x), dim))

    def everything(p, x, key):
        total = sum(jnp.sum(v.astype(jnp.float32)) for v in jax.tree.leaves(x))
        return nothing(p, x, key) * (1 + 0 * total)

    def loss_fn(params, queries, documents):
        temperature = jnp.exp(params["log_temperature"])
        return gc_jax.losses.contrastive_loss(queries, documents, temperature=temperature)

    make = lambda e: jax.jit(gc_jax.cached_value_and_grad(loss_fn, e, chunks))
    loss = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))
    return make(nothing), make(everything), loss


def time_all(pieces: dict, rounds: int) -> dict:
    """``{name: (wall s, CPU s) lists}``, one call each per round, interleaved."""
    times = {name: ([], []) for name in pieces}
    for f, args, _ in pieces.values():
        jax.block_until_ready(f(*args))  # compile and warm up
    for i in range(rounds):
        for name, (f, args, _) in list(pieces.items())[:: 1 if i % 2 == 0 else -1]:
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(f(*args))
            times[name][0].append(time.perf_counter() - wall)
            times[name][1].append(time.process_time() - cpu)
    return times


def profile(args, model, params, name, chunks, batch) -> None:
    dim = model.config.hidden_size
    trivial = {"w": jnp.ones((dim,)) / np.sqrt(dim), "log_temperature": params["log_temperature"]}
    nothing, everything, loss = library_steps(chunks, dim)
    reps = [jnp.ones((x["input_ids"].shape[0], dim)) / np.sqrt(dim) for x in batch]
    pieces = {
        "step": (token_budget.grad_step(model, chunks), (params, *batch), 1),
        **encoder_pieces(model, params, chunks, batch),
        "loss": (loss, (trivial, *reps), 1),
        "step, encoder reads nothing": (nothing, (trivial, *batch), 1),
        "step, encoder reads every leaf": (everything, (trivial, *batch), 1),
    }
    times = time_all(pieces, args.rounds)
    median = {k: [statistics.median(t) * pieces[k][2] for t in v] for k, v in times.items()}
    spread = lambda k, i: _spread([t * pieces[k][2] for t in times[k][i]])
    rows = [(k, spread(k, 0), spread(k, 1), median[k][1]) for k in pieces if k.startswith("f")]
    rows.append(("loss", spread("loss", 0), spread("loss", 1), median["loss"][1]))
    derived = {
        "plan, loops, scatters (reads nothing - loss)": (
            median["step, encoder reads nothing"][1] - median["loss"][1]
        ),
        "gathers (reads every leaf - reads nothing)": (
            median["step, encoder reads every leaf"][1] - median["step, encoder reads nothing"][1]
        ),
    }
    total = sum(r[3] for r in rows) + sum(derived.values())
    step = median["step"][1]
    print(f"\n{name}: {chunks}\n| piece | wall s | CPU s | CPU share of the step |")
    print("|---|---:|---:|---:|")
    for k, wall, cpu, med in rows:
        print(f"| {k} | {wall} | {cpu} | {med / step:.1%} |")
    for k, v in derived.items():
        print(f"| {k} | | {v:.3f} | {v / step:.1%} |")
    print(f"| sum of the pieces | | {total:.3f} | {total / step:.1%} |")
    print(f"| **step** | {spread('step', 0)} | {spread('step', 1)} | 100% |", flush=True)


def _spread(xs) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main(argv=None) -> None:
    args = parse_args(argv)
    data = token_budget.parse_args(["--data", args.data, "--settings", args.setting, "packing"])
    vocab, all_batches = token_budget.lognormal_batches(data, data.fit_batches + 1)
    fit, batch = all_batches[:-1], all_batches[-1]
    config = dual_encoder.tiny_config(vocab, data.document_length)
    if args.data in token_budget.WIDTHS:
        config = dataclasses.replace(config, **token_budget.WIDTHS[args.data])
    model = token_budget.Encoder(config, rngs=nnx.Rngs(0))
    params = dual_encoder.initial_params(model)
    print(common.machine())
    settings = token_budget.heldout_settings(data, fit, config.hidden_size)
    print(f"data {args.data}: batch {data.batch}, {args.rounds} interleaved rounds; CPU s of "
          "the medians (a piece's time x its chunks)")  # fmt: skip
    for name in (args.setting, "packing"):
        profile(args, model, params, name, settings[name], batch)
    print(f"after: {common.load()}")


if __name__ == "__main__":
    main()
