"""The largest ``chunk_size`` whose compiled step fits a memory budget, by the compiler.

Users ask which chunk size to use and otherwise find out by running out of memory.
Here the compiler answers ahead of time: candidate steps are lowered with abstract
arguments and compiled (``jax.jit(step).lower(...).compile()``, nothing is run), and
their ``memory_analysis()`` is compared with the budget, from the largest candidate
down to the first that fits (compiled memory is not quite monotone in the chunk size,
so a bisection could stop short). That works for the local accelerator and equally
for the compile-only devices of a TPU topology (``jax.experimental.topologies``) on a
machine without one.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import re
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from gc_jax import _validation
from gc_jax._base import PyTree
from gc_jax._chunks import plan as _plan

_GIB = 2**30
# The HBM the TPU compiler offers one program per device, read from its out-of-memory
# message with libtpu 0.0.42 (docs/benchmarks/largest_batch.md, "The TPU compiler: the
# largest batch per TPU chip"); used when the compiler's message cannot be read.
_TPU_HBM = types.MappingProxyType(
    {
        "TPU v4": 30.75 * _GIB,  # megacore: one device per chip
        "TPU v5 lite": 15.75 * _GIB,  # v5e
        "TPU v5": 95.74 * _GIB,  # v5p, megacore
        "TPU v6 lite": 31.25 * _GIB,  # v6e
    }
)
_AVAILABLE = re.compile(r"exceeds available HBM \(([\d.]+)G\)")


def _out_of_memory(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error)


def _tpu_hbm(device: jax.Device) -> float | None:
    """What the TPU compiler offers a program on ``device``: its own message says."""
    huge = jax.ShapeDtypeStruct((2**28, 2**10), jnp.float32, sharding=SingleDeviceSharding(device))
    try:
        jax.jit(lambda x: jnp.sort(x, axis=0) + 1).lower(huge).compile()  # 3 TiB
    except jax.errors.JaxRuntimeError as e:
        found = _AVAILABLE.search(str(e))
        if found:
            return float(found.group(1)) * _GIB
    return _TPU_HBM.get(device.device_kind)


def device_memory(device: jax.Device) -> float | None:
    """Bytes a program may use on ``device``, or None where nothing says.

    What :func:`largest_chunk_size` fits a step into when no ``budget_bytes`` is
    given. A live accelerator reports ``memory_stats()["bytes_limit"]``; a TPU
    device (compile-only ones from ``jax.experimental.topologies`` included) is
    asked through its compiler; a CPU reports nothing.

    Args:
      device: a ``jax.Device``.

    Returns:
      The bytes, or None (e.g. on a CPU).

    Examples:
      >>> import jax, gc_jax
      >>> gc_jax.device_memory(jax.devices("cpu")[0]) is None
      True
    """
    try:
        stats = device.memory_stats()
    except jax.errors.JaxRuntimeError:  # compile-only devices
        stats = None
    if stats and "bytes_limit" in stats:
        return float(stats["bytes_limit"])
    return _tpu_hbm(device) if device.platform == "tpu" else None


def compiled_bytes(compiled: jax.stages.Compiled) -> int:
    """Per-device bytes of a compiled step: arguments + temporaries + outputs - aliased."""
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
    return total - m.alias_size_in_bytes


def _place(device: jax.Device | Mesh | None, args: PyTree) -> PyTree:
    """``ShapeDtypeStruct``s of ``args``, placed on ``device`` (or on ``device``'s mesh)."""

    def abstract(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(device, jax.Device):
            sharding = SingleDeviceSharding(device)
        elif isinstance(device, Mesh) and not (
            isinstance(sharding, NamedSharding) and sharding.mesh == device
        ):
            sharding = NamedSharding(device, P())  # replicated over the mesh
        # A Python scalar (TrainState.step) is typed as JAX types it: weakly, canonical.
        dtype = x.dtype if hasattr(x, "dtype") else jax.eval_shape(jnp.asarray, x).dtype
        return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)

    return jax.tree.map(abstract, args)


def _target(device: Any) -> jax.Device | Mesh | None:
    """``device`` as one device, a mesh, or None (the arguments' own placement)."""
    if device is None or isinstance(device, (jax.Device, Mesh)):
        return device
    if isinstance(device, Sequence) and len(device) == 1 and isinstance(device[0], jax.Device):
        return device[0]
    raise TypeError(
        f"device must be a jax.Device, a jax.sharding.Mesh or None; got {device!r}. "
        "For several devices (a TPU topology's .devices), build a Mesh over them and give "
        "the arguments NamedShardings on it: device=Mesh(np.array(devices), ('data',))."
    )


def _budget_device(target: jax.Device | Mesh | None, args: PyTree) -> jax.Device:
    if isinstance(target, jax.Device):
        return target
    if isinstance(target, Mesh):
        return target.devices.flat[0]
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return min(sharding.device_set, key=lambda d: d.id)
    return jax.devices()[0]


_UNITS = types.MappingProxyType({"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def _budget(budget_bytes: Any) -> float | None:
    """``budget_bytes`` as a positive number of bytes (None stays None)."""
    if budget_bytes is None:
        return None
    value, error = None, ValueError
    if isinstance(budget_bytes, str):
        found = _SIZE.fullmatch(budget_bytes)
        if found and found.group(2).lower() in _UNITS:
            value = float(found.group(1)) * _UNITS[found.group(2).lower()]
    elif isinstance(budget_bytes, numbers.Real) and not isinstance(budget_bytes, bool):
        value = float(budget_bytes)
    else:
        error = TypeError
    if value is None or not value > 0:  # not a size, not a number, <= 0 or NaN
        raise error(
            "budget_bytes must be a positive number of bytes per device (e.g. 16 * 2**30) or "
            'a string such as "16GiB", "1.5GB" or "512 MiB" (KB, MB, GB, TB are powers of '
            f"1000; KiB, MiB, GiB, TiB powers of 1024); got {budget_bytes!r} "
            f"({type(budget_bytes).__name__})."
        )
    return value


def _candidate(value: Any, i: int) -> int | tuple[int, ...]:
    """One candidate: a positive int, or a tuple of them (one chunk size per input)."""
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        if not value:
            raise ValueError(f"candidates[{i}] is empty; expected one chunk size per input.")
        return tuple(
            _validation.positive_int(v, f"candidates[{i}][{j}]") for j, v in enumerate(value)
        )
    if _plan.by_tokens(value):
        raise TypeError(
            f"candidates[{i}] is a gc_jax.{type(value).__name__}; largest_chunk_size orders "
            "candidates by rows, so pass chunk sizes in rows: positive ints, or tuples of "
            "them per input."
        )
    return _validation.positive_int(value, f"candidates[{i}]")


def _ascending(tried: list[Any]) -> list[Any]:
    """The distinct candidates, smallest first; per-input tuples must grow together."""
    kinds = {len(c) if isinstance(c, tuple) else None for c in tried}
    if len(kinds) > 1:
        raise TypeError(
            "candidates must be all ints (one chunk size for every input) or all tuples of "
            f"the same length (one per input); got {tried!r}."
        )
    tried = sorted(set(tried))
    for small, large in itertools.pairwise(tried):
        if isinstance(small, tuple) and not all(a <= b for a, b in zip(small, large, strict=True)):
            raise ValueError(
                f"candidates {small} and {large} do not grow together (each input's chunk "
                "size at least the smaller candidate's), so neither is the larger; pass "
                "per-input candidates that do, e.g. [(16, 64), (32, 128), (64, 256)]."
            )
    return tried


def _candidates(candidates: Any) -> list[Any]:
    """The candidates to try, smallest first, each once."""
    if isinstance(candidates, int | np.integer) and not isinstance(candidates, bool):
        if candidates < 1:
            raise ValueError(
                f"candidates must be >= 1 (the rows per device of the batch); got {candidates}."
            )
        powers = [2**k for k in range(int(candidates).bit_length()) if 2**k < candidates]
        return [*powers, int(candidates)]
    if isinstance(candidates, Iterable) and not isinstance(candidates, str | bytes | Mapping):
        tried = [_candidate(c, i) for i, c in enumerate(candidates)]
        if tried:
            return _ascending(tried)
        raise ValueError(
            "candidates is empty; pass the rows per device (an int) or the chunk sizes to try."
        )
    hint = ""
    if isinstance(candidates, str | bytes):
        rows = candidates.strip() if isinstance(candidates, str) else ""
        write = f"candidates={rows} (the rows per device) or " if rows.isdigit() else ""
        hint = f"; a string is not a list of sizes: write {write}a list such as [64, 128, 256]"
    raise TypeError(
        "candidates must be the rows per device of the batch (an int: powers of two up to it "
        "are tried) or an iterable of chunk sizes (positive ints, or tuples of them, one per "
        f"input); got {candidates!r} ({type(candidates).__name__}){hint}."
    )


def _largest_fitting(measure: Callable[[Any], int | None], tried: list, budget: float):
    """``(index of the largest candidate that fits or None, {index: bytes or None})``.

    Candidates are compiled from the largest down and the first that fits is the
    answer: exact even where memory is not monotone in the chunk size (it is not
    quite, on a mesh), and every candidate above it has been seen not to fit. Each
    compile is logged at INFO (logger ``"gc_jax"``): it can take minutes.
    """
    log = logging.getLogger("gc_jax")
    log.info(
        "largest_chunk_size: %s bytes per device; compiling the step for chunk sizes %s "
        "from the largest down, until one fits",
        f"{budget:,.0f}",
        tried[::-1],
    )
    measured = {}
    for i in reversed(range(len(tried))):
        log.info("largest_chunk_size: compiling chunk_size=%r ...", tried[i])
        tick = time.perf_counter()
        measured[i] = measure(tried[i])
        fits = measured[i] is not None and measured[i] <= budget
        needs = "out of memory" if measured[i] is None else f"{measured[i]:,} bytes"
        log.info(
            "largest_chunk_size: chunk_size=%r needs %s (compiled in %.1fs): %s",
            tried[i],
            needs,
            time.perf_counter() - tick,
            "fits" if fits else "does not fit",
        )
        if fits:
            return i, measured
    return None, measured


def _bytes_or_none(step: Callable[..., Any], args: PyTree, kwargs: dict, mesh) -> int | None:
    """Compiled bytes of ``step``, or None when the compiler reports it out of memory."""
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    try:
        if mesh is None:
            return compiled_bytes(jitted.lower(*args, **kwargs).compile())
        with jax.set_mesh(mesh):
            return compiled_bytes(jitted.lower(*args, **kwargs).compile())
    except jax.errors.JaxRuntimeError as e:
        if _out_of_memory(e):
            return None
        raise


def largest_chunk_size(
    make_step: Callable[[Any], Callable[..., Any]],
    args: Sequence[PyTree],
    candidates: int | Iterable[Any],
    *,
    kwargs: dict[str, Any] | None = None,
    budget_bytes: float | str | None = None,
    device: jax.Device | Mesh | Sequence[jax.Device] | None = None,
) -> Any:
    """The largest chunk size whose compiled step fits in memory, found by the compiler.

    Each tried step is compiled ahead of time (``jax.jit(step).lower(*args).compile()``:
    nothing runs, nothing is allocated) and fits when the compiler accepts it and its
    ``memory_analysis()`` (arguments + temporaries + outputs - donated, per device) is
    at most the budget. Candidates are compiled from the largest down, and the first
    that fits is returned. That is exact where a bisection is not: compiled memory is
    not quite monotone in the chunk size (on a mesh a smaller chunk has been measured
    to need more). The compiles are one per candidate from the largest down to the
    answer: one when the largest fits, at most ``log2(n) + 2`` for ``candidates=n``
    (the powers of two below ``n``, and ``n``); each is the step's full compile time,
    so list few candidates. Larger chunks keep the matrix units busier, hence the
    largest. Each compile is logged at INFO on the ``"gc_jax"`` logger (the chunk
    size, its bytes, the seconds it took): see them with ``logging.basicConfig()``
    and ``logging.getLogger("gc_jax").setLevel(logging.INFO)``.

    Args:
      make_step: ``make_step(chunk_size) -> step``, e.g.
        ``lambda c: gc_jax.make_train_step(loss_fn, encode, c)``. ``step`` may be a
        plain function (it is jitted) or a ``jax.jit`` one (to keep ``donate_argnums``).
      args: the step's positional arguments: arrays or ``jax.ShapeDtypeStruct`` values
        (only shapes, dtypes and shardings are read).
      candidates: the rows per device of the batch (an int ``n``: tries the powers of
        two below ``n`` and ``n`` itself, which is full-batch training), or the chunk
        sizes to try, in any order (duplicates are tried once): positive ints, or
        tuples of per-input sizes that grow together (e.g. ``[(16, 64), (32, 128)]``).
      kwargs: keyword arguments of the step (e.g. ``{"rng": key}``).
      budget_bytes: bytes per device the step may use: a positive number, or a
        string such as ``"16GiB"`` or ``"1.5GB"`` (KiB, MiB, GiB, TiB are powers of
        1024; KB, MB, GB, TB powers of 1000). Default: the device's memory
        (``memory_stats()["bytes_limit"]`` of a live device, or the HBM the TPU
        compiler offers a program on a TPU device, compile-only ones included). Leave
        some headroom on a live device (other buffers, fragmentation).
      device: where to compile. None: where ``args`` are placed (the default device
        for unplaced ones). A ``jax.Device`` (e.g. ``topology.devices[0]`` of
        ``jax.experimental.topologies.get_topology_desc``): every argument is placed
        on it. A ``Mesh`` (over a topology's devices, say): arguments keep their
        ``NamedSharding`` on it, others are replicated, and the budget is per device.

    Returns:
      The largest candidate whose compiled step fits (an int, or a tuple for
      per-input candidates); every larger candidate was compiled and does not fit.

    Raises:
      TypeError: ``candidates`` is not an int or an iterable of chunk sizes (a
        string, say), or ``budget_bytes`` is not a number or a string.
      ValueError: a candidate is not positive, per-input candidates do not grow
        together, ``budget_bytes`` is not positive or not a size, no budget can be
        found for the device (a CPU: pass ``budget_bytes``), or no candidate fits.

    Examples:
      A tanh MLP, 8,192 rows per input, on the CPU with a 50 MiB budget (a CPU reports
      no memory limit; on an accelerator or a TPU topology's device leave it out):

      >>> import jax, jax.numpy as jnp, gc_jax
      >>> def encode(params, x, key):
      ...     for w in params:
      ...         x = jnp.tanh(x @ w)
      ...     return x
      >>> loss = lambda params, q, d: -jnp.mean(jnp.sum(q * d, axis=-1))
      >>> shapes = [(64, 1024), (1024, 1024), (1024, 1024), (1024, 64)]
      >>> params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
      >>> x = jax.ShapeDtypeStruct((8192, 64), jnp.float32)
      >>> make = lambda c: gc_jax.cached_value_and_grad(loss, encode, c)
      >>> gc_jax.largest_chunk_size(make, (params, x, x), 8192, budget_bytes=50 * 2**20)
      1024

      The same with chunk sizes of your own, in any order, and the budget as a string:

      >>> gc_jax.largest_chunk_size(make, (params, x, x), [4096, 512, 1024], budget_bytes="50MiB")
      1024
    """
    budget = _budget(budget_bytes)
    tried = _candidates(candidates)
    target = _target(device)
    args = _place(target, tuple(args))
    kwargs = _place(target, dict(kwargs or {}))
    budget = budget or device_budget(target, args, "largest_chunk_size")
    mesh = target if isinstance(target, Mesh) else None
    measure = lambda c: _bytes_or_none(make_step(c), args, kwargs, mesh)
    found, measured = _largest_fitting(measure, tried, budget)
    if found is None:
        used = measured[0]
        need = "more than the compiler offers" if used is None else f"{used:,} bytes"
        raise ValueError(
            f"largest_chunk_size: no candidate fits; even the smallest, chunk_size={tried[0]!r}, "
            f"needs {need} against a budget of {budget:,.0f} bytes per device; try smaller "
            "chunk sizes, fewer rows per device, or a larger budget_bytes."
        )
    return tried[found]


def device_budget(target: jax.Device | Mesh | None, args: PyTree, name: str) -> float:
    """The memory of the device the step compiles for, or a ValueError naming ``name``
    where it reports none (a CPU: pass ``budget_bytes``)."""
    chip = _budget_device(target, args)
    budget = device_memory(chip)
    if budget is None:
        raise ValueError(
            f"{name}: {chip} ({chip.platform}) reports no memory limit; "
            'pass budget_bytes=..., the bytes per device the step may use (e.g. "8GiB").'
        )
    return budget
