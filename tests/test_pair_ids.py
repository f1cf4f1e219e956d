"""``sigmoid_loss`` and ``clip_loss`` with ids: duplicates are not negatives, in every form.

Each case is compared, value and gradients (rows, ``logit_scale``, ``logit_bias``),
with a float64 dense reference written out here; across 8 devices the batch is split
by ``shard_map`` (gather and ring), ``pmap`` and sharded ``jit``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gc_jax.losses import clip_loss, sigmoid_loss

D, N_LOCAL, DIM = 8, 4, 6
N = D * N_LOCAL
TOL = {"rtol": 1e-5, "atol": 1e-6}


def reference(x, y, scale, bias, qid, pid):
    """Float64: ``-sum log sigmoid(label * z)`` over the pairs the ids keep, / rows."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    z = np.exp(scale) * x @ y.T + bias
    labels = 2 * np.eye(len(x)) - 1
    same = np.zeros((len(x), len(y)), bool)
    for ids in (qid, pid):
        if ids is not None:
            ids = np.asarray(ids).reshape(len(x), -1)
            same |= (ids[:, None, :] == ids[None, :, :]).all(-1)
    keep = ~same | np.eye(len(x), dtype=bool)
    terms = np.logaddexp(0, -labels * z)  # -log sigmoid(l z)
    return np.where(keep, terms, 0).sum() / len(x)


def _data(seed=0, width=1):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(2, N, DIM)).astype(np.float32)
    qid = rng.integers(0, 6, (N, width)).astype(np.int32)  # many duplicates
    pid = rng.integers(0, 6, (N, width)).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y), jnp.asarray(qid), jnp.asarray(pid)


def _want(x, y, scale, bias, qid, pid):
    """The reference's value and gradients (float64, by autodiff of the same formula)."""
    with jax.enable_x64():
        f = lambda x, y, s, b: _ref_jax(x, y, s, b, qid, pid)
        args = (
            jnp.asarray(x, jnp.float64),
            jnp.asarray(y, jnp.float64),
            jnp.float64(scale),
            jnp.float64(bias),
        )
        value, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(*args)
        return np.asarray(value), [np.asarray(g) for g in grads]


def _ref_jax(x, y, scale, bias, qid, pid):
    z = jnp.exp(scale) * x @ y.T + bias
    labels = 2 * jnp.eye(len(x)) - 1
    same = jnp.zeros((len(x), len(y)), bool)
    for ids in (qid, pid):
        if ids is not None:
            same |= (ids[:, None, :] == ids[None, :, :]).all(-1)
    keep = ~same | jnp.eye(len(x), dtype=bool)
    return jnp.where(keep, -jax.nn.log_sigmoid(labels * z), 0).sum() / len(x)


def _check(got, want):
    value, grads = got
    chex.assert_trees_all_close(np.asarray(value), want[0], **TOL)
    chex.assert_trees_all_close([np.asarray(g) for g in grads], want[1], **TOL)


@pytest.mark.parametrize("block_size", [None, 5])
@pytest.mark.parametrize("which", ["query", "doc", "both", "wide"])
def test_one_device_matches_reference(block_size, which):
    x, y, qid, pid = _data(width=2 if which == "wide" else 1)
    qid = None if which == "doc" else qid
    pid = None if which == "query" else pid

    def loss(x, y, s, b):
        return sigmoid_loss(x, y, s, b, query_ids=qid, doc_ids=pid, block_size=block_size)

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, y, 0.3, -1.0)
    _check(got, _want(x, y, 0.3, -1.0, qid, pid))
    assert np.isclose(float(got[0]), reference(x, y, 0.3, -1.0, qid, pid), rtol=1e-5)


def test_ids_change_the_loss():
    x, y, qid, pid = _data()
    plain = sigmoid_loss(x, y, 0.3, -1.0)
    with_ids = sigmoid_loss(x, y, 0.3, -1.0, query_ids=qid, doc_ids=pid)
    assert not np.isclose(float(plain), float(with_ids))


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices: XLA_FLAGS=--xla_force_host_platform_device_count={D}")
    return jax.make_mesh((D,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("method", ["gather", "ring"])
@pytest.mark.parametrize("block_size", [None, 2])
def test_shard_map_matches_reference(mesh, method, block_size):
    x, y, qid, pid = _data(1)

    def per_device(x, y, qid, pid, s, b):
        def loss(x, y, s, b):
            kw = {"query_ids": qid, "doc_ids": pid, "block_size": block_size}
            return sigmoid_loss(x, y, s, b, axis_name="d", method=method, **kw)

        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, y, s, b)
        return value, grads

    rows = P("d")
    f = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(rows, rows, rows, rows, P(), P()),
        out_specs=(P(), (rows, rows, P(), P())),
    )
    got = jax.jit(f)(x, y, qid, pid, jnp.float32(0.3), jnp.float32(-1.0))
    _check(got, _want(x, y, 0.3, -1.0, qid, pid))


