"""gc_jax against the original PyTorch GradCache (luyug/GradCache), on one accelerator.

Both train the same BERT-base dual encoder (``benchmarks/bert.py``; PyTorch:
``transformers.BertModel`` of the same sizes, random weights, no download) with the
same three passes, on the same batches (token ids and masks drawn by NumPy from one
seed) in chunks of the same size, and by default from the same weights (drawn by NumPy
in the parent process, with ``bert.init_params``'s distributions, copied into both),
so that their losses can be compared too:

* ``jax``: ``gc_jax.cached_value_and_grad`` over the two towers, jitted, InfoNCE with
  ``contrastive_loss(..., temperature=0.05, block_size=--block)``;
* ``torch``: ``GradCache(models=[query, passage], chunk_sizes=--chunk, loss_fn=...)``
  as its README shows it, eager, the dense InfoNCE of the same temperature.

Per framework, precision and batch: the median, min and max step time over ``--steps``
steps after ``--warmup`` untimed ones (the first compiles), the loss, the global norm
of the gradients, and the peak memory: ``torch.cuda.max_memory_allocated`` (and
``max_memory_reserved``); JAX's ``memory_stats()["peak_bytes_in_use"]`` and the
compiled ``memory_analysis()``; on a CPU neither device peak exists, and the process's
peak RSS is given instead. Precisions: ``fp32`` (float32 compute; matmuls in TF32 on
an NVIDIA GPU for both, ``--fp32-matmul highest`` for full float32) and ``bf16``
(JAX: bfloat16 compute, float32 parameters; PyTorch: ``torch.autocast(bfloat16)``
inside each tower's forward, float32 parameters, no loss scaling). Attention: PyTorch's
``sdpa`` (fused kernels on a GPU); JAX's cuDNN fused attention for bf16 on a GPU
(``--attention auto``), else the XLA implementation.

Each framework runs in its own process, one after the other, so that their
allocators never share the device; the parent touches no device (it imports JAX for
the parameters' shapes only, ``jax.eval_shape``) and prints each phase's wall time.
``--time-limit`` bounds the whole run: a worker still running then is stopped, and
those not started are skipped.

``--plan DIR``: the whole GPU comparison in one command, bounded in time (so that a
machine rented by the minute runs it unattended). The runs below, one
after the other, most valuable first, each under its own time limit and never past
``--time-limit`` in all (420 s by default; a run that would start with under
``--min-step-s`` left is skipped), the weights drawn once for all of them; each run's
JSON goes to ``DIR/vs_pytorch_<name>.json`` as it ends, and ``DIR/vs_pytorch_plan.json``
says which ran, how long each took and how each ended. A run that fails or times out
does not stop the next. The runs (chunks of 256 rows; ``--tiny``: the 2-layer model,
chunks of 8, batches of 32 for 4,096 and 64 for 65,536, a CPU check of the plan):

1. bf16, B = 4,096, both sides, ``--check`` (the same weights: losses and gradients);
2. bf16, B = 65,536, both sides, two timed steps (XLA's attention in both bf16 runs);
3. fp32, B = 4,096, both sides;
4. bf16, B = 4,096, gc_jax only, cuDNN's fused attention (``--attention cudnn``);
5. fp32, B = 65,536, both sides, two timed steps.

Usage::

    python -m benchmarks.vs_pytorch --precisions bf16 --batches 4096 65536 --chunk 256
    python -m benchmarks.vs_pytorch --tiny --check   # CPU smoke test, both sides agree
    python -m benchmarks.vs_pytorch --tiny --frameworks jax   # no PyTorch needed
    python -m benchmarks.vs_pytorch --plan DIR --time-limit 420   # the GPU plan
    python -m benchmarks.vs_pytorch --plan /tmp/plan --tiny --frameworks jax

The PyTorch side needs ``torch``, ``transformers`` and GradCache: ``pip install
gradcache==0.0.1`` (its module imports itself as ``grad_cache``, which that package
does not provide; this script aliases it) or luyug/GradCache from source.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TEMPERATURE = 0.05
GIB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", help="rows per step (default 4096 65536)")
    p.add_argument("--chunk", type=int, help="rows per chunk, both sides (default 256)")
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    p.add_argument("--frameworks", nargs="+", default=["jax", "torch"], choices=["jax", "torch"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per batch")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile)")
    p.add_argument("--block", type=int, default=4096, help="JAX's loss block_size; 0: dense")
    p.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn", "xla_remat"])
    p.add_argument("--fp32-matmul", default="tf32", choices=["tf32", "highest"])
    p.add_argument("--torch-compile", action="store_true", help="torch.compile each tower")
    p.add_argument("--no-same-weights", dest="same_weights", action="store_false")
    p.add_argument("--check", action="store_true", help="compare losses and every gradient")
    p.add_argument("--budget-s", type=float, default=540.0, help="per process: no new step after")
    p.add_argument("--torch-python", default=sys.executable, help="Python of the torch side")
    p.add_argument("--tiny", action="store_true", help="a 2-layer BERT, small batches: CPU")
    p.add_argument("--json", type=Path, help="default benchmarks/results/vs_pytorch.json")
    p.add_argument("--time-limit", type=float, help="seconds for the whole run (workers stopped)")
    p.add_argument("--weights", help="an npz of draw_weights' (default: drawn here, per run)")
    p.add_argument("--plan", type=Path, metavar="DIR", help="the GPU plan's runs, JSON in DIR")
    p.add_argument("--min-step-s", type=float, default=40.0, help="--plan: no run with less left")
    p.add_argument("--worker", choices=["jax", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=json.loads, help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.plan and (args.batches or args.check or args.weights or args.json):
        p.error("--plan sets each run's --batches, --check, --weights and --json itself")
    args.batches = args.batches or ([32, 64] if args.tiny else [4096, 65536])
    args.chunk = args.chunk or (8 if args.tiny else 256)
    if args.steps < 1 or args.warmup < 1:
        p.error(
            f"--steps {args.steps} --warmup {args.warmup}: both at least 1 (the first compiles)"
        )
    if any(rows % args.chunk for rows in args.batches):
        p.error(f"--batches {args.batches}: each a multiple of --chunk {args.chunk}")
    return args


# --- what both sides share: the sizes and the batches (NumPy) -----------------------------


def model_sizes(tiny: bool) -> dict:
    from benchmarks import bert  # imports JAX, initialises no device

    cfg = bert.TINY if tiny else bert.BertConfig()
    names = ("vocab", "layers", "width", "heads", "mlp", "query_len", "passage_len")
    return {name: getattr(cfg, name) for name in names}


def make_batch(rows: int, length: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Token ids and prefix masks (at least a quarter of each row), the same on both sides."""
    rng = np.random.default_rng([seed, rows, length])
    ids = rng.integers(0, vocab, (rows, length), dtype=np.int32)
    lengths = rng.integers(length // 4, length + 1, (rows, 1))
    return {"ids": ids, "mask": np.arange(length)[None, :] < lengths}


def batches(sizes: dict, rows: int) -> tuple[dict, dict]:
    return (make_batch(rows, sizes["query_len"], sizes["vocab"], 0),
            make_batch(rows, sizes["passage_len"], sizes["vocab"], 1))  # fmt: skip


def _host() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cpu}, nproc={os.cpu_count()}, load average {load}"


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _summary(times: list[float]) -> dict:
    return {"times_s": times, "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times)}  # fmt: skip


def _emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def _progress(args: argparse.Namespace, what: str) -> None:
    """A worker's progress (the parent shows it as it comes): what, and when since start."""
    print(f"    {args.worker} {args.precision}: {what} at {time.perf_counter() - args.t0:.1f} s",
          flush=True)  # fmt: skip


# --- the JAX side ------------------------------------------------------------------------


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _flatten(tree) -> dict:
    import jax

    return {_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _jax_params(cfg, weights: str | None):
    import jax

    from benchmarks import bert

    if not weights:
        return bert.init_params(cfg, jax.random.key(0))
    with np.load(weights) as f:
        flat = dict(f)
    paths, treedef = jax.tree_util.tree_flatten_with_path(bert.abstract_params(cfg))
    return jax.tree.unflatten(treedef, [jax.numpy.asarray(flat[_name(p)]) for p, _ in paths])


def _draw(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One parameter as ``bert.init_tower`` draws it: normal * 0.02 for the embeddings and
    the dense weights, zeros for the biases, ones for the LayerNorm scales."""
    leaf = name.rsplit("/", 1)[-1]
    if leaf in ("tokens", "positions", "w"):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    if leaf in ("b", "bias", "scale"):
        return np.full(shape, leaf == "scale", np.float32)
    raise ValueError(f"parameter {name!r}: no initialiser known; add one to _draw")


def draw_weights(tiny: bool, path: str | Path, seed: int = 0) -> None:
    """Both towers' parameters, drawn by NumPy from ``seed`` with ``bert.init_params``'s
    distributions, saved flat (float32) to ``path``; JAX gives the shapes only
    (``jax.eval_shape``: no device is initialised, nothing is allocated by JAX)."""
    from benchmarks import bert

    rng = np.random.default_rng(seed)
    shapes = _flatten(bert.abstract_params(bert.TINY if tiny else bert.BertConfig()))
    np.savez(path, **{name: _draw(rng, name, leaf.shape) for name, leaf in shapes.items()})


def _jax_step(args: argparse.Namespace):
    """gc_jax's jitted step, its parameters and the row fields every batch shares."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from benchmarks import bert

    gpu, fp32 = jax.default_backend() == "gpu", args.precision == "fp32"
    if fp32 and gpu:
        precision = "tensorfloat32" if args.fp32_matmul == "tf32" else "highest"
        jax.config.update("jax_default_matmul_precision", precision)
    attention = args.attention
    if attention == "auto":
        attention = "cudnn" if gpu and not fp32 else "xla"
    cfg = dataclasses.replace(
        bert.TINY if args.tiny else bert.BertConfig(),
        compute_dtype=jnp.float32 if fp32 else jnp.bfloat16,
        attention=attention,
    )
    step = jax.jit(bert.steps(cfg, args.chunk, args.block or None)["gc_jax"])
    loss = f"contrastive_loss(temperature={TEMPERATURE}, block_size={args.block or None})"
    versions = {name: _version(name) for name in ("jax", "jaxlib", "flax", "optax")}
    base = {"framework": "jax", "precision": args.precision, "chunk": args.chunk,
            "attention": attention, "device": jax.devices()[0].device_kind, "loss_fn": loss,
            "versions": versions}  # fmt: skip
    return step, _jax_params(cfg, args.weights), base


def _jax_batch(args: argparse.Namespace, step, params, rows: int, start: float) -> dict:
    """One batch: compile, time, and read the loss, the gradients and the memory."""
    import jax
    import jax.numpy as jnp

    q, p = (jax.tree.map(jnp.asarray, b) for b in batches(args.sizes, rows))
    t0 = time.perf_counter()
    compiled = step.lower(params, q, p).compile()
    row = {"batch": rows, "compile_s": time.perf_counter() - t0}
    _progress(args, f"B={rows} compiled in {row['compile_s']:.1f} s")
    m = compiled.memory_analysis()
    kinds = ("argument", "temp", "output", "alias")
    row["compiled_bytes"] = {k: getattr(m, f"{k}_size_in_bytes", None) for k in kinds}
    times, (loss, grads) = _time_steps(
        args, lambda: jax.block_until_ready(compiled(params, q, p)), start
    )
    flat = {k: np.asarray(v, np.float32) for k, v in _flatten(grads).items()}
    stats = jax.devices()[0].memory_stats() or {}
    row.update(_summary(times), status="ok", loss=float(loss), grad_norm=_norm(flat),
               peak_bytes=stats.get("peak_bytes_in_use"), bytes_limit=stats.get("bytes_limit"),
               host_peak_rss_bytes=_rss())  # fmt: skip
    if args.dump:
        np.savez(Path(args.dump) / f"jax_{args.precision}_{rows}.npz", **flat)
    return row


def jax_worker(args: argparse.Namespace) -> None:
    """One JSON line per batch: gc_jax's step in ``--precision``; stops at an error."""
    import jax

    step, params, base = _jax_step(args)
    if jax.default_backend() == "cpu" and shutil.which("nvidia-smi") and not args.tiny:
        sys.exit("gc_jax worker: JAX fell back to the CPU on a machine with a GPU (see above)")
    _progress(args, f"ready ({base['device']}, {base['attention']} attention)")
    start = time.perf_counter()
    for rows in args.batches:
        try:
            _emit(dict(base, **_jax_batch(args, step, params, rows, start)))
        except Exception as e:  # out of memory, most likely: say so, try no larger batch
            _emit(dict(base, batch=rows, status="error", error=f"{type(e).__name__}: {e}"[:600]))
            return


def _norm(flat: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in flat.values())))


def _time_steps(args: argparse.Namespace, step, start: float):
    """Runs ``--warmup`` untimed steps, then up to ``--steps`` timed ones (at least one)
    while the process's ``--budget-s`` lasts; the times and the first step's output."""
    first = step()
    for _ in range(args.warmup - 1):
        step()
    _progress(args, f"{args.warmup} untimed step(s) done")
    times = []
    while len(times) < args.steps and (not times or time.perf_counter() - start < args.budget_s):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times, first


# --- the PyTorch side ----------------------------------------------------------------------


def _torch_step(args: argparse.Namespace):
    """GradCache over the two towers, the towers, and the row fields every batch shares."""
    import torch
    import transformers

    from benchmarks import torch_bert

    GradCache, source = torch_bert.import_gradcache()
    cuda = torch.cuda.is_available()
    if cuda:
        tf32 = args.fp32_matmul == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    flat = dict(np.load(args.weights)) if args.weights else None
    bf16 = args.precision == "bf16"
    towers = torch_bert.towers(args.sizes, bf16, "cuda" if cuda else "cpu", flat)
    models = [torch.compile(t) for t in towers] if args.torch_compile else towers

    def loss_fn(q, p):  # InfoNCE, the same temperature, dense (as GradCache's README)
        logits = q.float() @ p.float().T / TEMPERATURE
        return torch.nn.functional.cross_entropy(logits, torch.arange(len(q), device=q.device))

    gc = GradCache(models=models, chunk_sizes=args.chunk, loss_fn=loss_fn)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "gradcache": source}  # fmt: skip
    base = {"framework": "torch", "precision": args.precision, "chunk": args.chunk,
            "attention": "sdpa", "device": torch.cuda.get_device_name() if cuda else "cpu",
            "loss_fn": f"dense cross_entropy(q @ p.T / {TEMPERATURE})",
            "torch_compile": args.torch_compile, "versions": versions}  # fmt: skip
    return gc, towers, base


