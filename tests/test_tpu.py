"""Every entry point compiled by the real TPU compiler, for compile-only TPU devices.

libtpu (``pip install -e ".[tpu]"``) compiles for the devices of a TPU topology
(``jax.experimental.topologies``) on a machine without one; nothing runs. The
assertions are those the CPU tests make, on the TPU compiler's ``memory_analysis()``
and optimised HLO: temp memory flat in the batch except for the cache, two chunks per
input below the full batch (one v5e chip), one gradient all-reduce per step and none
inside the chunk loops (a v5e 4x4 slice under ``shard_map`` and sharded ``jit``).

Without libtpu these tests fail (they do not skip): CI installs it.

Representations are 128 wide: a TPU lays arrays out in tiles of 128 lanes, so a
narrower last dimension would be padded to 128 (a [B, 64] float32 array costs 512 B
per row on a TPU).
"""

import functools
import os
import re
from importlib import metadata

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from test_distributed import while_bodies

import gc_jax
from gc_jax import packing
from gc_jax._chunk_size import compiled_bytes, device_memory
from gc_jax.compat import cachex

pytestmark = pytest.mark.slow  # the TPU compiler: out of the fast lane (docs/development.md)

MIB = 2**20
WIDTH, DEPTH, DIM_OUT, CHUNK = 256, 8, 128, 128


@functools.cache
def topology(name: str):
    """The devices of a TPU topology, compile only (fails without libtpu)."""
    return topologies.get_topology_desc(
        platform="tpu", topology_name=name, chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1) if name.endswith("1x1") else (2, 2, 1),
        num_slices=1, wrap=(False, False, False),
    ).devices  # fmt: skip


def chip():
    (device,) = topology("v5e:1x1")
    return device


def on_chip(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(chip()))


def test_the_tpu_compiler_is_installed():
    try:
        metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        pytest.fail('libtpu, the TPU compiler, is not installed: pip install -e ".[tpu]"')
    assert chip().platform == "tpu" and chip().device_kind == "TPU v5 lite"
    assert len(topology("v5e:4x4")) == 16


# --- one v5e chip: memory --------------------------------------------------------------


def deep_mlp(params, x, key=None):
    for w in params["layers"]:
        x = jnp.tanh(x @ w)
    return x @ params["out"]


def alignment_loss(params, q, d):
    """An O(batch) loss, so only the cache itself may grow with the batch."""
    return -jnp.mean(jnp.sum(q * d, axis=-1))


def mlp_params(place=on_chip):
    return {"layers": [place((WIDTH, WIDTH))] * DEPTH, "out": place((WIDTH, DIM_OUT))}


def full_batch(params, *batches):
    return alignment_loss(params, *[deep_mlp(params, x) for x in batches])


