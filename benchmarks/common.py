"""The benchmarks' shared helpers: the one place for code that more than one script uses.

* the MLP encoder and the training steps compared (below);
* timing: interleaved rounds, paired ratios; the machine and its load;
* files: where results and plots go, JSON and figures, recorded commands;
* the command line of the MLP benchmarks;
* compiling for a TPU chip, compile only: devices, placement, out-of-memory messages,
  the bytes the buffer assignment allocates.

Every step has the signature ``step(params, queries, documents) -> (loss, grads)``
and computes the gradient of the same InfoNCE loss
(``gc_jax.losses.contrastive_loss``) of a tied MLP encoder over the whole batch:

* ``full``: plain ``jax.value_and_grad`` of the full-batch loss;
* ``remat``: the same with the encoder wrapped in ``jax.checkpoint`` (the whole
  encoder is one remat block: only its input is saved, its activations are
  recomputed in the backward pass);
* ``remat_layers``: every hidden layer under ``jax.checkpoint`` instead (each layer's
  input is saved, its internals recomputed);
* ``gc``: ``gc_jax.cached_value_and_grad`` with ``chunk`` rows encoded at a time;
* ``chunked_encoder``: the encoder wrapped in ``gc_jax.chunked_encoder`` (``chunk``
  rows at a time) inside a plain ``jax.value_and_grad`` of the same loss, as a user
  would write it (its backward re-encodes every chunk, the last one included);
* ``gc_block``: the same with the blockwise loss (``block_size=``), if the loss has it;
  ``full_block``, ``remat_layers_block``: the baselines with the blockwise loss.
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import math
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import gc_jax

Params = dict[str, Any]
Step = Callable[[Params, jax.Array, jax.Array], tuple[jax.Array, Params]]

TEMPERATURE = 0.05


@dataclass(frozen=True)
class ModelConfig:
    """An MLP encoder: ``depth`` hidden layers ``width -> width`` (GELU), then a projection.

    The first hidden layer maps ``dim_in -> width``; the output is L2-normalised.
    """

    depth: int = 6
    width: int = 512
    dim_in: int = 512
    dim_out: int = 128
    dtype: Any = jnp.float32

    def describe(self) -> str:
        return (
            f"MLP: {self.depth} hidden layers {self.dim_in}->{self.width}"
            f"{'->' + str(self.width) if self.depth > 1 else ''} (GELU), "
            f"projection {self.width}->{self.dim_out}, L2-normalised, "
            f"{jnp.dtype(self.dtype).name}, {num_params(self):,} parameters"
        )


def num_params(cfg: ModelConfig) -> int:
    hidden = cfg.dim_in * cfg.width + (cfg.depth - 1) * cfg.width**2 + cfg.depth * cfg.width
    return hidden + cfg.width * cfg.dim_out + cfg.dim_out


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """He-initialised weights, zero biases."""
    dims = [cfg.dim_in] + [cfg.width] * cfg.depth + [cfg.dim_out]
    keys = jax.random.split(key, len(dims) - 1)
    layers = [
        {
            "w": (jax.random.normal(k, (a, b)) * (2.0 / a) ** 0.5).astype(cfg.dtype),
            "b": jnp.zeros((b,), cfg.dtype),
        }
        for k, a, b in zip(keys, dims[:-1], dims[1:], strict=True)
    ]
    return {"layers": layers}


def param_shapes(cfg: ModelConfig) -> Params:
    """``ShapeDtypeStruct``s of the parameters (for compiling without allocating)."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def _hidden(layer: Params, x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x @ layer["w"] + layer["b"])


def _encode(params: Params, x: jax.Array, hidden: Callable[[Params, jax.Array], jax.Array]):
    *layers, out = params["layers"]
    for layer in layers:
        x = hidden(layer, x)
    y = x @ out["w"] + out["b"]
    return y / jnp.linalg.norm(y, axis=-1, keepdims=True)


