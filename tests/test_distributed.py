"""Data parallelism on 8 emulated devices: pmap, shard_map and sharded jit.

Every form must return the global loss and the gradient of the global loss, equal to
single-device full-batch ``jax.value_and_grad`` over the concatenated batch.
"""

import re

import chex
import jax
import jax.numpy as jnp
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


def make_loss(axis_name=None):
    def loss(params, q, d):
        temp = jnp.exp(params["log_temp"])
        return contrastive_loss(q, d, temperature=temp, axis_name=axis_name)

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
    grad_fn = gc_jax.cached_value_and_grad(make_loss("d"), encode, chunk_size, axis_name="d")
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
