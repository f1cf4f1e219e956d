"""The largest ``chunk_size`` whose compiled step fits a memory budget, by the compiler.

Users ask which chunk size to use and otherwise find out by running out of memory.
Here the compiler answers ahead of time: candidate steps are lowered with abstract
arguments and compiled (``jax.jit(step).lower(...).compile()``, nothing is run), and
their ``memory_analysis()`` is compared with the budget, bisecting over the
candidates. That works for the local accelerator and equally for the compile-only
devices of a TPU topology (``jax.experimental.topologies``) on a machine without one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from gc_jax._base import PyTree

_GIB = 2**30
# The HBM the TPU compiler offers one program per device (libtpu 0.0.42, measured
# from its out-of-memory message); used when the compiler's message cannot be read.
_TPU_HBM = {
    "TPU v4": 30.75 * _GIB,  # megacore: one device per chip
    "TPU v5 lite": 15.75 * _GIB,  # v5e
    "TPU v5": 95.74 * _GIB,  # v5p, megacore
    "TPU v6 lite": 31.25 * _GIB,  # v6e
}
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

    A live accelerator reports ``memory_stats()["bytes_limit"]``; a TPU device
    (compile-only included) is asked through its compiler; a CPU reports nothing.
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
        x = x if hasattr(x, "dtype") else np.asarray(x)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

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


def _candidates(candidates: int | Sequence[Any]) -> list[Any]:
    if isinstance(candidates, (int, np.integer)) and not isinstance(candidates, bool):
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1 (the batch rows); got {candidates}")
        powers = [2**k for k in range(int(candidates).bit_length()) if 2**k < candidates]
        return [*powers, int(candidates)]
    if isinstance(candidates, Sequence) and len(candidates) > 0:
        return list(candidates)
    raise TypeError(
        "candidates must be the batch rows (an int: powers of two up to it are tried) or a "
        f"non-empty sequence of chunk sizes, smallest memory first; got {candidates!r}"
    )


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
    candidates: int | Sequence[Any],
    *,
    kwargs: dict[str, Any] | None = None,
    budget_bytes: float | None = None,
    device: jax.Device | Mesh | Sequence[jax.Device] | None = None,
) -> Any:
    """The largest chunk size whose compiled step fits in memory, found by the compiler.

    Each tried step is compiled ahead of time (``jax.jit(step).lower(*args).compile()``:
    nothing runs, nothing is allocated) and fits when the compiler accepts it and its
    ``memory_analysis()`` (arguments + temporaries + outputs - donated, per device) is
    at most the budget. Candidates are bisected, so about ``log2(len(candidates))``
    compiles are made, assuming memory grows with the candidate's position (it does for
    chunk sizes: one chunk's activations are live at a time). Larger chunks keep the
    matrix units busier, so the largest that fits is returned.

    Args:
      make_step: ``make_step(chunk_size) -> step``, e.g.
        ``lambda c: gc_jax.make_train_step(loss_fn, encode, c)``. ``step`` may be a
        plain function (it is jitted) or a ``jax.jit`` one (to keep ``donate_argnums``).
      args: the step's positional arguments: arrays or ``jax.ShapeDtypeStruct``s
        (only shapes, dtypes and shardings are read).
      candidates: the rows per device of the batch (an int ``n``: tries the powers of
        two below ``n`` and ``n`` itself, which is full-batch training), or the chunk
        sizes to try, smallest memory first: ints, or tuples of per-input sizes.
      kwargs: keyword arguments of the step (e.g. ``{"rng": key}``).
      budget_bytes: bytes per device the step may use. Default: the device's memory
        (``memory_stats()["bytes_limit"]`` of a live device, or the HBM the TPU
        compiler offers a program on a TPU device, compile-only ones included). Leave
        some headroom on a live device (other buffers, fragmentation).
      device: where to compile. None: where ``args`` are placed (the default device
        for unplaced ones). A ``jax.Device`` (e.g. ``topology.devices[0]`` of
        ``jax.experimental.topologies.get_topology_desc``): every argument is placed
        on it. A ``Mesh`` (over a topology's devices, say): arguments keep their
        ``NamedSharding`` on it, others are replicated, and the budget is per device.

    Returns:
      The largest fitting entry of the candidates.

    Raises:
      ValueError: no budget can be found for the device (a CPU: pass
        ``budget_bytes``), or even the first candidate does not fit.

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
    """
    if budget_bytes is not None and not budget_bytes > 0:
        raise ValueError(f"budget_bytes must be positive; got {budget_bytes!r}")
    target = _target(device)
    args = _place(target, tuple(args))
    kwargs = _place(target, dict(kwargs or {}))
    budget = budget_bytes
    if budget is None:
        chip = _budget_device(target, args)
        budget = device_memory(chip)
        if budget is None:
            raise ValueError(
                f"largest_chunk_size: {chip} ({chip.platform}) reports no memory limit; "
                "pass budget_bytes=..., the bytes per device the step may use."
            )
    tried = _candidates(candidates)
    mesh = target if isinstance(target, Mesh) else None
    found, measured = -1, {}
    lo, hi = -1, len(tried)  # tried[lo] fits (or lo == -1); tried[hi] does not (or hi == len)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        measured[mid] = _bytes_or_none(make_step(tried[mid]), args, kwargs, mesh)
        if measured[mid] is not None and measured[mid] <= budget:
            lo = found = mid
        else:
            hi = mid
    if found < 0:
        used = measured.get(0)
        need = "more than the compiler offers" if used is None else f"{used:,} bytes"
        raise ValueError(
            f"largest_chunk_size: even the first candidate, chunk_size={tried[0]!r}, needs "
            f"{need} against a budget of {budget:,.0f} bytes per device; try smaller chunk "
            "sizes, fewer rows per device, or a larger budget_bytes."
        )
    return tried[found]