def temp(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def gc_step(rows):
    x = on_chip((rows, WIDTH))
    return gc_jax.cached_value_and_grad(alignment_loss, deep_mlp, CHUNK), (mlp_params(), x, x)


def make_train_step(rows):
    step = gc_jax.make_train_step(alignment_loss, deep_mlp, CHUNK, optimizer=optax.sgd(0.1))
    x = on_chip((rows, WIDTH))
    opt_state = jax.eval_shape(optax.sgd(0.1).init, mlp_params())
    return step, ((mlp_params(), jax.tree.map(lambda s: on_chip(s.shape, s.dtype), opt_state)),
                  x, x)  # fmt: skip


def chunked_encoder(rows):
    encode = gc_jax.chunked_encoder(deep_mlp, CHUNK)
    loss = lambda p, q, d: alignment_loss(p, encode(p, q), encode(p, d))
    x = on_chip((rows, WIDTH))
    return jax.value_and_grad(loss), (mlp_params(), x, x)


def grad_cached(rows):
    fwd = cachex.grad_cached(lambda p, b: deep_mlp(p, b["x"]), None)
    loss = lambda p, q, d: alignment_loss(p, fwd(p, q), fwd(p, d))
    x = {"x": on_chip((rows // CHUNK, CHUNK, WIDTH))}  # pre-chunked
    return jax.value_and_grad(loss), (mlp_params(), x, x)


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
                                for _ in range(DEPTH)])  # fmt: skip
        self.out = nnx.Linear(WIDTH, DIM_OUT, use_bias=False, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.out(x)


def grad_cache_class(rows):
    model = nnx.eval_shape(lambda: NNXMLP(nnx.Rngs(0)))
    gc = gc_jax.compat.GradCache([model, model], CHUNK, lambda q, d: alignment_loss(None, q, d))
    params = jax.tree.map(lambda s: on_chip(s.shape, s.dtype), nnx.state(model, nnx.Param))
    x = on_chip((rows, WIDTH))
    return (lambda p, q, d: gc(q, d, params=p)), (params, x, x)


ENTRY_POINTS = {
    "cached_value_and_grad": gc_step,
    "make_train_step": make_train_step,
    "chunked_encoder": chunked_encoder,
    "GradCache": grad_cache_class,
    "cachex.grad_cached": grad_cached,
}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_temp_memory_grows_only_with_the_cache(name):
    small, large = 8 * CHUNK, 64 * CHUNK
    (fn, large_args), (_, small_args) = ENTRY_POINTS[name](large), ENTRY_POINTS[name](small)
    growth = temp(fn, *large_args) - temp(fn, *small_args)
    cache_growth = 2 * (large - small) * DIM_OUT * 4  # two inputs' representations
    # The cache and its gradient: twice the representations, plus a little slack.
    assert growth <= 2 * cache_growth + MIB, (
        f"{name}: temp memory grew by {growth / MIB:.1f} MiB from B={small} to B={large}; "
        f"the cache grew by {cache_growth / MIB:.1f} MiB"
    )


TWO_CHUNKS = 4096  # rows per chunk; two chunks per input, two inputs


@functools.cache
def gc_two_inputs(chunk):
    """The cached step for two inputs of ``2 * TWO_CHUNKS`` rows, compiled for the chip."""
    f = gc_jax.cached_value_and_grad(alignment_loss, deep_mlp, chunk)
    return jax.jit(f).lower(mlp_params(), *[on_chip((2 * TWO_CHUNKS, WIDTH))] * 2).compile()


def test_two_chunks_per_input_stay_below_the_full_batch():
    """Both chunks' activations are never live at once.

    The TPU compiler keeps small temporaries in on-chip VMEM, outside
    ``temp_size_in_bytes`` (HBM), so the batch is one whose full-batch activations
    spill to HBM.
    """
    ours = gc_two_inputs(TWO_CHUNKS).memory_analysis().temp_size_in_bytes
    batch = [on_chip((2 * TWO_CHUNKS, WIDTH))] * 2
    theirs = temp(jax.value_and_grad(full_batch), mlp_params(), *batch)
    assert ours <= theirs, f"gc_jax {ours / MIB:.2f} MiB > full batch {theirs / MIB:.2f} MiB"


# --- chunk size chosen by the TPU compiler -----------------------------------------------


def test_device_memory_is_what_the_tpu_compiler_offers():
    assert 15 * 2**30 < device_memory(chip()) <= 16 * 2**30  # a v5e chip has 16 GiB of HBM


def test_largest_chunk_size_on_a_v5e_chip():
    """The budget between chunk 2048's bytes and chunk 4096's: 2048 is chosen."""
    small, large = (compiled_bytes(gc_two_inputs(c)) for c in (TWO_CHUNKS // 2, TWO_CHUNKS))
    assert small < large
    x = jax.ShapeDtypeStruct((2 * TWO_CHUNKS, WIDTH), jnp.float32)  # placed by device=
    make = lambda c: gc_jax.cached_value_and_grad(alignment_loss, deep_mlp, c)
    got = gc_jax.largest_chunk_size(
        make, (mlp_params(), x, x), [TWO_CHUNKS // 4, TWO_CHUNKS // 2, TWO_CHUNKS],
        budget_bytes=(small + large) / 2, device=chip(),
    )  # fmt: skip
    assert got == TWO_CHUNKS // 2


# --- a v5e 4x4 slice: one gradient all-reduce per step, none inside the chunk loops -------

LOCAL_ROWS = 24  # rows per device


def slice_mesh(axis_type=AxisType.Explicit):
    return Mesh(np.array(topology("v5e:4x4")), ("d",), axis_types=(axis_type,))


def small_params(mesh):
    place = lambda shape: jax.ShapeDtypeStruct(
        shape, jnp.float32, sharding=NamedSharding(mesh, P())
    )
    return {"w1": place((WIDTH, WIDTH)), "w2": place((WIDTH, DIM_OUT))}


def small_encode(params, x, key):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def sharded_batch(mesh, rows_per_device=LOCAL_ROWS):
    spec = NamedSharding(mesh, P("d"))
    x = jax.ShapeDtypeStruct((16 * rows_per_device, WIDTH), jnp.float32, sharding=spec)
    return x, x


def contrastive(axis_name=None):
    return lambda p, q, d: gc_jax.losses.contrastive_loss(q, d, axis_name=axis_name)


def shard_map_hlo(chunk_size):
    mesh = slice_mesh()
    grad_fn = gc_jax.cached_value_and_grad(
        contrastive("d"), small_encode, chunk_size, axis_name="d"
    )
    step = jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    return jax.jit(step).lower(small_params(mesh), *sharded_batch(mesh)).compile().as_text()


def sharded_jit_hlo(chunk_size):
    mesh = slice_mesh()
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(contrastive(), small_encode, chunk_size))
    return grad_fn.lower(small_params(mesh), *sharded_batch(mesh)).compile().as_text()


def sharded_jit_auto_hlo(chunk_size):
    """Auto mesh axes: the batch's mesh axis named by ``batch_axis``, under ``set_mesh``."""
    mesh = slice_mesh(AxisType.Auto)
    grad_fn = jax.jit(
        gc_jax.cached_value_and_grad(contrastive(), small_encode, chunk_size, batch_axis="d")
    )
    with jax.set_mesh(mesh):
        return grad_fn.lower(small_params(mesh), *sharded_batch(mesh)).compile().as_text()


def cache_train_step_hlo(n_chunk):
    mesh = slice_mesh()

    def loss_fn(xx, yy, axis):
        yy = jax.lax.all_gather(yy, axis, tiled=True)
        labels = jnp.arange(xx.shape[0]) + jax.lax.axis_index(axis) * xx.shape[0]
        return optax.softmax_cross_entropy_with_integer_labels(xx @ yy.T, labels)

    apply_fn = lambda params, x: small_encode(params, x, None)
    state = jax.eval_shape(lambda p: train_state.TrainState.create(
        apply_fn=apply_fn, params=p, tx=optax.sgd(0.1)), small_params(mesh))  # fmt: skip
    replicated = NamedSharding(mesh, P())
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
                         state)  # fmt: skip
    spec = NamedSharding(mesh, P(None, "d"))
    xx = {"x": jax.ShapeDtypeStruct((n_chunk, 16 * LOCAL_ROWS // n_chunk, WIDTH), jnp.float32,
                                    sharding=spec)}  # fmt: skip
    # check_vma=False: pmap's semantics, which cache_train_step is written for (its own
    # pmean is the only reduction of the gradients).
    step = jax.shard_map(lambda s, a, b: cachex.cache_train_step(loss_fn, s, a, b, axis="d"),
                         mesh=mesh, in_specs=(P(), P(None, "d"), P(None, "d")),
                         out_specs=(P(), P()), check_vma=False)  # fmt: skip
    return jax.jit(step).lower(state, xx, xx).compile().as_text()


def all_reduces(hlo: str) -> int:
    return len(re.findall(r"\ball-reduce(?:-start)?\(", hlo))


def gradient_all_reduces(hlo: str) -> int:
    """All-reduces whose operands include the gradient of ``w1`` (f32[WIDTH, WIDTH])."""
    results = re.findall(r"= (.*?) all-reduce(?:-start)?\(", hlo)
    return sum(f"f32[{WIDTH},{WIDTH}]" in shape for shape in results)


FORMS = [shard_map_hlo, sharded_jit_hlo, sharded_jit_auto_hlo, cache_train_step_hlo]


@functools.cache
def hlo_texts(form) -> tuple[str, str]:
    """The step's HLO with 4 chunks per device and with one chunk."""
    return form(4), form(LOCAL_ROWS if form is not cache_train_step_hlo else 1)


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_no_all_reduce_inside_the_chunk_loops(form):
    many, _ = hlo_texts(form)
    bodies = while_bodies(many)
    assert bodies, "expected the chunk loops in the compiled step"
    for body in bodies:
        assert all_reduces(body) == 0, f"{form.__name__}: an all-reduce runs once per chunk"
    assert "all-to-all" not in many


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_one_gradient_all_reduce_per_step(form):
    many, one = hlo_texts(form)
    assert gradient_all_reduces(one) == 1
    assert gradient_all_reduces(many) == 1, f"{gradient_all_reduces(many)} gradient all-reduces"
    # Nor do the step's other all-reduces (the loss's) depend on the number of chunks.
    assert all_reduces(many) == all_reduces(one), (all_reduces(many), all_reduces(one))


def test_splash_attention_compiles_for_a_tpu_chip_from_this_host():
    """``packing.attention(implementation="splash")`` lowers its Pallas kernel for a TPU
    target though this host's backend is not TPU (the off-TPU error is per platform)."""
    chunk = {"attention_mask": on_chip((1, 128), jnp.int32),
             "segment_ids": on_chip((1, 128), jnp.int32)}  # fmt: skip
    x = on_chip((1, 128, 1, 128), jnp.bfloat16)
    loss = lambda q, c: jnp.sum(packing.attention(q, q, q, c, implementation="splash"))
    hlo = jax.jit(jax.value_and_grad(loss)).lower(x, chunk).compile().as_text()
    assert "tpu_custom_call" in hlo  # the Pallas kernel (the xla form has none)
