"""Non-finite values are caught and reported; float32 caching stays accurate."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.experimental import checkify
from toy import D_IN, D_OUT, ENCODERS, doc_tower, init_params, loss_fn

import gc_jax
from gc_jax.losses import contrastive_loss


def data(seed=1, rows=8):
    kq, kd = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kq, (rows, D_IN)), jax.random.normal(kd, (rows, D_IN))


def fresh_state(form, tx):
    if form == "train_state":
        return TrainState.create(apply_fn=None, params=init_params(), tx=tx)
    return (init_params(), tx.init(init_params()))


# --- non-finite steps are skipped ----------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("form", ["train_state", "tuple"])
def test_nonfinite_input_skips_the_step(form, bad):
    tx = optax.adamw(1e-2)
    optimizer = None if form == "train_state" else tx
    step = jax.jit(gc_jax.make_train_step(loss_fn, ENCODERS, 3, optimizer=optimizer))
    q, d = data()
    state, _ = step(fresh_state(form, tx), q, d)  # one good step: non-trivial opt state

    with pytest.warns(RuntimeWarning, match="make_train_step skipped this step"):
        new, metrics = step(state, q.at[5, 2].set(bad), d)
        jax.effects_barrier()
    assert not bool(metrics["is_finite"])
    if np.isnan(bad):
        assert np.isnan(float(metrics["loss"]))
    else:  # tanh(inf) = 1: a finite loss, but inf * 0 = nan in the gradient
        assert np.isfinite(float(metrics["loss"])) and np.isnan(float(metrics["grad_norm"]))
    chex.assert_trees_all_equal(new, state)  # params, optimizer state (and step) unchanged

    again, metrics = step(new, q, d)  # and training goes on from there
    assert bool(metrics["is_finite"])
    if form == "train_state":
        assert int(again.step) == 2


def test_without_skipping_the_nonfinite_update_is_applied_and_reported():
    tx = optax.sgd(0.1)
    step = gc_jax.make_train_step(loss_fn, ENCODERS, 3, optimizer=tx, skip_nonfinite=False)
    q, d = data()
    (params, _), metrics = jax.jit(step)(fresh_state("tuple", tx), q.at[0, 0].set(np.nan), d)
    assert not bool(metrics["is_finite"])
    assert not np.all(np.isfinite(np.asarray(params["w1"])))


def f16_query_tower(p, x, key):
    # 300 * x overflows float16 in the first layer's output (max 65504).
    h = (300.0 * x.astype(jnp.float16)) @ (300.0 * p["w1"].astype(jnp.float16))
    return jnp.tanh(h) @ p["w2"].astype(jnp.float16) + h[:, :D_OUT]


def test_float16_forward_overflow_is_reported_and_skipped():
    tx = optax.adam(1e-3)
    step = gc_jax.make_train_step(
        loss_fn, (f16_query_tower, doc_tower), 4, optimizer=tx, loss_scale="dynamic"
    )
    state = (*fresh_state("tuple", tx), gc_jax.DynamicLossScale.create())
    with pytest.warns(RuntimeWarning, match="the loss is nan"):
        new, metrics = jax.jit(step)(state, *data())
        jax.effects_barrier()
    assert not bool(metrics["is_finite"])
    assert not np.isfinite(float(metrics["loss"]))
    chex.assert_trees_all_equal(new[:2], state[:2])
    assert float(new[2].scale) == 2.0**14


# --- the opt-in check names the loss or the gradients --------------------------------


def sqrt_tower(p, x, key):
    # Finite values, but an infinite derivative at 0: rows of zeros give non-finite grads.
    return jnp.sqrt(jnp.abs(x @ p["w1"])) @ p["w2"]


def test_check_finite_names_a_nonfinite_loss():
    tx = optax.sgd(0.1)
    step = jax.jit(gc_jax.make_train_step(loss_fn, ENCODERS, 3, optimizer=tx, check_finite=True))
    q, d = data()
    state, metrics = step(fresh_state("tuple", tx), q, d)  # finite: no error
    assert bool(metrics["is_finite"])
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"non-finite values: the loss is nan"):
        jax.block_until_ready(step(state, q.at[1, 1].set(np.nan), d))


def test_check_finite_names_the_nonfinite_gradients():
    tx = optax.sgd(0.1)
    step = gc_jax.make_train_step(loss_fn, (sqrt_tower, doc_tower), 3, optimizer=tx)
    checked = gc_jax.make_train_step(
        loss_fn, (sqrt_tower, doc_tower), 3, optimizer=tx, check_finite="debug"
    )
    q, d = data()
    q = q.at[2].set(0.0)
    with pytest.warns(RuntimeWarning, match=r"but gradients are not: grads\['w1'\]"):
        _, metrics = jax.jit(step)(fresh_state("tuple", tx), q, d)
        jax.effects_barrier()
    assert np.isfinite(float(metrics["loss"])) and not bool(metrics["is_finite"])
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"loss is finite \(.*\) but gradients are not: grads\['w1'\] \(\d+ of 96 entries\)",
    ) as info:
        jax.block_until_ready(jax.jit(checked)(fresh_state("tuple", tx), q, d))
    assert "grads['doc']" not in str(info.value)


def test_check_finite_with_checkify():
    tx = optax.sgd(0.1)
    step = gc_jax.make_train_step(
        loss_fn, (sqrt_tower, doc_tower), 3, optimizer=tx, check_finite="checkify"
    )
    q, d = data()
    checked = jax.jit(checkify.checkify(step))
    err, (state, metrics) = checked(fresh_state("tuple", tx), q, d)
    err.throw()  # all finite: nothing raised
    assert bool(metrics["is_finite"])
    err, _ = checked(state, q.at[2].set(0.0), d)
    with pytest.raises(checkify.JaxRuntimeError, match=r"grads\['w1'\]: [1-9]"):
        err.throw()
    err, _ = checked(state, q.at[0, 0].set(np.nan), d)
    with pytest.raises(checkify.JaxRuntimeError, match=r"loss = nan"):
        err.throw()
    with pytest.raises(Exception, match="checkify"):  # must be functionalized
        jax.jit(step)(state, q, d)


def test_check_finite_with_dynamic_scale_tolerates_overflow_until_the_minimum():
    tx = optax.sgd(0.1)
    step = gc_jax.make_train_step(
        loss_fn, (sqrt_tower, doc_tower), 3, optimizer=tx, loss_scale="dynamic", check_finite=True
    )
    step = jax.jit(step)
    q, d = data()
    q = q.at[2].set(0.0)
    params, opt_state = fresh_state("tuple", tx)
    # Above the minimum scale, non-finite gradients are taken for overflow: back off.
    state, metrics = step((params, opt_state, gc_jax.DynamicLossScale.create(4.0)), q, d)
    assert not bool(metrics["is_finite"]) and float(state[2].scale) == 2.0
    state, _ = step(state, q, d)
    assert float(state[2].scale) == 1.0
    # At the minimum they cannot be overflow any more: the check raises.
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"gradients are not: grads\['w1'\]"):
        jax.block_until_ready(step(state, q, d))


# --- float32 caching against a float64 reference -------------------------------------


def normed_tower(p, x, key):
    h = jnp.tanh(x @ p["w1"]) @ p["w2"]
    return h / jnp.linalg.norm(h, axis=1, keepdims=True)


def normed_doc(p, x, key):
    h = jnp.tanh(x @ p["doc"])
    return h / jnp.linalg.norm(h, axis=1, keepdims=True)


def sharp_loss(p, q, d):  # temperature 0.01 at init, still a trained parameter
    return contrastive_loss(q, d, temperature=0.01 * jnp.exp(p["log_temp"] + 0.5))


def test_float32_cached_gradients_match_float64_at_large_batch_and_low_temperature():
    q, d = data(rows=1024)  # float32, made outside the x64 context
    params = init_params()
    with jax.enable_x64(True):

        def full(p, q, d):
            return sharp_loss(p, normed_tower(p, q, None), normed_doc(p, d, None))

        cached = gc_jax.cached_value_and_grad(sharp_loss, (normed_tower, normed_doc), 128)
        loss32, grads32 = jax.jit(cached)(params, q, d)
        full32 = jax.jit(jax.value_and_grad(full))(params, q, d)
        to64 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float64), t)
        loss64, grads64 = jax.jit(jax.value_and_grad(full))(to64(params), to64(q), to64(d))

    assert loss32.dtype == jnp.float32 and grads64["w1"].dtype == jnp.float64
    assert float(loss64) > 10.0  # logits of up to +-100: a very sharp softmax
    np.testing.assert_allclose(float(loss32), float(loss64), rtol=1e-5)
    for name in grads64:
        want = np.asarray(grads64[name])
        scale = np.max(np.abs(want))
        err_cached = np.max(np.abs(np.asarray(grads32[name], np.float64) - want)) / scale
        err_full = np.max(np.abs(np.asarray(full32[1][name], np.float64) - want)) / scale
        assert err_cached < 1e-5, (name, err_cached)
        # Caching costs no accuracy against plain float32 full-batch differentiation.
        assert err_cached < 4 * err_full + 1e-6, (name, err_cached, err_full)


def bf16(tower):
    """The tower computing in bfloat16 over float32 parameters (bfloat16 output)."""

    def run(p, x, key):
        return tower(jax.tree.map(lambda v: v.astype(jnp.bfloat16), p), x.astype(jnp.bfloat16), key)

    return run


def test_bfloat16_path_matches_float64_as_well_as_full_batch_bfloat16_does():
    """bf16 encoders, bf16 cache and cotangent, the blockwise loss's float32 tiles."""
    q, d = data(rows=256)
    params = init_params()

    def loss(p, q, d):
        return contrastive_loss(
            q, d, temperature=0.05 * jnp.exp(p["log_temp"] + 0.5), block_size=64
        )

    towers = (bf16(normed_tower), bf16(normed_doc))
    cached = jax.jit(gc_jax.cached_value_and_grad(loss, towers, 32))(params, q, d)
    full = lambda p, q, d: loss(p, towers[0](p, q, None), towers[1](p, d, None))
    full_bf16 = jax.jit(jax.value_and_grad(full))(params, q, d)
    with jax.enable_x64(True):
        to64 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float64), t)
        ref = lambda p, q, d: loss(p, normed_tower(p, q, None), normed_doc(p, d, None))
        loss64, grads64 = jax.jit(jax.value_and_grad(ref))(to64(params), to64(q), to64(d))
    assert cached[0].dtype == jnp.float32
    np.testing.assert_allclose(float(cached[0]), float(loss64), rtol=2e-2)
    for name in grads64:
        want = np.asarray(grads64[name])
        scale = np.max(np.abs(want))
        err_cached, err_full = (
            np.max(np.abs(np.asarray(g[name], np.float64) - want)) / scale
            for g in (cached[1], full_bf16[1])
        )
        assert err_cached < 5e-2, (name, err_cached)
        # Caching in bfloat16 costs no accuracy against bfloat16 full-batch training.
        assert err_cached < 2 * err_full + 1e-3, (name, err_cached, err_full)
