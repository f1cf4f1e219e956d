"""Tests of gc_jax.losses: dense vs naive references, blockwise vs dense, across devices.

CI runs with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (8 CPU devices).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax.losses import clip_loss, contrastive_loss, sigmoid_loss

D = 8  # emulated devices
TOL = {"rtol": 2e-5, "atol": 2e-6}
# Blockwise sums in another order; scalar gradients sum O(rows^2) terms that cancel.
BLOCK_TOL = {"rtol": 2e-4, "atol": 2e-5}


@pytest.fixture(scope="module")
def devices():
    assert jax.device_count() >= D, (
        f"these tests need {D} devices, found {jax.device_count()}: run with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={D} (as .ci/run does)."
    )
    return jax.devices()[:D]


def _data(n: int, m: int, dim: int = 5, seed: int = 0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, dim)), jax.random.normal(ky, (m, dim))


def _reduce(per_row, reduction):
    return {"mean": jnp.mean, "sum": jnp.sum, "none": lambda v: v}[reduction](per_row)


# Naive references: the definitions, written out with full logit matrices.


def ref_contrastive(x, y, temperature, reduction="mean"):
    k = y.shape[0] // x.shape[0]
    logp = jax.nn.log_softmax(x @ y.T / temperature, axis=1)
    rows = jnp.arange(x.shape[0])
    return _reduce(-logp[rows, rows * k], reduction)


def ref_clip(x, y, logit_scale, reduction="mean"):
    logits = jnp.exp(logit_scale) * x @ y.T
    diag = jnp.arange(x.shape[0])
    x_to_y = jax.nn.log_softmax(logits, axis=1)[diag, diag]
    y_to_x = jax.nn.log_softmax(logits, axis=0)[diag, diag]
    return _reduce(-(x_to_y + y_to_x) / 2, reduction)


def ref_sigmoid(x, y, logit_scale, logit_bias, reduction="mean"):
    logits = jnp.exp(logit_scale) * x @ y.T + logit_bias
    labels = 2 * jnp.eye(x.shape[0]) - 1
    return _reduce(-jax.nn.log_sigmoid(labels * logits).sum(axis=1), reduction)


# (loss, reference, k, scalar args): each case's learnable scalars come last.
CASES = {
    "contrastive": (
        lambda x, y, t, **kw: contrastive_loss(x, y, temperature=t, **kw),
        ref_contrastive,
        1,
        (0.3,),
    ),
    "contrastive_hard_negatives": (
        lambda x, y, t, **kw: contrastive_loss(x, y, temperature=t, **kw),
        ref_contrastive,
        3,
        (0.7,),
    ),
    "clip": (clip_loss, ref_clip, 1, (np.log(5.0),)),
    "sigmoid": (sigmoid_loss, ref_sigmoid, 1, (np.log(3.0), -2.0)),
}


def _value_and_grads(fn, x, y, scalars, **kw):
    """Value and gradient w.r.t. x, y and every scalar, under jit."""
    argnums = tuple(range(2 + len(scalars)))
    f = jax.jit(jax.value_and_grad(lambda *a: fn(*a, **kw), argnums=argnums))
    return f(x, y, *(jnp.asarray(s, jnp.result_type(s, x)) for s in scalars))


def _all_reductions(fn, x, y, scalars):
    """Value and gradients for "mean" and "sum", and the "none" per-row losses, in one jit."""
    argnums = tuple(range(2 + len(scalars)))

    def run(*args):
        grads = {
            r: jax.value_and_grad(functools.partial(fn, reduction=r), argnums)(*args)
            for r in ("mean", "sum")
        }
        return grads, fn(*args, reduction="none")

    return jax.jit(run)(x, y, *(jnp.float32(s) for s in scalars))


@pytest.mark.parametrize("case", list(CASES))
def test_dense_matches_reference(case):
    loss, ref, k, scalars = CASES[case]
    x, y = _data(6, 6 * k)
    got = _all_reductions(loss, x, y, scalars)
    assert got[1].shape == (6,)
    chex.assert_trees_all_close(got, _all_reductions(ref, x, y, scalars), **TOL)


def test_dense_values_match_float64_numpy():
    x, y = _data(4, 8)
    xd, yd = np.asarray(x, np.float64), np.asarray(y, np.float64)

    def log_softmax(z, axis):
        z = z - z.max(axis=axis, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))

    i = np.arange(4)
    logits = 4.0 * xd @ yd[:4].T
    want = (
        -log_softmax(xd @ yd.T / 0.5, 1)[i, 2 * i].mean(),
        -(log_softmax(logits, 1)[i, i] + log_softmax(logits, 0)[i, i]).mean() / 2,
        np.log1p(np.exp(-(2 * np.eye(4) - 1) * (logits - 1.0))).sum() / 4,
    )
    got = jax.jit(
        lambda x, y: (
            contrastive_loss(x, y, temperature=0.5),
            clip_loss(x, y[:4], np.log(4.0)),
            sigmoid_loss(x, y[:4], np.log(4.0), -1.0),
        )
    )(x, y)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# Block sizes dividing 12 rows (1, 4), not dividing (5), and larger than the rows (100).
BLOCKWISE = [("contrastive_hard_negatives", b) for b in (1, 4, 5, 100)] + [
    ("contrastive", 5),
    ("clip", 5),
    ("sigmoid", 5),
    ("sigmoid", 100),
]


@functools.cache
def _dense(case):
    loss, _, k, scalars = CASES[case]
    x, y = _data(12, 12 * k)
    return x, y, _value_and_grads(loss, x, y, scalars)


@pytest.mark.parametrize(("case", "block_size"), BLOCKWISE)
def test_blockwise_matches_dense(case, block_size):
    loss, _, _, scalars = CASES[case]
    x, y, want = _dense(case)
    got = _value_and_grads(loss, x, y, scalars, block_size=block_size)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


@pytest.mark.parametrize("case", ["contrastive_hard_negatives", "sigmoid"])
def test_blockwise_matches_dense_in_float64(case):
    """In float64 rounding vanishes: the blockwise math is the dense math."""
    loss, _, k, scalars = CASES[case]
    with jax.enable_x64(True):
        x, y = (v.astype(jnp.float64) for v in _data(11, 11 * k))
        scalars = tuple(np.float64(s) for s in scalars)
        got = _value_and_grads(loss, x, y, scalars, block_size=4)
        want = _value_and_grads(loss, x, y, scalars)
        assert got[0].dtype == jnp.float64
        chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["contrastive_hard_negatives", "sigmoid"])
def test_blockwise_per_row_vjp_matches_dense(case):
    """reduction="none" with an arbitrary cotangent per row."""
    loss, _, k, scalars = CASES[case]
    x, y = _data(10, 10 * k)
    weights = jnp.linspace(-1.0, 2.0, 10)

    def weighted(*args, **kw):
        return jnp.sum(weights * loss(*args, reduction="none", **kw))

    got = _value_and_grads(weighted, x, y, scalars, block_size=4)
    want = _value_and_grads(weighted, x, y, scalars)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_blockwise_is_stable_for_large_logits():
    """Logits in the hundreds: the online LSE neither overflows nor loses the answer."""
    x, y = _data(9, 9)
    loss = CASES["contrastive"][0]
    got = _value_and_grads(loss, x, y, (0.01,), block_size=4)
    with jax.enable_x64(True):
        x64, y64 = x.astype(jnp.float64), y.astype(jnp.float64)
        want = _value_and_grads(ref_contrastive, x64, y64, (np.float64(0.01),))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))
    chex.assert_trees_all_close(got, jax.tree.map(np.float32, want), rtol=1e-3, atol=1e-3)


def test_blockwise_keeps_input_dtypes():
    """bfloat16 rows with a float32 temperature: computed in float32, cast back."""
    x, y = (v.astype(jnp.bfloat16) for v in _data(6, 6))
    loss = CASES["contrastive"][0]
    value, grads = _value_and_grads(loss, x, y, (jnp.float32(0.5),), block_size=4)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
    want = _value_and_grads(loss, x.astype(jnp.float32), y.astype(jnp.float32), (0.5,))
    chex.assert_trees_all_close(value, want[0], rtol=1e-5)


# Across devices: every device's value is the full-batch loss; per-device gradients of
# the sharded inputs, concatenated, are the full-batch gradients; per-device gradients
# of a replicated scalar sum to the full-batch one.

N_LOCAL = 3
DISTRIBUTED = [  # (case, block_size, reduction): dense and blockwise, 3 local rows per device
    ("contrastive_hard_negatives", None, "mean"),
    ("contrastive_hard_negatives", 2, "mean"),
    ("clip", None, "sum"),
    ("clip", 2, "mean"),
    ("sigmoid", None, "mean"),
    ("sigmoid", 2, "sum"),
]


@functools.cache
def _full_batch(case, reduction):
    loss, _, k, scalars = CASES[case]
    x, y = _data(D * N_LOCAL, D * N_LOCAL * k, seed=1)
    want = _value_and_grads(loss, x, y, scalars, reduction=reduction)
    return loss, scalars, x, y, want


def _local_value_and_grads(loss, scalars, block_size, reduction):
    def per_device(x, y, *s):
        def f(x, y, *s):
            return loss(x, y, *s, reduction=reduction, block_size=block_size, axis_name="d")

        value, grads = jax.value_and_grad(f, argnums=tuple(range(2 + len(s))))(x, y, *s)
        dx, dy, *ds = grads
        return value[None], dx, dy, *(jax.lax.psum(g, "d")[None] for g in ds)

    return per_device


def _check_distributed(out, want):
    value, dx, dy, *ds = out
    want_value, (want_dx, want_dy, *want_ds) = want
    chex.assert_trees_all_close(value, jnp.full((D,), want_value), **TOL)
    chex.assert_trees_all_close((dx, dy), (want_dx, want_dy), **TOL)
    chex.assert_trees_all_close(ds, [jnp.full((D,), g) for g in want_ds], **TOL)


@pytest.mark.parametrize(("case", "block_size", "reduction"), DISTRIBUTED)
def test_pmap_matches_full_batch(devices, case, block_size, reduction):
    loss, scalars, x, y, want = _full_batch(case, reduction)
    per_device = _local_value_and_grads(loss, scalars, block_size, reduction)
    in_axes = (0, 0) + (None,) * len(scalars)
    f = jax.pmap(per_device, axis_name="d", in_axes=in_axes, devices=devices)
    value, dx, dy, *ds = f(x.reshape(D, -1, x.shape[1]), y.reshape(D, -1, y.shape[1]), *scalars)
    flat = lambda g: g.reshape(-1, *g.shape[2:])
    _check_distributed((flat(value), flat(dx), flat(dy), *map(flat, ds)), want)


def _mesh(devices):
    return jax.make_mesh((D,), ("d",), devices=devices)


@pytest.mark.parametrize(("case", "block_size", "reduction"), DISTRIBUTED)
def test_shard_map_matches_full_batch(devices, case, block_size, reduction):
    loss, scalars, x, y, want = _full_batch(case, reduction)
    per_device = _local_value_and_grads(loss, scalars, block_size, reduction)

    def varying_scalars(x, y, *s):  # as cached_value_and_grad does with its params
        return per_device(x, y, *gc_jax._distributed.to_varying(s, "d"))

    mesh = _mesh(devices)
    f = jax.jit(
        jax.shard_map(
            varying_scalars,
            mesh=mesh,
            in_specs=(P("d"), P("d")) + (P(),) * len(scalars),
            out_specs=P("d"),
        )
    )
    shard = lambda v: jax.device_put(v, NamedSharding(mesh, P("d")))
    _check_distributed(f(shard(x), shard(y), *map(jnp.float32, scalars)), want)


@pytest.mark.parametrize("block_size", [None, 2])
def test_shard_map_replicated_scalar_gets_global_gradient(devices, block_size):
    """Without the cast to varying, a replicated scalar's gradient is already psummed."""
    x, y = _data(D * N_LOCAL, D * N_LOCAL, seed=2)
    want = jax.grad(clip_loss, argnums=2)(x, y, 1.0)

    def per_device(x, y, s):
        return jax.grad(clip_loss, argnums=2)(x, y, s, block_size=block_size, axis_name="d")

    mesh = _mesh(devices)
    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"), P("d"), P()), out_specs=P())
    shard = lambda v: jax.device_put(v, NamedSharding(mesh, P("d")))
    chex.assert_trees_all_close(jax.jit(f)(shard(x), shard(y), 1.0), want, **TOL)