def _torch_batch(args: argparse.Namespace, gc, towers, rows: int, start: float) -> dict:
    """One batch: time the step, read the loss, the gradients and the memory."""
    import torch

    from benchmarks import torch_bert

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    q, p = ({"input_ids": torch.from_numpy(b["ids"]).long().to(device),
             "attention_mask": torch.from_numpy(b["mask"]).long().to(device)}
            for b in batches(args.sizes, rows))  # fmt: skip

    def step():
        for t in towers:
            t.zero_grad(set_to_none=True)
        loss = gc(q, p)
        if cuda:
            torch.cuda.synchronize()
        return loss

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, loss = _time_steps(args, step, start)
    grads = torch_bert.gradients(towers, args.sizes["layers"])  # the last step's: the same
    row = dict(_summary(times), batch=rows, status="ok", loss=float(loss), grad_norm=_norm(grads),
               peak_bytes=torch.cuda.max_memory_allocated() if cuda else None,
               peak_reserved_bytes=torch.cuda.max_memory_reserved() if cuda else None,
               host_peak_rss_bytes=_rss())  # fmt: skip
    if args.dump:
        np.savez(Path(args.dump) / f"torch_{args.precision}_{rows}.npz", **grads)
    return row


def torch_worker(args: argparse.Namespace) -> None:
    """One JSON line per batch: GradCache's step in ``--precision``; stops at out of memory."""
    import torch

    gc, towers, base = _torch_step(args)
    _progress(args, f"ready ({base['device']})")
    start = time.perf_counter()
    for rows in args.batches:
        try:
            _emit(dict(base, **_torch_batch(args, gc, towers, rows, start)))
        except torch.OutOfMemoryError as e:
            _emit(dict(base, batch=rows, status="error", error=f"OutOfMemoryError: {e}"[:600]))
            return


