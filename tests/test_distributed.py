"""Data parallelism on 8 emulated devices: pmap, shard_map and sharded jit.

Every form must return the global loss and the gradient of the global loss, equal to
single-device full-batch ``jax.value_and_grad`` over the concatenated batch.
"""

import contextlib
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import full_batch_value_and_grad

import gc_jax
from gc_jax.losses import contrastive_loss

DEVICES = 8
LOCAL_ROWS = 6


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() >= DEVICES, (
        "distributed tests need 8 devices: run with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (as .ci/run does)"
    )


def make_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (5, 12)) / 2,
        "w2": jax.random.normal(k2, (12, 4)) / 3,
        "log_temp": jnp.array(-0.5),
    }


def encode(params, x, key):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def make_loss(axis_name=None, k=None):
    def loss(params, q, d):
        temp = jnp.exp(params["log_temp"])
        return contrastive_loss(q, d, temperature=temp, axis_name=axis_name, docs_per_query=k)

    return loss


def global_batch(k):
    kq, kd = jax.random.split(jax.random.key(1))
    rows = DEVICES * LOCAL_ROWS
    return jax.random.normal(kq, (rows, 5)), jax.random.normal(kd, (rows * k, 5))


def expected(k):
    return full_batch_value_and_grad(make_loss(), encode, 1, make_params(), *global_batch(k))


def per_device(x):
    return x.reshape(DEVICES, -1, *x.shape[1:])


CASES = [(1, 1), (4, 1), (LOCAL_ROWS, 1), (4, 3), (5, 2)]


@pytest.mark.parametrize(("chunk_size", "k"), CASES)
def test_pmap(chunk_size, k):
    grad_fn = gc_jax.cached_value_and_grad(make_loss("d", k), encode, chunk_size, axis_name="d")
    q, d = global_batch(k)
    loss, grads = jax.pmap(grad_fn, axis_name="d", in_axes=(None, 0, 0))(
        make_params(), per_device(q), per_device(d)
    )
    want_loss, want_grads = expected(k)
    for device in range(DEVICES):  # identical on every device
        chex.assert_trees_all_close(
            (loss[device], jax.tree.map(lambda g, i=device: g[i], grads)),
            (want_loss, want_grads),
            rtol=2e-5,
            atol=2e-6,
        )


def shard_map_step(chunk_size, mesh):
    grad_fn = gc_jax.cached_value_and_grad(make_loss("d"), encode, chunk_size, axis_name="d")
    return jax.jit(
        jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    )


def sharded(mesh, *arrays):
    return [jax.device_put(a, NamedSharding(mesh, P("d"))) for a in arrays]


@pytest.mark.parametrize(("chunk_size", "k"), CASES)
def test_shard_map(chunk_size, k):
    mesh = jax.make_mesh((DEVICES,), ("d",))
    got = shard_map_step(chunk_size, mesh)(make_params(), *sharded(mesh, *global_batch(k)))
    chex.assert_trees_all_close(got, expected(k), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize(("chunk_size", "k"), [(1, 1), (4, 3), (5, 2)])
def test_sharded_jit(axis_type, chunk_size, k):
    mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(axis_type,))
    batch_axis = "d" if axis_type == AxisType.Auto else None
    grad_fn = jax.jit(
        gc_jax.cached_value_and_grad(make_loss(), encode, chunk_size, batch_axis=batch_axis)
    )
    inputs = sharded(mesh, *global_batch(k))
    with jax.set_mesh(mesh):
        got = grad_fn(make_params(), *inputs)
        hlo = grad_fn.lower(make_params(), *inputs).compile().as_text()
    chex.assert_trees_all_close(got, expected(k), rtol=2e-5, atol=2e-6)
    # Every device encodes its own rows of each chunk: no rows are moved between
    # devices for the encoder passes.
    assert "collective-permute" not in hlo
    assert "all-to-all" not in hlo


def while_bodies(hlo: str) -> list[str]:
    """The HLO text of every computation used as a while-loop body."""
    names = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    blocks = re.split(r"\n(?=\S)", hlo)
    return [b for b in blocks if any(re.match(rf"%?{re.escape(n)}\b", b) for n in names)]


@pytest.mark.parametrize("chunk_size", [1, 2, 3])
def test_one_gradient_reduction_per_step(chunk_size):
    mesh = jax.make_mesh((DEVICES,), ("d",))
    inputs = sharded(mesh, *global_batch(2))
    hlo = shard_map_step(chunk_size, mesh).lower(make_params(), *inputs).compile().as_text()
    bodies = while_bodies(hlo)
    assert bodies, "expected the chunk loops in the compiled step"
    for body in bodies:
        assert "all-reduce" not in body, "an all-reduce runs once per chunk"
    # The step's all-reduces do not depend on how many chunks there are.
    single = shard_map_step(LOCAL_ROWS, mesh).lower(make_params(), *inputs).compile().as_text()
    assert hlo.count("all-reduce(") == single.count("all-reduce(")