def test_shard_map_none_reduction_is_local_rows(devices, block_size=2):
    x, y = _data(D * N_LOCAL, D * N_LOCAL * 2, seed=3)
    f = jax.shard_map(
        functools.partial(contrastive_loss, reduction="none", block_size=block_size, axis_name="d"),
        mesh=_mesh(devices),
        in_specs=(P("d"), P("d")),
        out_specs=P("d"),
    )
    shard = lambda v: jax.device_put(v, NamedSharding(_mesh(devices), P("d")))
    chex.assert_trees_all_close(
        jax.jit(f)(shard(x), shard(y)), contrastive_loss(x, y, reduction="none"), **TOL
    )


@pytest.mark.parametrize("block_size", [None, 5])
def test_sharded_jit_over_explicit_axes(devices, block_size):
    """Under plain jit with rows sharded over an explicit mesh axis: full-batch results."""
    x, y = _data(D * N_LOCAL, D * N_LOCAL, seed=5)
    want = _value_and_grads(clip_loss, x, y, (0.5,))
    mesh = jax.make_mesh((D,), ("d",), axis_types=(AxisType.Explicit,), devices=devices)
    shard = lambda v: jax.device_put(v, NamedSharding(mesh, P("d")))
    with jax.set_mesh(mesh):
        got = _value_and_grads(clip_loss, shard(x), shard(y), (0.5,), block_size=block_size)
    assert jax.typeof(got[1][0]).sharding.spec == P("d", None)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_cached_value_and_grad_with_blockwise_loss_under_shard_map(devices):
    """End to end: the core's one psum of parameter gradients gives the full-batch gradient."""
    encode = lambda p, x, key: jnp.tanh(x @ p[0])
    loss = lambda p, q, d, **kw: contrastive_loss(q, d, temperature=p[1], **kw)
    params = (jnp.eye(5) + 0.1, jnp.float32(0.5))
    q, d = _data(D * 4, D * 4, seed=4)
    full = lambda p: loss(p, encode(p, q, None), encode(p, d, None))
    want = jax.value_and_grad(full)(params)

    blockwise = functools.partial(loss, block_size=3, axis_name="d")
    step = gc_jax.cached_value_and_grad(blockwise, encode, chunk_size=3, axis_name="d")
    mesh = _mesh(devices)
    f = jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()), check_vma=True
    )
    shard = lambda v: jax.device_put(v, NamedSharding(mesh, P("d")))
    chex.assert_trees_all_close(jax.jit(f)(params, shard(q), shard(d)), want, **TOL)