# --- the parent: one process per framework and precision ---------------------------------


def run_worker(args: argparse.Namespace, worker: str, extra: list[str], python: str) -> list:
    """One worker's rows (a row saying why where it failed, timed out or never started)."""
    left = args.stop_at - time.perf_counter()
    if left < 10:
        print(f"  [{worker} {args.precision}: skipped, {max(left, 0):.0f} s left]", flush=True)
        return [{"framework": worker, "precision": args.precision, "status": "skipped",
                 "error": f"--time-limit: {max(left, 0):.0f} s left"}]  # fmt: skip
    budget = min(args.budget_s, left / 2)  # no new timed step after it: leaves time to end
    cmd = [python, "-m", "benchmarks.vs_pytorch", "--worker", worker, "--sizes",
           json.dumps(args.sizes), "--batches", *map(str, args.batches), "--chunk",
           str(args.chunk), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--block", str(args.block), "--attention", args.attention, "--fp32-matmul",
           args.fp32_matmul, "--budget-s", f"{budget:.0f}", *extra,
           *(["--tiny"] if args.tiny else []),
           *(["--torch-compile"] if args.torch_compile else [])]  # fmt: skip
    # Each worker has the device to itself: JAX may take 95 % of it. One name of the knob
    # only: jaxlib refuses both at once, and then falls back to the CPU (an H200 run did).
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.95")
    env.pop("XLA_CLIENT_MEM_FRACTION", None)
    t0 = time.perf_counter()
    stdout, code, err = _run(cmd, env, timeout=min(budget + 300, left))
    # Where the time goes (a run on an H200 printed nothing for minutes): every worker.
    print(f"  [{worker} {args.precision}: {time.perf_counter() - t0:.1f} s]", flush=True)
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if code:
        last = err.strip().splitlines()[-3:] if err else []
        print(f"  {worker}: exit {code} after {len(rows)} batch(es): {' '.join(last)[:400]}")
        rows.append({"framework": worker, "status": f"exit {code}", "error": " ".join(last)[-400:],
                     "precision": args.precision})  # fmt: skip
    return rows