def encode(params: Params, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """The encoder, in ``gc_jax``'s ``encode(params, chunk, key)`` form (no dropout)."""
    del key
    return _encode(params, x, _hidden)


def encode_remat_layers(params: Params, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """The same encoder with every hidden layer under ``jax.checkpoint``.

    Only each layer's input is saved for the backward pass; the layer's internals
    (matmul output, GELU intermediates) are recomputed there.
    """
    del key
    return _encode(params, x, jax.checkpoint(_hidden))


def has_block_size() -> bool:
    """Whether ``gc_jax.losses.contrastive_loss`` takes ``block_size=`` (blockwise loss)."""
    return "block_size" in inspect.signature(gc_jax.losses.contrastive_loss).parameters


def loss_fn(block_size: int | None = None) -> Callable[..., jax.Array]:
    """``loss(params, q_reps, d_reps)``: InfoNCE, dense or in ``block_size`` tiles."""
    extra = {} if block_size is None else {"block_size": block_size}

    def loss(params: Params, q: jax.Array, d: jax.Array) -> jax.Array:
        del params
        return gc_jax.losses.contrastive_loss(q, d, temperature=TEMPERATURE, **extra)

    return loss


def full_batch_step(remat: str | None = None, block_size: int | None = None) -> Step:
    """Plain ``jax.value_and_grad`` of the full-batch loss.

    ``remat``: None, ``"encoder"`` (the whole encoder is one ``jax.checkpoint``
    block) or ``"layers"`` (every hidden layer is one).
    """
    enc = {None: encode, "encoder": jax.checkpoint(encode), "layers": encode_remat_layers}[remat]
    loss = loss_fn(block_size)

    def total(params: Params, q: jax.Array, d: jax.Array) -> jax.Array:
        return loss(params, enc(params, q, None), enc(params, d, None))

    return jax.value_and_grad(total)


def cached_step(chunk: int, block_size: int | None = None) -> Step:
    """``gc_jax.cached_value_and_grad`` of the same loss, ``chunk`` rows at a time."""
    return gc_jax.cached_value_and_grad(loss_fn(block_size), encode, chunk)


def chunked_encoder_step(chunk: int, block_size: int | None = None) -> Step:
    """``jax.value_and_grad`` of the same loss, the encoder wrapped in ``chunked_encoder``."""
    encode_batch = gc_jax.chunked_encoder(encode, chunk)
    loss = loss_fn(block_size)

    def total(params: Params, q: jax.Array, d: jax.Array) -> jax.Array:
        return loss(params, encode_batch(params, q), encode_batch(params, d))

    return jax.value_and_grad(total)


def make_steps(chunk: int, block_size: int | None, names: Sequence[str]) -> dict[str, Step]:
    """The named (un-jitted) steps; ``gc_block`` only if the loss supports ``block_size``."""
    table: dict[str, Callable[[], Step]] = {
        "full": lambda: full_batch_step(),
        "remat": lambda: full_batch_step(remat="encoder"),
        "remat_layers": lambda: full_batch_step(remat="layers"),
        "gc": lambda: cached_step(chunk),
        "chunked_encoder": lambda: chunked_encoder_step(chunk),
        "full_block": lambda: full_batch_step(block_size=block_size),
        "remat_layers_block": lambda: full_batch_step(remat="layers", block_size=block_size),
        "gc_block": lambda: cached_step(chunk, block_size),
    }
    return {name: table[name]() for name in names if "block" not in name or has_block_size()}


def make_batch(cfg: ModelConfig, batch: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Queries and documents; each document is a noisy copy of its query."""
    kq, kd = jax.random.split(key)
    q = jax.random.normal(kq, (batch, cfg.dim_in), cfg.dtype)
    d = q + 0.5 * jax.random.normal(kd, (batch, cfg.dim_in), cfg.dtype)
    return q, d


def time_once(fn: Callable[..., Any], *args: Any) -> tuple[float, float]:
    """Wall seconds and CPU seconds (this process, all threads) of one call, waited for."""
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - wall, time.process_time() - cpu


@dataclass
class Timings:
    """Per-variant lists of wall and CPU seconds, one entry per timed round."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def interleaved_times(
    fns: dict[str, Callable[..., Any]], args: tuple[Any, ...], reps: int, warmup: int = 1
) -> Timings:
    """``reps`` timings of every function, interleaved (a round runs each once, in turn).

    ``warmup`` rounds (compilation included) are run first and discarded. Under a
    varying machine load, interleaving exposes all variants to the same load, so
    ratios within one run are meaningful even when absolute times drift. Odd rounds
    run the variants in reverse order, so no variant always runs first.

    CPU time is a cross-check that other processes disturb less than wall time (it
    does not count time spent waiting for a core), but it does count XLA's worker
    threads spinning while they wait for work.
    """
    for _ in range(warmup):
        for fn in fns.values():
            time_once(fn, *args)
    out = Timings({name: [] for name in fns}, {name: [] for name in fns})
    for r in range(reps):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            wall, cpu = time_once(fns[name], *args)
            out.wall[name].append(wall)
            out.cpu[name].append(cpu)
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over rounds of ``num[r] / den[r]`` (each pair ran back to back)."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def ratio_range(num: Sequence[float], den: Sequence[float]) -> tuple[float, float, float]:
    """Median, min and max over rounds of ``num[r] / den[r]``."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return median(ratios), min(ratios), max(ratios)


def temp_bytes(step: Step, params: Params, batch: int, dim_in: int, dtype: Any) -> int:
    """XLA's compiled temp buffer size of the jitted step (compiled, never run)."""
    x = jax.ShapeDtypeStruct((batch, dim_in), dtype)
    compiled = jax.jit(step).lower(params, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def machine() -> str:
    """One line: CPU model, cores, memory, JAX version and backend, load average."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    try:
        mem = subprocess.run(["free", "-h"], capture_output=True, text=True).stdout.split()
        total = mem[mem.index("Mem:") + 1]
    except (OSError, ValueError, IndexError):
        total = "?"
    return (
        f"{cpu}, nproc={os.cpu_count()}, memory {total}, JAX {jax.__version__} "
        f"({jax.default_backend()}), {load()}"
    )


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} {five:.1f} {fifteen:.1f}"


# --- files ------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]  # the repository: run ``python -m benchmarks.x`` here
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = ROOT / "benchmarks" / "plots"


def save_figure(fig: Any, path: Path, dpi: float | None = None) -> None:
    """Writes a matplotlib figure to ``path`` (creating its folder) and says so."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    print(f"wrote {path}")


def write_json(path: Path, data: Any, **dumps: Any) -> None:
    """Writes ``data`` as indented JSON to ``path`` (creating its folder), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, **dumps))
    tmp.replace(path)


def shown(path: Path) -> str:
    """``path`` as recorded in results: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def command(module: str, argv: Sequence[str]) -> str:
    """The command that ran ``benchmarks.<module>`` with ``argv``, as results record it."""
    return " ".join(["python -m", f"benchmarks.{module}", *argv])


# --- the command line of the MLP benchmarks ------------------------------------------------

QUICK = "--quick: tiny model, millisecond steps; a sanity run, its ratios mean nothing"


def add_model_args(parser: argparse.ArgumentParser, depth: int) -> None:
    """``--depth``, ``--width``, ``--dim-in`` and ``--dim-out`` of the MLP encoder."""
    parser.add_argument("--depth", type=int, default=depth, help="hidden layers of the MLP")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--dim-in", type=int, default=512)
    parser.add_argument("--dim-out", type=int, default=128)


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The ``ModelConfig`` of ``add_model_args``' arguments."""
    return ModelConfig(args.depth, args.width, args.dim_in, args.dim_out)


# --- compiling for a TPU chip (compile only: libtpu, no TPU needed) ---------------------------


def tpu_devices(
    topology: str, config: str = "default", host_bounds: tuple[int, int, int] = (1, 1, 1)
) -> list[jax.Device]:
    """The compile-only devices of a TPU ``topology`` (e.g. ``"v5e:1x1"``): the real
    TPU compiler, nothing runs. Several processes may load libtpu for this at once."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other compile-only users
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=topology, chip_config_name=config,
        chips_per_host_bounds=host_bounds, num_slices=1, wrap=(False, False, False),
    )  # fmt: skip
    return topo.devices


def on_device(device: jax.Device | None, tree: Any) -> Any:
    """``ShapeDtypeStruct``s of ``tree`` placed on ``device`` (None: left unplaced)."""
    if device is None:
        return tree
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def nbytes(tree: Any) -> int:
    """Bytes of every array (or ``ShapeDtypeStruct``) in ``tree``."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def total_bytes(m: Any) -> int:
    """Arguments + temporaries + outputs - aliased, of a ``memory_analysis()``."""
    total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
    return total - m.alias_size_in_bytes


_OOM = re.compile(
    r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"
)
# libtpu 0.0.50's other form ("CompileTimeHbmOom"), e.g. when a collective's scoped memory
# does not fit: "Used 17.70G of 15.75G hbm. ..." then, lines below, "HLO temp 10.25G (...".
_OOM_USED = re.compile(r"Used [\d.]+[KMGT] of ([\d.]+)([KMGT]) hbm")
_OOM_TEMP = re.compile(r"HLO temp +([\d.]+)([KMGT])")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def out_of_memory(err: Exception) -> tuple[float, float] | None:
    """``(temporaries, HBM)`` in bytes from the TPU compiler's out-of-memory error, or None."""
    if "RESOURCE_EXHAUSTED" not in str(err):
        return None
    if found := _OOM.search(str(err)):
        return tuple(float(found[i]) * _UNITS[found[i + 1]] for i in (1, 3))
    hbm, temp = _OOM_USED.search(str(err)), _OOM_TEMP.search(str(err))
    if not hbm or not temp:
        return None
    return tuple(float(found[1]) * _UNITS[found[2]] for found in (temp, hbm))


# A buffer-assignment line of a preallocated temporary. libtpu 0.0.42 (JAX 0.10) writes
# "allocation 7: size N, preallocated-temp:", 0.0.50 (JAX 0.12) "size N, page 0,
# preallocated-temp:"; memories other than HBM say "color C, " first (1: the on-chip
# VMEM; 2 and 6: a few bytes of flags).
_TEMP = re.compile(
    r"^allocation \d+: size (\d+),(?: color (\d+),)?(?: page \d+,)? preallocated-temp", re.M
)


def preallocated_temps(text: str) -> dict[int, int]:
    """Bytes of preallocated temporaries per memory colour (0: HBM, 1: VMEM) in a
    buffer-assignment dump; raises if none parses (the format changed)."""
    found = _TEMP.findall(text)
    if not found:
        raise ValueError("no preallocated-temp line parsed: has the dump format changed?")
    temps: dict[int, int] = {}
    for size, color in found:
        temps[int(color or 0)] = temps.get(int(color or 0), 0) + int(size)
    return temps


def allocated_temp(dump: str) -> int | None:
    """The buffer assignment's preallocated temp in HBM (XLA dump), or None.

    On the TPU compiler ``memory_analysis().temp_size_in_bytes`` can exceed what the
    buffer assignment allocates by whole batch-sized buffers, and the compiler's own
    out-of-memory check follows the buffer assignment (docs/benchmarks/largest_batch.md).
    """
    for path in glob.glob(os.path.join(dump, "*after_optimizations-buffer-assignment.txt")):
        with open(path) as f:
            return preallocated_temps(f.read()).get(0, 0)
    return None


def compile_with_allocation(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, int | None]:
    """Compiles ``lowered`` with an XLA dump; the compiled step and its ``allocated_temp``.

    A step that does not fit raises the compiler's error (see ``out_of_memory``).
    """
    with tempfile.TemporaryDirectory() as dump:
        compiled = lowered.compile({"xla_dump_to": dump})
        return compiled, allocated_temp(dump)