# Validation.


@pytest.mark.parametrize(
    ("x_shape", "y_shape", "match"),
    [
        ((4, 3), (4, 5), "same embedding dim"),
        ((4, 3), (6, 3), "multiple of len"),
        ((4,), (4, 3), "2-D"),
    ],
)
def test_contrastive_rejects_bad_shapes(x_shape, y_shape, match):
    with pytest.raises(ValueError, match=match):
        contrastive_loss(jnp.ones(x_shape), jnp.ones(y_shape))


def test_clip_and_sigmoid_reject_unpaired_rows():
    x, y = jnp.ones((4, 3)), jnp.ones((8, 3))
    with pytest.raises(ValueError, match="same number of rows"):
        clip_loss(x, y, 0.0)
    with pytest.raises(ValueError, match="same number of rows"):
        sigmoid_loss(x, y, 0.0, 0.0)


@pytest.mark.parametrize("case", list(CASES))
def test_rejects_bad_reduction(case):
    loss, _, _, scalars = CASES[case]
    with pytest.raises(ValueError, match=r"reduction must be one of .*got 'avg'"):
        loss(jnp.ones((2, 3)), jnp.ones((2, 3)), *scalars, reduction="avg")


@pytest.mark.parametrize(
    ("block_size", "error", "match"),
    [
        (0, ValueError, "block_size must be a positive int, got 0"),
        (-4, ValueError, "block_size must be a positive int, got -4"),
        (2.0, TypeError, r"block_size must be a positive int, got 2.0 \(float\)"),
        (True, TypeError, r"block_size must be a positive int, got True \(bool\)"),
        ("8", TypeError, r"block_size must be a positive int, got '8' \(str\)"),
    ],
)
@pytest.mark.parametrize("case", list(CASES))
def test_rejects_bad_block_size(case, block_size, error, match):
    loss, _, _, scalars = CASES[case]
    with pytest.raises(error, match=match):
        loss(jnp.ones((2, 3)), jnp.ones((2, 3)), *scalars, block_size=block_size)


