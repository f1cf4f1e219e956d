"""Pod patterns under plain ``jax.jit``, as TPU users first write them.

* The batch placed with ``jax.device_put(x, NamedSharding(mesh, P("data")))``, with
  and without ``jax.set_mesh``, explicit and auto mesh axes.
* A 2-D ``(data, model)`` mesh with Megatron-style parameters (the first layer split
  by columns over ``model``, the second by rows), as Tevatron's partition rules do.

Every entry point must return the unsharded full-batch loss and gradients, and the
gradients must come back sharded like the parameters (never gathered whole).
"""

import contextlib

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax.compat import cachex
from gc_jax.losses import contrastive_loss

SPECS = {"w1": P(None, "model"), "w2": P("model", None), "log_temp": P()}
ROWS, CHUNK = 32, 2  # 8 rows per data shard, 4 chunks


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (6, 16)) / 2,
        "w2": jax.random.normal(k2, (16, 8)) / 4,
        "log_temp": jnp.array(-0.5),
    }


def encode(p, x, key):
    """A two-layer MLP whose second matmul contracts over the ``model`` axis."""
    h = jnp.tanh(x @ p["w1"])
    if key is not None:
        h = h * jax.random.bernoulli(key, 0.8, h.shape) / 0.8
    sharding = jax.typeof(h).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return h @ p["w2"]
    # Explicit axes make the user say how a contraction over a sharded dim is sharded.
    out = NamedSharding(mesh, P(sharding.spec[0], None))
    return jnp.matmul(h, p["w2"], out_sharding=out)


def loss_fn(p, q, d):
    return contrastive_loss(q, d, temperature=jnp.exp(p["log_temp"]))


def data():
    kq, kd = jax.random.split(jax.random.key(1))
    return jax.random.normal(kq, (ROWS, 6)), jax.random.normal(kd, (ROWS, 6))


def reference():
    """Unsharded, unchunked ``jax.value_and_grad`` (no dropout)."""
    q, d = data()
    total = lambda p: loss_fn(p, encode(p, q, None), encode(p, d, None))
    return jax.jit(jax.value_and_grad(total))(init_params())


REFERENCE = None


def expected():
    global REFERENCE
    if REFERENCE is None:
        REFERENCE = reference()
    return REFERENCE


def placed(axis_type, model):
    """Mesh, parameters and batch placed on it (parameters split over ``model``)."""
    shape, names = ((4, 2), ("data", "model")) if model else ((8,), ("data",))
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    specs = SPECS if model else jax.tree.map(lambda _: P(), SPECS)
    params = jax.tree.map(
        lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), init_params(), specs
    )
    batch = [jax.device_put(v, NamedSharding(mesh, P("data"))) for v in data()]
    return mesh, params, batch


def check(out_grads, params):
    for name, g in out_grads.items():
        want = params[name].sharding
        assert g.sharding.is_equivalent_to(want, g.ndim), (
            f"grads[{name!r}] came back as {g.sharding}, the parameter is {want}"
        )


def cached_value_and_grad(batch_axis):
    return jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, CHUNK, batch_axis=batch_axis))


def chunked_encoder(batch_axis):
    enc = gc_jax.chunked_encoder(encode, CHUNK, batch_axis=batch_axis)
    return jax.jit(jax.value_and_grad(lambda p, q, d: loss_fn(p, enc(p, q), enc(p, d))))


def cachex_grad_cached(batch_axis):
    """The original's JAX port as Tevatron uses it: pre-chunked batches (8 chunks)."""
    del batch_axis  # the port has no batch_axis: chunks are read from the array types
    fwd = cachex.grad_cached(lambda p, x: encode(p, x, None), None)
    chunked = lambda p, x: fwd(p, cachex.tree_chunk(x, 8))
    return jax.jit(jax.value_and_grad(lambda p, q, d: loss_fn(p, chunked(p, q), chunked(p, d))))


ENTRY_POINTS = {
    "cached_value_and_grad": cached_value_and_grad,
    "chunked_encoder": chunked_encoder,
    "cachex.grad_cached": cachex_grad_cached,
}
CASES = [
    (axis_type, model, with_mesh)
    for axis_type in (AxisType.Explicit, AxisType.Auto)
    for model in (False, True)
    for with_mesh in (False, True)
]


def _id(case):
    axis_type, model, with_mesh = case
    mesh = "data,model" if model else "data"
    return f"{axis_type.name}-{mesh}-{'set_mesh' if with_mesh else 'no_mesh'}"


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_value_and_grad_entry_points(entry, case):
    axis_type, model, with_mesh = case
    mesh, params, batch = placed(axis_type, model)
    # batch_axis is only meaningful (and only valid) under auto axes with a mesh set.
    batch_axis = "data" if axis_type == AxisType.Auto and with_mesh else None
    fn = ENTRY_POINTS[entry](batch_axis)
    with jax.set_mesh(mesh) if with_mesh else contextlib.nullcontext():
        value, grads = fn(params, *batch)
    chex.assert_trees_all_close((value, grads), expected(), rtol=2e-5, atol=2e-6)
    check(grads, params)


@pytest.mark.parametrize("case", CASES[::3], ids=[_id(c) for c in CASES[::3]])
def test_train_step(case):
    axis_type, model, with_mesh = case
    mesh, params, batch = placed(axis_type, model)
    opt = optax.adamw(1e-2)
    step = jax.jit(gc_jax.make_train_step(loss_fn, encode, CHUNK, optimizer=opt))
    with jax.set_mesh(mesh) if with_mesh else contextlib.nullcontext():
        (new_params, _), metrics = step((params, opt.init(params)), *batch)
    value, grads = expected()
    updates, _ = opt.update(grads, opt.init(init_params()), init_params())
    want = optax.apply_updates(init_params(), updates)
    chex.assert_trees_all_close(metrics["loss"], value, rtol=2e-5)
    chex.assert_trees_all_close(new_params, want, rtol=2e-5, atol=2e-6)
    check(new_params, params)


def test_dropout_under_a_sharded_batch_matches_the_documented_keys():
    """Chunk ``c`` of a sharded batch is every device's ``c``-th slice; device ``s``
    encodes its rows of it on its own, with ``fold_in(fold_in(fold_in(rng, i), c), s)``."""
    _, params, batch = placed(AxisType.Explicit, True)
    key = jax.random.key(5)
    got = cached_value_and_grad(None)(params, *batch, rng=key)
    q, d = data()
    shards, rows = 4, ROWS // 4

    def chunked(p, x, i):  # device s, chunk c: rows [c*CHUNK, (c+1)*CHUNK) of shard s
        x = x.reshape(shards, rows, -1)
        out = [
            [
                encode(p, x[s, c : c + CHUNK], jax.random.fold_in(
                    jax.random.fold_in(jax.random.fold_in(key, i), c // CHUNK), s))
                for c in range(0, rows, CHUNK)
            ]
            for s in range(shards)
        ]  # fmt: skip
        return jnp.concatenate([jnp.concatenate(parts) for parts in out])

    total = lambda p: loss_fn(p, chunked(p, q, 0), chunked(p, d, 1))
    want = jax.jit(jax.value_and_grad(total))(init_params())
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