def gradient_all_reduces(hlo: str) -> int:
    """All-reduces whose operands include the gradient of ``w1`` (f32[5, 12])."""
    return sum("f32[5,12]" in r for r in re.findall(r"= (.*?) all-reduce(?:-start)?\(", hlo))


def sharded_jit_step(form, axis_type, chunk_size):
    """A sharded-jit step (as users first write it: no ``jax.set_mesh`` for explicit axes)."""
    batch_axis = "d" if axis_type == AxisType.Auto else None
    if form == "cached_value_and_grad":
        return jax.jit(
            gc_jax.cached_value_and_grad(make_loss(), encode, chunk_size, batch_axis=batch_axis)
        )
    enc = gc_jax.chunked_encoder(encode, chunk_size, batch_axis=batch_axis)
    total = lambda p, q, d: make_loss()(p, enc(p, q), enc(p, d))
    return jax.jit(jax.value_and_grad(total))


@pytest.mark.parametrize("form", ["cached_value_and_grad", "chunked_encoder"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_sharded_jit_all_reduces_the_gradients_once_per_step(form, axis_type):
    """Each device accumulates its own rows' gradient; the step sums them once
    (``chunked_encoder``: once per call).

    Before, the compiler all-reduced each chunk's gradient (XLA:CPU: inside the loops;
    the TPU compiler: once per input's loop and once for the kept last chunk).
    """
    mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(axis_type,))
    inputs = sharded(mesh, *global_batch(2))
    counts = []
    for chunk_size in (2, LOCAL_ROWS):  # 3 chunks per device, and one
        step = sharded_jit_step(form, axis_type, chunk_size)
        with jax.set_mesh(mesh) if axis_type == AxisType.Auto else contextlib.nullcontext():
            got = step(make_params(), *inputs)
            hlo = step.lower(make_params(), *inputs).compile().as_text()
        chex.assert_trees_all_close(got, expected(2), rtol=2e-5, atol=2e-6)
        for body in while_bodies(hlo):
            assert "all-reduce" not in body, "an all-reduce runs once per chunk"
        counts.append(gradient_all_reduces(hlo))
    # chunked_encoder: at most one per call (each call's backward is its own; XLA may
    # combine the two calls' all-reduces).
    most = 1 if form == "cached_value_and_grad" else 2
    assert counts[0] == counts[1] <= most, f"gradient all-reduces, 3 chunks and 1: {counts}"


def test_parameters_sharded_over_the_batch_axes_are_not_copied_per_device():
    """FSDP: a parameter sharded over the batch's mesh axis keeps its sharding; the
    chunks then span the devices (the gradients are the same)."""
    mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(AxisType.Explicit,))
    params = make_params()
    params["w1"] = jax.device_put(params["w1"], NamedSharding(mesh, P(None, None)))
    params["w2"] = jax.device_put(jnp.tile(params["w2"], (2, 1))[:8], NamedSharding(mesh, P("d")))
    enc = lambda p, x, key: jnp.tanh(x @ p["w1"])[:, :8] @ p["w2"]
    step = jax.jit(gc_jax.cached_value_and_grad(make_loss(), enc, 2))
    got = step(params, *sharded(mesh, *global_batch(1)))
    unsharded = jax.tree.map(jnp.asarray, jax.device_get(params))
    want = full_batch_value_and_grad(make_loss(), enc, 1, unsharded, *global_batch(1))
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
    assert got[1]["w2"].sharding.is_equivalent_to(params["w2"].sharding, 2)


def test_an_encoder_with_a_host_callback_is_encoded_per_device():
    """A ``pure_callback`` without ``vmap_method`` (no batching rule): each device
    encodes its rows under ``shard_map``, which needs none, so nothing warns and the
    gradient is exact. The callback's result is typed unsharded; gc_jax splits its
    rows again."""

    def enc(params, x, key):  # e.g. host-side features; the result type loses the sharding
        x = jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return encode(params, x, key)

    mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(AxisType.Explicit,))
    step = jax.jit(gc_jax.cached_value_and_grad(make_loss(), enc, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step(make_params(), *sharded(mesh, *global_batch(1)))
    chex.assert_trees_all_close(got, expected(1), rtol=2e-5, atol=2e-6)