# Memory: lowered and compiled from shapes only, never run.

BIG, DIM = 65_536, 128
MiB = 2**20


def _temp_bytes(fn, rows, num_scalars):
    emb = jax.ShapeDtypeStruct((rows, DIM), jnp.float32)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    grad = jax.value_and_grad(fn, argnums=tuple(range(2 + num_scalars)))
    compiled = jax.jit(grad).lower(emb, emb, *[scalar] * num_scalars).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_contrastive_memory_at_65536_rows():
    blockwise = _temp_bytes(lambda x, y: contrastive_loss(x, y, block_size=1024), BIG, 0)
    dense = _temp_bytes(lambda x, y: contrastive_loss(x, y), BIG, 0)
    assert blockwise <= 256 * MiB, f"blockwise temp memory {blockwise / MiB:.0f} MiB"
    assert dense >= BIG * BIG * 4, f"dense temp memory {dense / MiB:.0f} MiB"  # the logits


@pytest.mark.parametrize(
    "loss",
    [
        lambda x, y, s, **kw: clip_loss(x, y, s, **kw),
        lambda x, y, s, b, **kw: sigmoid_loss(x, y, s, b, **kw),
    ],
    ids=["clip", "sigmoid"],
)
def test_blockwise_clip_and_sigmoid_memory(loss):
    num_scalars = loss.__code__.co_argcount - 2
    blockwise = _temp_bytes(functools.partial(loss, block_size=1024), BIG, num_scalars)
    dense = _temp_bytes(loss, BIG, num_scalars)
    assert blockwise <= 256 * MiB, f"blockwise temp memory {blockwise / MiB:.0f} MiB"
    assert dense >= BIG * BIG * 4, f"dense temp memory {dense / MiB:.0f} MiB"
