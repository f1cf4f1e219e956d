"""Memory on the real TPU compiler (one v5e chip, compile only: libtpu, no TPU needed).

The TPU compiler lays buffers out in (8, 128) tiles, so its per-row bytes differ from
XLA:CPU's (``tests/test_memory.py``). This is a regression test of what it keeps per
row for a small bfloat16 model; see BENCHMARKS.md ("Extreme batch", TPU) for what the
bytes are made of. When libtpu is missing the test fails: it is never skipped.
"""

import functools
import glob
import os
import re
import tempfile
from pathlib import Path

import jax
import pytest
import test_memory as cpu

import gc_jax
from benchmarks import common

pytestmark = pytest.mark.slow  # the TPU compiler: out of the fast lane (docs/development.md)

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other compile-only users


@functools.cache
def v5e_chip() -> jax.sharding.Sharding:
    from jax.experimental import topologies  # libtpu's compile-only devices

    topo = topologies.get_topology_desc(
        platform="tpu", topology_name="v5e:1x1", chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1), num_slices=1, wrap=(False, False, False),
    )  # fmt: skip
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


def on_tpu(tree):
    sharding = v5e_chip()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def allocated_bytes(rows: int) -> int:
    """What the chip holds for the step: arguments, outputs and the buffer assignment's
    temporaries in HBM and VMEM (``memory_analysis()`` counts HBM temp only, and
    over-counts it: see ``../BENCHMARKS.md``)."""
    f = gc_jax.cached_value_and_grad(cpu.blockwise, cpu.token_encoder, cpu.BF16_CHUNK)
    args = on_tpu((cpu.TOKEN_PARAMS, cpu.ids(rows), cpu.ids(rows)))
    with tempfile.TemporaryDirectory() as dump:
        compiled = jax.jit(f).lower(*args).compile({"xla_dump_to": dump})
        (path,) = glob.glob(os.path.join(dump, "*after_optimizations-buffer-assignment.txt"))
        temps = common.preallocated_temps(Path(path).read_text())
    m = compiled.memory_analysis()
    temp = temps.get(0, 0) + temps.get(1, 0)
    return m.argument_size_in_bytes + m.output_size_in_bytes + temp


@pytest.mark.parametrize("small, large", [(2**20, 2**21)])
def test_bf16_batch_memory_per_row_on_a_v5e_chip(small, large):
    """Per row: at most 1.15 x the floor (both inputs' ids, three bfloat16 rows).

    The floor is ``tests.test_memory.FLOOR``, the same as on XLA:CPU. Before the
    ids were read as whole lines (``gc_jax._chunks.rows.ChunkPlan.pack``) the TPU compiler copied
    them into a buffer padded to 128 lanes: 2.2 x the floor; one more batch-sized
    bfloat16 buffer would be 1.31 x. Measured (both colours): 948 bytes per row (1.14 x)
    with libtpu 0.0.42 (JAX 0.10.2) and 0.0.50 (JAX 0.12).

    The batches are large (2^20 and 2^21 rows) because libtpu 0.0.50 places batch-sized
    temporaries of up to about 100 MiB in VMEM: at 4,096 to 16,384 rows every cache
    lived there, and ``memory_analysis()`` (HBM only) grew by 56 bytes per row.
    """
    assert v5e_chip().device_set.pop().platform == "tpu"
    growth = (allocated_bytes(large) - allocated_bytes(small)) / (large - small)
    bound = 1.15 * cpu.FLOOR
    assert growth <= bound, f"{growth:.0f} bytes per row on a v5e chip; bound {bound:.0f}"
    assert growth >= cpu.FLOOR, f"{growth:.0f} bytes per row: below the floor {cpu.FLOOR}?"


def test_token_ids_are_not_copied_padded_to_128_lanes():
    """The TPU keeps ``int32[B, 8]`` rows-minor; reading row chunks from it must not copy
    it into a rows-major ``[B, 8]`` buffer (each row padded to 128 lanes: 16x)."""
    rows = 16384
    f = gc_jax.cached_value_and_grad(cpu.blockwise, cpu.token_encoder, cpu.BF16_CHUNK)
    args = on_tpu((cpu.TOKEN_PARAMS, cpu.ids(rows), cpu.ids(rows)))
    hlo = jax.jit(f).lower(*args).compile().as_text()
    assert f"s32[{rows},{cpu.TOKENS}]{{0,1" in hlo, "the ids are no longer rows-minor?"
    padded = re.findall(rf"= s32\[{rows},{cpu.TOKENS}\]{{1,0[^ ]*", hlo)
    assert not padded, f"the ids are copied rows-major (padded to 128 lanes): {padded}"


def test_token_ids_are_not_copied_padded_on_a_v5e_slice_under_sharded_jit():
    """The same on a v5e 4x4 slice, batch split over its 16 chips (auto axes, as
    Tevatron sets them): each chip's ids are read as lines on that chip."""
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    topo = topologies.get_topology_desc(
        platform="tpu", topology_name="v5e:4x4", chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False),
    )  # fmt: skip
    mesh = Mesh(np.array(topo.devices), ("d",), axis_types=(AxisType.Auto,))
    place = lambda tree, spec: jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)), tree
    )
    local = 16384
    ids = place(cpu.ids(16 * local), P("d"))
    f = gc_jax.cached_value_and_grad(
        cpu.blockwise, cpu.token_encoder, cpu.BF16_CHUNK, batch_axis="d"
    )
    with jax.set_mesh(mesh):
        hlo = jax.jit(f).lower(place(cpu.TOKEN_PARAMS, P()), ids, ids).compile().as_text()
    assert f"s32[{local},{cpu.TOKENS}]{{0,1" in hlo, "the chip's ids are no longer rows-minor?"
    padded = re.findall(rf"= s32\[{local},{cpu.TOKENS}\]{{1,0[^ ]*", hlo)
    assert not padded, f"the ids are copied rows-major (padded to 128 lanes): {padded}"