def _run(cmd: list[str], env: dict, timeout: float) -> tuple[str, int | str, str]:
    """Runs ``cmd`` in its own process group: stdout, exit code (``"timeout"``), stderr.
    At the timeout the whole group is killed (a compiler it started too), and the device
    it held is free again when this returns."""
    lines = []
    with tempfile.TemporaryFile("w+") as err, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env,
        start_new_session=True,
    ) as proc:  # fmt: skip
        reader = threading.Thread(target=_echo, args=(proc.stdout, lines), daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
        reader.join()
        err.seek(0)
        return "".join(lines), code, err.read()


def _echo(stream, lines: list[str]) -> None:
    """Collects a worker's stdout, showing its progress lines (all but rows) as they come."""
    for line in stream:
        lines.append(line)
        if not line.startswith("{"):
            print(line, end="", flush=True)


def show(row: dict) -> None:
    name = f"  {row['framework']:5s} {row.get('precision', ''):4s} B={row.get('batch', '?'):>6}"
    if row.get("status") != "ok":
        print(f"{name}: {row.get('status')} {row.get('error', '')[:300]}", flush=True)
        return
    peak = row.get("peak_bytes")
    peak = (
        f"peak {peak / GIB:.2f} GiB" if peak else f"RSS {row['host_peak_rss_bytes'] / GIB:.2f} GiB"
    )
    print(f"{name} chunk {row['chunk']}: median {row['median_s'] * 1e3:9.1f} ms (min "
          f"{row['min_s'] * 1e3:.1f}, max {row['max_s'] * 1e3:.1f}, {len(row['times_s'])} steps), "
          f"{peak}, loss {row['loss']:.6f}, |grad| {row['grad_norm']:.6g}", flush=True)  # fmt: skip


def agreement(dump: str, precision: str, rows: int, runs: list[dict]) -> dict | None:
    """Loss and gradients of both sides at one precision and batch (``--check``).

    A gradient's error is its largest difference over its largest entry (JAX's), except
    for gradients whose entries all lie below 1e-4 of the largest entry of any gradient
    (zero in exact arithmetic: the last LayerNorm bias of the passage tower, whose InfoNCE
    gradient sums to zero over the passages); and the largest difference of all over
    that largest entry.
    """
    files = [Path(dump) / f"{fw}_{precision}_{rows}.npz" for fw in ("jax", "torch")]
    ok = [r for r in runs if r.get("status") == "ok"]
    by = {r["framework"]: r for r in ok if (r["precision"], r["batch"]) == (precision, rows)}
    if not all(f.exists() for f in files) or len(by) < 2:
        return None
    with np.load(files[0]) as a, np.load(files[1]) as b:
        if set(a) != set(b):
            raise ValueError(f"gradients differ in names: {sorted(set(a) ^ set(b))}")
        tops = {k: float(np.abs(a[k]).max()) for k in a}
        diffs = {k: float(np.abs(a[k] - b[k]).max()) for k in a}
    scale = max(tops.values())
    near_zero = sorted(k for k in tops if tops[k] < 1e-4 * scale)
    errors = {k: diffs[k] / tops[k] for k in tops if k not in near_zero}
    worst = max(errors, key=errors.get)
    loss = {fw: by[fw]["loss"] for fw in ("jax", "torch")}
    return {"precision": precision, "batch": rows, "loss_jax": loss["jax"],
            "loss_torch": loss["torch"],
            "loss_rel_diff": abs(loss["jax"] - loss["torch"]) / abs(loss["jax"]),
            "gradients": len(tops), "grad_max_rel_diff": errors[worst], "worst": worst,
            "grad_median_rel_diff": statistics.median(errors.values()),
            "near_zero_gradients": near_zero,
            "grad_max_diff_of_largest_entry": max(diffs.values()) / scale}  # fmt: skip


def _header(args: argparse.Namespace, argv) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    argv = sys.argv[1:] if argv is None else argv
    return {"command": " ".join(["python -m benchmarks.vs_pytorch", *argv]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit,
            "host": _host(), "model": args.sizes, "tiny": args.tiny, "chunk": args.chunk,
            "steps": args.steps, "warmup": args.warmup, "jax_block_size": args.block or None,
            "fp32_matmul": args.fp32_matmul, "same_weights": args.same_weights,
            "runs": [], "agreement": []}  # fmt: skip


def _shared_weights(args: argparse.Namespace, tmp: str) -> list[str]:
    """The workers' ``--weights`` arguments: ``--weights``, else drawn here (NumPy)."""
    if not args.same_weights:
        return []
    if not args.weights:
        t0, args.weights = time.perf_counter(), f"{tmp}/weights.npz"
        draw_weights(args.tiny, args.weights)
        size = Path(args.weights).stat().st_size / 1e9
        print(f"  [weights drawn and saved ({size:.2f} GB): {time.perf_counter() - t0:.1f} s]",
              flush=True)  # fmt: skip
    return ["--weights", args.weights]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        args.t0 = time.perf_counter()
        return {"jax": jax_worker, "torch": torch_worker}[args.worker](args)
    if args.plan:
        return run_plan(args, argv)
    t_start = time.perf_counter()
    args.stop_at = t_start + (args.time_limit or float("inf"))
    args.sizes = model_sizes(args.tiny)
    path = args.json or ROOT / "benchmarks" / "results" / "vs_pytorch.json"
    results = _header(args, argv)
    print(f"{results['host']}; model {args.sizes}; chunk {args.chunk}, batches {args.batches}",
          flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        extra = _shared_weights(args, tmp) + (["--dump", tmp] if args.check else [])
        for precision in args.precisions:
            args.precision = precision
            for fw in args.frameworks:
                python = args.torch_python if fw == "torch" else sys.executable
                rows = run_worker(args, fw, [*extra, "--precision", precision], python)
                for row in rows:
                    show(row)
                results["runs"] += rows
                write_json(path, results)
            for rows in args.batches if args.check else []:
                found = agreement(tmp, precision, rows, results["runs"])
                if found:
                    results["agreement"].append(found)
                    show_agreement(found)
    ratios(results["runs"])
    write_json(path, results)
    print(f"wrote {path} [{time.perf_counter() - t_start:.1f} s in all]", flush=True)


def show_agreement(found: dict) -> None:
    print(f"  agree {found['precision']} B={found['batch']}: loss rel diff "
          f"{found['loss_rel_diff']:.2e}, gradients max rel diff "
          f"{found['grad_max_rel_diff']:.2e} ({found['worst']}), median "
          f"{found['grad_median_rel_diff']:.2e}; largest difference "
          f"{found['grad_max_diff_of_largest_entry']:.1e} of the largest entry",
          flush=True)  # fmt: skip


def ratios(runs: list[dict]) -> None:
    """torch / jax, per precision and batch where both ran: step time and peak memory."""
    ok = {(r["framework"], r["precision"], r["batch"]): r for r in runs if r.get("status") == "ok"}
    for (fw, precision, rows), r in sorted(ok.items()):
        other = ok.get(("torch", precision, rows))
        if fw != "jax" or not other:
            continue
        line = (
            f"  {precision} B={rows}: step time torch/jax {other['median_s'] / r['median_s']:.3f}"
        )
        if r.get("peak_bytes") and other.get("peak_bytes"):
            line += f", peak memory torch/jax {other['peak_bytes'] / r['peak_bytes']:.2f}"
        print(line)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


# --- --plan: the GPU plan, its runs in order of value, in time ---------------------------

# (name, seconds at most, this script's arguments), most valuable first. The times are
# planned from the H200's: a 4,096-row worker took 30-50 s (33 s of it compiling); a
# 65,536-row step of gc_jax ~22 s in bf16, GradCache's ~30 s. XLA's attention in bf16
# but for run 4: cuDNN's (``--attention auto``'s choice for bf16 on a GPU) has never run,
# and the parent's path that chose it there printed no row in minutes.
PLAN = (
    ("bf16_4096_check", 150, "--precisions bf16 --batches 4096 --check --attention xla"),
    (
        "bf16_65536",
        240,
        "--precisions bf16 --batches 65536 --steps 2 --budget-s 100 --attention xla",
    ),
    ("fp32_4096", 120, "--precisions fp32 --batches 4096"),
    ("bf16_4096_cudnn", 90, "--precisions bf16 --batches 4096 --frameworks jax --attention cudnn"),
    ("fp32_65536", 240, "--precisions fp32 --batches 65536 --steps 2 --budget-s 100"),
)
TINY_BATCHES = {"4096": "32", "65536": "64"}


def plan_argv(args: argparse.Namespace, name: str, flags: str, limit: float, weights: str):
    """This script's arguments for one run of the plan, or None if none of its
    frameworks is among ``--frameworks``."""
    argv = flags.split()
    if "--frameworks" in argv:
        at = argv.index("--frameworks")
        wanted = [fw for fw in argv[at + 1 : at + 2] if fw in args.frameworks]
        if not wanted:
            return None
        del argv[at : at + 2]
    else:
        wanted = args.frameworks
    if args.tiny:
        argv = [TINY_BATCHES.get(a, a) for a in argv] + ["--tiny"]
    return [*argv, "--frameworks", *wanted, "--time-limit", f"{limit:.0f}", "--weights",
            weights, "--torch-python", args.torch_python, "--json",
            str(args.plan / f"vs_pytorch_{name}.json")]  # fmt: skip


def _plan_run(argv: list[str]) -> str:
    """One run of the plan in this process: how it ended."""
    try:
        main(argv)
    except (Exception, SystemExit) as e:  # the next run still gets its turn
        traceback.print_exc()
        return f"error: {type(e).__name__}: {e}"[:400]
    return "done"


def run_plan(args: argparse.Namespace, argv=None) -> None:
    """``--plan``: every run of ``PLAN`` in turn, within ``--time-limit`` (420 s)."""
    start, limit = time.perf_counter(), args.time_limit or 420.0
    args.plan.mkdir(parents=True, exist_ok=True)
    done = []
    with tempfile.TemporaryDirectory() as tmp:
        weights = f"{tmp}/weights.npz"
        draw_weights(args.tiny, weights)
        print(f"[plan: weights drawn and saved: {time.perf_counter() - start:.1f} s]", flush=True)
        for name, most, flags in PLAN:
            left = limit - (time.perf_counter() - start)
            argv_ = plan_argv(args, name, flags, min(most, left), weights)
            if argv_ is None or left < args.min_step_s:
                why = "skipped: " + ("no framework" if argv_ is None else f"{left:.0f} s left")
                done.append({"name": name, "status": why})
            else:
                print(f"[plan: {name}, at most {min(most, left):.0f} s]", flush=True)
                t0 = time.perf_counter()
                status = _plan_run(argv_)
                done.append({"name": name, "argv": argv_, "status": status,
                             "wall_s": round(time.perf_counter() - t0, 1)})  # fmt: skip
            print(f"[plan: {name}: {done[-1]['status']} {done[-1].get('wall_s', '')}]", flush=True)
            plan = {"command": " ".join(["python -m benchmarks.vs_pytorch",
                                         *(sys.argv[1:] if argv is None else argv)]),
                    "time_limit_s": limit, "steps": done}  # fmt: skip
            write_json(args.plan / "vs_pytorch_plan.json", plan)
    print(f"[plan: {time.perf_counter() - start:.1f} s in all]", flush=True)


if __name__ == "__main__":
    main()
