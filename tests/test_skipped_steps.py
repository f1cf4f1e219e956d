"""A skipped (non-finite) step of ``make_train_step`` warns by default (jit, pmap, shard_map).

The warning comes from the host (a ``jax.debug.callback`` run only on a skipped step)
and names what was not finite; ``warn_skipped=False`` silences it; a dynamic loss
scale's expected overflows warn only at the minimum scale.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax.losses import contrastive_loss

SKIPPED = r"grads\['w'\] .* make_train_step skipped this step"


def encode(p, x, key):
    return jnp.tanh(x @ p["w"])


def loss_fn(p, q, d):
    return contrastive_loss(q, d, temperature=0.5)


def sharded_loss(p, q, d):
    return contrastive_loss(q, d, temperature=0.5, axis_name="data")


def batch(rows=8):
    q = jax.random.normal(jax.random.key(0), (rows, 4))
    return q, q[::-1] + 0.1


def bad_params():
    return {"w": jnp.eye(4).at[0, 0].set(jnp.nan)}


def run(step, state, *args):
    out = step(state, *args)
    jax.effects_barrier()  # the host callback has run
    return out


@pytest.mark.parametrize("form", ["pair", "train_state"])
def test_a_skipped_step_warns_and_keeps_the_state(form):
    params, opt = bad_params(), optax.sgd(0.1)
    if form == "pair":
        state = (params, opt.init(params))
        step = gc_jax.make_train_step(loss_fn, encode, 4, optimizer=opt)
    else:
        state = TrainState.create(apply_fn=None, params=params, tx=opt)
        step = gc_jax.make_train_step(loss_fn, encode, 4)
    with pytest.warns(RuntimeWarning, match=SKIPPED):
        new, metrics = run(jax.jit(step), state, *batch())
    assert not bool(metrics["is_finite"])
    chex.assert_trees_all_equal(jax.tree.leaves(new), jax.tree.leaves(state))


def test_a_finite_step_and_warn_skipped_false_are_quiet():
    params, opt = {"w": jnp.eye(4)}, optax.sgd(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = gc_jax.make_train_step(loss_fn, encode, 4, optimizer=opt)
        _, metrics = run(jax.jit(step), (params, opt.init(params)), *batch())
        assert bool(metrics["is_finite"])
        quiet = gc_jax.make_train_step(loss_fn, encode, 4, optimizer=opt, warn_skipped=False)
        _, metrics = run(jax.jit(quiet), (bad_params(), opt.init(params)), *batch())
        assert not bool(metrics["is_finite"])


def test_a_skipped_step_warns_under_pmap_and_shard_map():
    opt = optax.sgd(0.1)
    step = gc_jax.make_train_step(sharded_loss, encode, 2, optimizer=opt, axis_name="data")
    state = (bad_params(), opt.init(bad_params()))
    n = jax.device_count()
    q, d = batch(4 * n)
    replicated = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), state)
    split = lambda x: x.reshape(n, 4, -1)
    with pytest.warns(RuntimeWarning, match=SKIPPED):
        run(jax.pmap(step, axis_name="data"), replicated, split(q), split(d))
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                           out_specs=P())  # fmt: skip
    with pytest.warns(RuntimeWarning, match=SKIPPED):
        _, metrics = run(jax.jit(mapped), state, q, d)
    assert not bool(metrics["is_finite"])


def nan_gradient_encoder(p, x, key):
    """Finite outputs, NaN gradients (a norm differentiated at a zero row)."""
    h = x @ p["w"]
    return jnp.tanh(h) * jnp.linalg.norm(h, axis=-1, keepdims=True)


def test_dynamic_loss_scaling_warns_only_at_the_minimum_scale():
    """Non-finite gradients at a large scale are backed off from (expected); at scale 1
    they warn."""
    params, opt = {"w": jnp.eye(4)}, optax.sgd(0.1)
    q, d = batch()
    q = q.at[0].set(0.0)
    step = gc_jax.make_train_step(loss_fn, nan_gradient_encoder, 4, optimizer=opt,
                                  loss_scale="dynamic")  # fmt: skip
    state = lambda scale: (params, opt.init(params), gc_jax.DynamicLossScale.create(scale))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, metrics = run(jax.jit(step), state(2.0**15), q, d)
    assert not bool(metrics["is_finite"]) and bool(jnp.isfinite(metrics["loss"]))
    with pytest.warns(RuntimeWarning, match=r"the loss is finite .* grads\['w'\]"):
        run(jax.jit(step), state(1.0), q, d)