def test_pmap_ring_matches_reference(mesh):
    x, y, qid, pid = _data(2)
    split = lambda v: v.reshape(D, N_LOCAL, *v.shape[1:])

    def loss(x, y, qid, pid, s, b):
        kw = {"query_ids": qid, "doc_ids": pid, "block_size": 2}
        return sigmoid_loss(x, y, s, b, axis_name="d", method="ring", **kw)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 4, 5))

    def per_device(x, y, qid, pid, s, b):
        value, (dx, dy, ds, db) = grad(x, y, qid, pid, s, b)
        return value, (dx, dy, jax.lax.psum(ds, "d"), jax.lax.psum(db, "d"))

    f = jax.pmap(per_device, axis_name="d", in_axes=(0, 0, 0, 0, None, None))
    value, (dx, dy, ds, db) = f(*map(split, (x, y, qid, pid)), 0.3, -1.0)
    got = (value[0], (dx.reshape(N, DIM), dy.reshape(N, DIM), ds[0], db[0]))
    _check(got, _want(x, y, 0.3, -1.0, qid, pid))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("method", ["gather", "ring"])
def test_sharded_jit_matches_reference(axis_type, method):
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices")
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((D,), ("d",), axis_types=(kind,))
    x, y, qid, pid = _data(3)
    x, y, qid, pid = (jax.device_put(v, NamedSharding(mesh, P("d"))) for v in (x, y, qid, pid))

    # Explicit axes: the types say how the rows lie. Auto axes: the mesh is set and
    # the loss names its axis.
    axis_name = "d" if axis_type == "Auto" else None

    def loss(x, y, s, b):
        kw = {"query_ids": qid, "doc_ids": pid, "block_size": 2, "method": method}
        return sigmoid_loss(x, y, s, b, axis_name=axis_name, **kw)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    if axis_type == "Auto":
        with jax.set_mesh(mesh):
            got = step(x, y, 0.3, -1.0)
    else:
        got = step(x, y, 0.3, -1.0)
    x, y, qid, pid = (jnp.asarray(np.asarray(v)) for v in (x, y, qid, pid))  # unsharded
    _check(got, _want(x, y, 0.3, -1.0, qid, pid))


def test_ids_that_are_not_integers_are_named():
    x, y, qid, _ = _data()
    with pytest.raises(TypeError, match="query_ids must be an integer array"):
        sigmoid_loss(x, y, 0.0, 0.0, query_ids=qid.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"doc_ids must hold one id per row of y"):
        sigmoid_loss(x, y, 0.0, 0.0, doc_ids=qid[:3])


def _clip_reference(x, y, logit_scale, qid, pid):
    """Float64 CLIP: both directions' InfoNCE with the same-id pairs (not i == j) dropped."""
    z = jnp.exp(logit_scale) * x @ y.T
    same = jnp.zeros(z.shape, bool)
    for ids in (qid, pid):
        if ids is not None:
            same |= (ids[:, None, :] == ids[None, :, :]).all(-1)
    keep = ~same | jnp.eye(len(x), dtype=bool)
    masked = jnp.where(keep, z, -jnp.inf)
    diag = jnp.diag(z)
    x_to_y = jax.nn.logsumexp(masked, axis=1) - diag
    y_to_x = jax.nn.logsumexp(masked, axis=0) - diag
    return jnp.mean((x_to_y + y_to_x) / 2)


def _clip_want(x, y, logit_scale, qid, pid):
    with jax.enable_x64():
        f = lambda x, y, s: _clip_reference(x, y, s, qid, pid)
        args = (jnp.asarray(x, jnp.float64), jnp.asarray(y, jnp.float64), jnp.float64(logit_scale))
        value, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(*args)
        return np.asarray(value), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("block_size", [None, 5])
def test_clip_ids_one_device(block_size):
    x, y, qid, pid = _data(4)

    def loss(x, y, s):
        return clip_loss(x, y, s, query_ids=qid, doc_ids=pid, block_size=block_size)

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, y, 0.7)
    _check(got, _clip_want(x, y, 0.7, qid, pid))


def test_clip_without_ids_is_unchanged():
    x, y, _, _ = _data(5)
    got = jax.jit(jax.value_and_grad(lambda x, y, s: clip_loss(x, y, s), argnums=(0, 1, 2)))
    _check(got(x, y, 0.7), _clip_want(x, y, 0.7, None, None))


@pytest.mark.parametrize("method", ["gather", "ring"])
def test_clip_ids_shard_map(mesh, method):
    x, y, qid, pid = _data(6)

    def per_device(x, y, qid, pid, s):
        def loss(x, y, s):
            kw = {"query_ids": qid, "doc_ids": pid, "block_size": 2}
            return clip_loss(x, y, s, axis_name="d", method=method, **kw)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, y, s)

    rows = P("d")
    f = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(rows, rows, rows, rows, P()),
        out_specs=(P(), (rows, rows, P())),
    )
    got = jax.jit(f)(x, y, qid, pid, jnp.float32(0.7))
    _check(got, _clip_want(x, y, 0.7, qid, pid))
