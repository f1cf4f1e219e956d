"""gc_jax.compat.cachex under sharded jit: every form its docstring says works.

``jax.make_mesh``'s axes are explicit on current JAX; the batch is placed with
``NamedSharding(mesh, P("data"))`` (or within its chunks, ``P(None, "data")``) and the
step is a plain sharded ``jax.jit`` without ``jax.set_mesh``, as users first write it
(the last test: the same under auto axes). Each form is compared with the unsharded
full-batch ``jax.value_and_grad``.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gc_jax.compat import cachex
from gc_jax.losses import contrastive_loss

ROWS, TOL = 64, {"rtol": 2e-5, "atol": 2e-6}


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def fwd(p, batch):  # Tevatron's form: fwd(params, batch) with a dict batch
    return jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]


def loss(q, d):
    return contrastive_loss(q, d, temperature=0.1)


def setup(axis_type=AxisType.Explicit):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (6, 16)) / 2, "w2": jax.random.normal(k2, (16, 8)) / 4}
    q, d = jax.random.normal(k3, (ROWS, 6)), jax.random.normal(k4, (ROWS, 6))
    full = lambda p: loss(fwd(p, {"x": q}), fwd(p, {"x": d}))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    return mesh, params, {"x": q}, {"x": d}, jax.jit(jax.value_and_grad(full))(params)


def place(mesh, tree, spec):
    return jax.tree.map(lambda v: jax.device_put(v, NamedSharding(mesh, spec)), tree)


@pytest.mark.parametrize("n_chunk", [8, 16])
def test_grad_cached_on_a_row_sharded_batch_chunked_inside_jit(n_chunk):
    mesh, params, q, d, want = setup()
    cached = cachex.grad_cached(fwd, None)
    enc = lambda p, b: cached(p, cachex.tree_chunk(b, n_chunk))
    step = jax.jit(jax.value_and_grad(lambda p, q, d: loss(enc(p, q), enc(p, d))))
    got = step(params, place(mesh, q, P("data")), place(mesh, d, P("data")))
    chex.assert_trees_all_close(got, want, **TOL)


def test_grad_cached_on_a_pre_chunked_batch_sharded_over_chunks():
    mesh, params, q, d, want = setup()
    cached = cachex.grad_cached(fwd, None)
    qq, dd = (place(mesh, cachex.tree_chunk(b, 8), P("data")) for b in (q, d))
    step = jax.jit(jax.value_and_grad(lambda p, q, d: loss(cached(p, q), cached(p, d))))
    chex.assert_trees_all_close(step(params, qq, dd), want, **TOL)


def test_tree_chunk_names_the_shards_it_needs():
    mesh, _, q, _, _ = setup()
    rows48 = place(mesh, jax.tree.map(lambda x: x[:48], q), P("data"))
    with pytest.raises(ValueError, match=r"sharded 8 ways .* n_chunk=12 nor the 4 rows"):
        jax.jit(lambda b: cachex.tree_chunk(b, 12))(rows48)


def test_fewer_chunks_than_devices_are_spread_over_them():
    """4 chunks of 16 rows on 8 devices: each chunk's rows split over the devices."""
    mesh, params, q, d, want = setup()
    chunked = jax.jit(lambda b: cachex.tree_chunk(b, 4))(place(mesh, q, P("data")))
    assert chunked["x"].sharding.spec == P(None, "data", None)
    cached = cachex.grad_cached(fwd, None)
    enc = lambda p, b: cached(p, cachex.tree_chunk(b, 4))
    step = jax.jit(jax.value_and_grad(lambda p, q, d: loss(enc(p, q), enc(p, d))))
    got = step(params, place(mesh, q, P("data")), place(mesh, d, P("data")))
    chex.assert_trees_all_close(got, want, **TOL)
    qq, dd = (place(mesh, cachex.tree_chunk(b, 4), P(None, "data")) for b in (q, d))
    chex.assert_trees_all_close(jax.jit(chunk_encode_cache_grad)(params, qq, dd), want, **TOL)


def test_grad_cached_on_a_batch_sharded_within_its_chunks():
    mesh, params, q, d, want = setup()
    cached = cachex.grad_cached(fwd, None)
    qq, dd = (place(mesh, cachex.tree_chunk(b, 8), P(None, "data")) for b in (q, d))
    step = jax.jit(jax.value_and_grad(lambda p, q, d: loss(cached(p, q), cached(p, d))))
    chex.assert_trees_all_close(step(params, qq, dd), want, **TOL)


def chunk_encode_cache_grad(p, qq, dd):
    """The original's three-call form: pass 1, the loss on the caches, pass 2."""
    enc = lambda params, x: fwd(params, {"x": x})
    q_reps = cachex.chunk_encode(functools.partial(enc, p))(x=qq["x"])
    d_reps = cachex.chunk_encode(functools.partial(enc, p))(x=dd["x"])
    loss_of = cachex.unchunk_args(axis=0, argnums=(0, 1))(loss)
    value, (gq, gd) = jax.value_and_grad(loss_of, argnums=(0, 1))(q_reps, d_reps)
    grads = cachex.cache_grad(enc)(p, jax.tree.map(jnp.zeros_like, p), gq, x=qq["x"])
    return value, cachex.cache_grad(enc)(p, grads, gd, x=dd["x"])


@pytest.mark.parametrize("spec", [P("data"), P(None, "data")], ids=["over chunks", "within"])
def test_chunk_encode_and_cache_grad_on_a_sharded_batch(spec):
    mesh, params, q, d, want = setup()
    qq, dd = (place(mesh, cachex.tree_chunk(b, 8), spec) for b in (q, d))
    chex.assert_trees_all_close(jax.jit(chunk_encode_cache_grad)(params, qq, dd), want, **TOL)


def test_chunk_encode_over_params_placed_on_the_mesh():
    """``chunk_encode(partial(enc, params))`` closes over params typed on the mesh,
    which cannot enter each device's program: the chunks are spread over the devices."""
    mesh, params, q, d, want = setup()
    qq, dd = (place(mesh, cachex.tree_chunk(b, 8), P("data")) for b in (q, d))
    got = jax.jit(chunk_encode_cache_grad)(place(mesh, params, P()), qq, dd)
    chex.assert_trees_all_close(got, want, **TOL)


def test_chunk_encode_and_cache_grad_unsharded():
    """The same program on one device."""
    _, params, q, d, want = setup()
    qq, dd = cachex.tree_chunk(q, 8), cachex.tree_chunk(d, 8)
    chex.assert_trees_all_close(jax.jit(chunk_encode_cache_grad)(params, qq, dd), want, **TOL)


@pytest.mark.parametrize("spec", [P("data"), P(None, "data")], ids=["over chunks", "within"])
def test_every_form_under_auto_axes(spec):
    mesh, params, q, d, want = setup(AxisType.Auto)
    qq, dd = (place(mesh, cachex.tree_chunk(b, 8), spec) for b in (q, d))
    cached = cachex.grad_cached(fwd, None)
    step = jax.jit(jax.value_and_grad(lambda p, q, d: loss(cached(p, q), cached(p, d))))
    chex.assert_trees_all_close(step(params, qq, dd), want, **TOL)
    chex.assert_trees_all_close(jax.jit(chunk_encode_cache_grad)(params, qq, dd), want, **TOL)
