"""make_train_step against plain full-batch training with jax.value_and_grad."""

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from toy import D_IN, ENCODERS, doc_tower, init_params, loss_fn, query_tower

import gc_jax
from gc_jax.losses import contrastive_loss

STEPS = 5


infonce = loss_fn


def infonce_aux(p, q, d):
    scores = q @ d.T
    accuracy = jnp.mean(jnp.argmax(scores, axis=1) == jnp.arange(q.shape[0]))
    return infonce(p, q, d), {"accuracy": accuracy, "q_norm": jnp.linalg.norm(q)}


def batches(steps=STEPS, rows=12, seed=1):
    out = []
    for key in jax.random.split(jax.random.key(seed), steps):
        kq, kd = jax.random.split(key)
        out.append((jax.random.normal(kq, (rows, D_IN)), jax.random.normal(kd, (rows, D_IN))))
    return out


@functools.cache
def full_batch_grad(loss_fn=infonce, has_aux=False):
    def total(p, q, d):
        return loss_fn(p, query_tower(p, q, None), doc_tower(p, d, None))

    return jax.jit(jax.value_and_grad(total, has_aux=has_aux))


TXS = {
    "adamw": optax.adamw(3e-2, weight_decay=1e-2),
    "adamw_small": optax.adamw(1e-2),
    "sgd": optax.sgd(0.1),
}


@functools.cache
def reference_step(tx_name):
    tx = TXS[tx_name]

    @jax.jit
    def step(params, opt_state, q, d):
        loss, grads = full_batch_grad()(params, q, d)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def reference_training(tx_name, data):
    """Plain full-batch optax training: the params after the last step, and the losses."""
    params = init_params()
    opt_state = TXS[tx_name].init(params)
    losses = []
    for q, d in data:
        params, opt_state, loss = reference_step(tx_name)(params, opt_state, q, d)
        losses.append(loss)
    return params, jnp.stack(losses)


@pytest.mark.parametrize("form", ["train_state", "tuple"])
@pytest.mark.parametrize("chunk_size", [5, (4, 3), 12])
def test_adamw_loop_matches_full_batch(form, chunk_size):
    tx = TXS["adamw"]
    data = batches()
    want_params, want_losses = reference_training("adamw", data)

    if form == "train_state":
        state = TrainState.create(apply_fn=None, params=init_params(), tx=tx)
        step = gc_jax.make_train_step(infonce, ENCODERS, chunk_size)
    else:
        state = (init_params(), tx.init(init_params()))
        step = gc_jax.make_train_step(infonce, ENCODERS, chunk_size, optimizer=tx)
    step = jax.jit(step)
    losses = []
    for q, d in data:
        state, metrics = step(state, q, d)
        assert bool(metrics["is_finite"])
        losses.append(metrics["loss"])
    params = state.params if form == "train_state" else state[0]
    if form == "train_state":
        assert int(state.step) == STEPS
    chex.assert_trees_all_close(jnp.stack(losses), want_losses, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(params, want_params, rtol=1e-4, atol=1e-5)


def test_metrics_match_full_batch():
    tx = optax.sgd(0.1)
    q, d = batches(1)[0]
    step = jax.jit(gc_jax.make_train_step(infonce, ENCODERS, 5, optimizer=tx))
    (params, _), metrics = step((init_params(), tx.init(init_params())), q, d)
    loss, grads = full_batch_grad()(init_params(), q, d)
    assert set(metrics) == {"loss", "grad_norm", "is_finite"}
    chex.assert_trees_all_close(metrics["loss"], loss, rtol=1e-6)
    chex.assert_trees_all_close(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-5)
    chex.assert_trees_all_close(
        params, jax.tree.map(lambda p, g: p - 0.1 * g, init_params(), grads), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("form", ["train_state", "tuple"])
def test_jit_with_donated_state(form):
    tx = optax.adamw(1e-2)
    data = batches(3)

    def fresh():
        if form == "train_state":
            return TrainState.create(apply_fn=None, params=init_params(), tx=tx)
        return (init_params(), tx.init(init_params()))

    optimizer = None if form == "train_state" else tx
    make = lambda: gc_jax.make_train_step(infonce, ENCODERS, 5, optimizer=optimizer)
    donated, plain = jax.jit(make(), donate_argnums=0), jax.jit(make())
    s1, s2 = fresh(), fresh()
    with warnings.catch_warnings():  # a backend without donation support only warns
        warnings.filterwarnings("ignore", message=".*donated.*")
        for q, d in data:
            s1, m1 = donated(s1, q, d)
            s2, m2 = plain(s2, q, d)
    chex.assert_trees_all_equal(s1, s2)
    chex.assert_trees_all_equal(m1, m2)


@pytest.mark.parametrize("chunk_size", [2, 12])
def test_aux_metrics(chunk_size):
    tx = optax.sgd(0.1)
    q, d = batches(1)[0]
    state = TrainState.create(apply_fn=None, params=init_params(), tx=tx)
    step = gc_jax.make_train_step(infonce_aux, ENCODERS, chunk_size, has_aux=True)
    _, metrics = jax.jit(step)(state, q, d)
    (loss, aux), _ = full_batch_grad(infonce_aux, has_aux=True)(init_params(), q, d)
    assert set(metrics) == {"loss", "grad_norm", "is_finite", "aux"}
    chex.assert_trees_all_close(metrics["loss"], loss, rtol=1e-6)
    chex.assert_trees_all_close(metrics["aux"], aux, rtol=1e-5)


def test_dropout_rng_and_loss_kwargs():
    """rng reaches the encoders with gc_jax's per-chunk keys; loss kwargs reach the loss."""
    tx = optax.sgd(0.1)
    q, d = batches(1)[0]
    rng = jax.random.key(7)
    loss = lambda p, q, d, scale: contrastive_loss(q, d, temperature=jnp.exp(p["log_temp"]) * scale)
    step = jax.jit(gc_jax.make_train_step(loss, ENCODERS, 5, optimizer=tx))
    (params, _), metrics = step((init_params(), tx.init(init_params())), q, d, rng=rng, scale=2.0)

    def total(p):
        chunks = [(0, 5), (5, 10), (10, 12)]
        keys = [
            jax.random.fold_in(jax.random.fold_in(rng, i), c) for i in (0, 1) for c in (0, 1, 2)
        ]
        qr = jnp.concatenate([query_tower(p, q[a:b], keys[c]) for c, (a, b) in enumerate(chunks)])
        dr = jnp.concatenate([doc_tower(p, d[a:b], keys[3 + c]) for c, (a, b) in enumerate(chunks)])
        return loss(p, qr, dr, 2.0)

    want_loss, grads = jax.jit(jax.value_and_grad(total))(init_params())
    chex.assert_trees_all_close(metrics["loss"], want_loss, rtol=1e-6)
    chex.assert_trees_all_close(
        params, jax.tree.map(lambda p, g: p - 0.1 * g, init_params(), grads), rtol=1e-5, atol=1e-6
    )


# --- float16 and loss scaling -------------------------------------------------------


def query_tower_f16(p, x, key):
    h = jnp.tanh(x.astype(jnp.float16) @ p["w1"].astype(jnp.float16))
    return h @ p["w2"].astype(jnp.float16)


def doc_tower_f16(p, x, key):
    return jnp.tanh(x.astype(jnp.float16) @ p["doc"].astype(jnp.float16))


def test_float16_dynamic_loss_scale_matches_float32():
    tx = TXS["adamw_small"]
    data = batches(rows=16)
    want_params, want_losses = reference_training("adamw_small", data)
    step = gc_jax.make_train_step(
        infonce, (query_tower_f16, doc_tower_f16), 4, optimizer=tx, loss_scale="dynamic"
    )
    step = jax.jit(step, donate_argnums=0)
    state = (init_params(), tx.init(init_params()), gc_jax.DynamicLossScale.create())
    losses = []
    for q, d in data:
        state, metrics = step(state, q, d)
        assert bool(metrics["is_finite"]), metrics
        assert metrics["loss_scale"].dtype == jnp.float32
        losses.append(metrics["loss"])
    params, _, scale = state
    assert float(scale.scale) == 2.0**15 and int(scale.good_steps) == STEPS
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    chex.assert_trees_all_close(jnp.stack(losses), want_losses, rtol=1e-2, atol=1e-2)
    chex.assert_trees_all_close(params, want_params, atol=2e-2)


class ScaledTrainState(TrainState):
    loss_scale: gc_jax.DynamicLossScale = struct.field(default=None)


@pytest.mark.parametrize("form", ["tuple", "pair", "subclass"])
def test_overflow_step_is_skipped_and_scale_halves(form):
    tx = optax.adam(1e-2)
    q, d = batches(1, rows=16)[0]
    encoders = (query_tower_f16, doc_tower_f16)
    huge = gc_jax.DynamicLossScale(jnp.float32(2.0**40), jnp.int32(3))
    params = init_params()
    if form == "tuple":
        state = (params, tx.init(params), huge)
        step = gc_jax.make_train_step(infonce, encoders, 4, optimizer=tx, loss_scale="dynamic")
    else:
        ts = ScaledTrainState.create(apply_fn=None, params=params, tx=tx, loss_scale=huge)
        state = (ts, huge) if form == "pair" else ts
        step = gc_jax.make_train_step(infonce, encoders, 4, loss_scale="dynamic")
    step = jax.jit(step)

    new, metrics = step(state, q, d)
    assert not bool(metrics["is_finite"])
    assert np.isfinite(float(metrics["loss"]))  # the float32 loss is fine; the backward overflowed
    assert float(metrics["loss_scale"]) == 2.0**40
    if form == "tuple":
        trained, new_scale, old_trained = new[:2], new[2], state[:2]
    elif form == "pair":
        trained, new_scale, old_trained = new[0], new[1], state[0]
    else:
        trained, new_scale = new.replace(loss_scale=None), new.loss_scale
        old_trained = state.replace(loss_scale=None)
    chex.assert_trees_all_equal(trained, old_trained)  # params, opt state and step unchanged
    assert float(new_scale.scale) == 2.0**39 and int(new_scale.good_steps) == 0

    # Backing off until the float16 backward fits, then training resumes.
    for _ in range(40):
        new, metrics = step(new, q, d)
        if bool(metrics["is_finite"]):
            break
    assert bool(metrics["is_finite"]) and float(metrics["loss_scale"]) < 2.0**20


def test_dynamic_scale_grows_after_interval():
    tx = optax.sgd(1e-2)
    q, d = batches(1)[0]
    step = gc_jax.make_train_step(
        infonce, ENCODERS, 4, optimizer=tx, loss_scale="dynamic", growth_interval=2
    )
    step = jax.jit(step)
    state = (init_params(), tx.init(init_params()), gc_jax.DynamicLossScale.create(8.0))
    scales = []
    for _ in range(5):
        state, metrics = step(state, q, d)
        scales.append(float(metrics["loss_scale"]))
    assert scales == [8.0, 8.0, 16.0, 16.0, 32.0]
    assert int(state[2].good_steps) == 1


def test_dynamic_loss_scale_policy():
    s = gc_jax.DynamicLossScale.create(4.0)
    assert float(s.update(False).scale) == 2.0
    assert float(gc_jax.DynamicLossScale.create(1.0).update(False).scale) == 1.0  # floor
    s = s.update(True, growth_interval=3).update(True, growth_interval=3)
    assert (float(s.scale), int(s.good_steps)) == (4.0, 2)
    s = s.update(True, growth_interval=3)
    assert (float(s.scale), int(s.good_steps)) == (8.0, 0)
    s = s.update(True, growth_interval=3).update(False, growth_interval=3)
    assert (float(s.scale), int(s.good_steps)) == (4.0, 0)
    big = gc_jax.DynamicLossScale.create(float(jnp.finfo(jnp.float32).max))
    assert np.isfinite(float(big.update(True, growth_interval=1).scale))


@pytest.mark.parametrize("scale", [1.0, 1024.0])
def test_static_loss_scale_returns_unscaled_gradients(scale):
    tx = optax.sgd(0.1)
    q, d = batches(1)[0]
    step = jax.jit(gc_jax.make_train_step(infonce, ENCODERS, 5, optimizer=tx, loss_scale=scale))
    (params, _), metrics = step((init_params(), tx.init(init_params())), q, d)
    _, grads = full_batch_grad()(init_params(), q, d)
    assert float(metrics["loss_scale"]) == scale
    chex.assert_trees_all_close(
        params, jax.tree.map(lambda p, g: p - 0.1 * g, init_params(), grads), rtol=1e-5, atol=1e-6
    )


# --- data parallel ---------------------------------------------------------------------


def test_shard_map_data_parallel_matches_full_batch():
    assert jax.device_count() >= 8, (
        "this test needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
    mesh = jax.make_mesh((8,), ("data",))
    tx = TXS["adamw_small"]
    data = batches(3, rows=32)
    want_params, want_losses = reference_training("adamw_small", data)

    def loss(p, q, d):
        return contrastive_loss(q, d, temperature=jnp.exp(p["log_temp"]), axis_name="data")

    step = gc_jax.make_train_step(loss, ENCODERS, 3, optimizer=tx, axis_name="data")
    step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
    )
    state = (init_params(), tx.init(init_params()))
    losses = []
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
    for q, d in data:
        state, metrics = step(state, shard(q), shard(d))
        assert bool(metrics["is_finite"])
        losses.append(metrics["loss"])
    chex.assert_trees_all_close(jnp.stack(losses), want_losses, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state[0], want_params, rtol=1e-4, atol=1e-5)


def test_pmap_train_state_matches_full_batch():
    assert jax.device_count() >= 8, (
        "this test needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
    tx = TXS["adamw_small"]
    data = batches(2, rows=16)
    want_params, want_losses = reference_training("adamw_small", data)

    def loss(p, q, d):
        return contrastive_loss(q, d, temperature=jnp.exp(p["log_temp"]), axis_name="batch")

    step = gc_jax.make_train_step(loss, ENCODERS, 1, axis_name="batch")
    step = jax.pmap(step, axis_name="batch")
    state = TrainState.create(apply_fn=None, params=init_params(), tx=tx)
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (8, *jnp.shape(x))), state)
    per_device = lambda x: x.reshape(8, -1, *x.shape[1:])
    for (q, d), want_loss in zip(data, want_losses, strict=True):
        state, metrics = step(state, per_device(q), per_device(d))
        chex.assert_trees_all_close(metrics["loss"], jnp.full(8, want_loss), rtol=1e-5)
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x[0], state.params), want_params, rtol=1e-4, atol=1e-5
    )
    assert int(state.step[0]) == 2


# --- optimizers beyond a plain GradientTransformation --------------------------------


def reference_optax_training(tx, data, extra=False):
    """Full-batch training with ``tx``; ``extra`` passes value=, grad= and value_fn=."""

    @jax.jit
    def step(params, opt_state, q, d):
        loss, grads = full_batch_grad()(params, q, d)
        kwargs = {}
        if extra:
            total = lambda p: infonce(p, query_tower(p, q, None), doc_tower(p, d, None))
            kwargs = dict(value=loss, grad=grads, value_fn=total)
        updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, trajectory = init_params(), tx.init(init_params()), []
    for q, d in data:
        params, opt_state, loss = step(params, opt_state, q, d)
        trajectory.append((params, loss))
    return trajectory, opt_state


def run_training(step, state, data, params_of=lambda s: s[0]):
    trajectory = []
    for q, d in data:
        state, metrics = step(state, q, d)
        trajectory.append((params_of(state), metrics["loss"]))
    return trajectory, state


@pytest.mark.parametrize("form", ["multi_steps", "gradient_transformation"])
def test_multi_steps_accumulates_like_full_batch(form):
    multi = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    data = batches(4)
    want, _ = reference_optax_training(multi, data)
    tx = multi if form == "multi_steps" else multi.gradient_transformation()
    step = gc_jax.make_train_step(infonce, ENCODERS, 5, optimizer=tx)
    got, _ = run_training(jax.jit(step), (init_params(), tx.init(init_params())), data)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    # Accumulated on odd steps, applied on even ones.
    chex.assert_trees_all_equal(got[0][0], init_params())
    assert not np.allclose(got[1][0]["w1"], init_params()["w1"])


def test_reduce_on_plateau_gets_the_loss():
    tx = optax.chain(
        optax.sgd(0.5), optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0)
    )
    data = batches(5)
    want, want_opt_state = reference_optax_training(tx, data, extra=True)
    step = jax.jit(gc_jax.make_train_step(infonce, ENCODERS, 5, optimizer=tx))
    got, (_, opt_state) = run_training(step, (init_params(), tx.init(init_params())), data)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(opt_state, want_opt_state, rtol=1e-5, atol=1e-6)
    assert float(want_opt_state[1].scale) < 1.0, "the plateau logic should have engaged"


def test_lbfgs_line_search_uses_the_cached_loss():
    tx = optax.lbfgs()
    q, d = batches(1)[0]
    data = [(q, d)] * 3  # L-BFGS is for a fixed objective
    want, _ = reference_optax_training(tx, data, extra=True)
    state = TrainState.create(apply_fn=None, params=init_params(), tx=tx)
    step = jax.jit(gc_jax.make_train_step(infonce, ENCODERS, 6))  # 2 chunks per input
    got, _ = run_training(step, state, data, lambda s: s.params)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)
    assert float(got[-1][1]) < float(got[0][1])


# SAM and Sophia ask for other keywords than value=: sam's update takes only grad_fn=
# (opaque mode: the gradient at the adversarial params), Sophia's Hutchinson estimator
# needs obj_fn= (Hessian-vector products, jax.jvp of jax.grad(obj_fn)).
ADV = optax.chain(optax.contrib.normalize(), optax.sgd(0.05))
SAM_AND_SOPHIA = {
    "sam": (optax.contrib.sam(optax.sgd(0.1), ADV), ()),
    "sam_opaque": (
        optax.contrib.sam(optax.adam(1e-2), ADV, sync_period=3, opaque_mode=True),
        ("grad_fn",),
    ),
    "sophia": (optax.contrib.sophia(1e-2, update_interval=2), ("obj_fn",)),
    "chain_with_sam": (
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.contrib.sam(optax.sgd(0.1), ADV, opaque_mode=True),
        ),
        ("grad_fn",),
    ),
    "multi_steps_sam": (optax.MultiSteps(optax.contrib.sam(optax.sgd(0.1), ADV), 2), ()),
}


def reference_with(tx, data, keywords):
    """Full-batch optax training, passing only ``keywords`` of obj_fn= and grad_fn=."""

    @jax.jit
    def step(params, opt_state, q, d):
        total = lambda p: infonce(p, query_tower(p, q, None), doc_tower(p, d, None))
        loss, grads = jax.value_and_grad(total)(params)
        offered = {"obj_fn": total, "grad_fn": lambda p, i: jax.grad(total)(p)}
        kwargs = {k: offered[k] for k in keywords}
        updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, trajectory = init_params(), tx.init(init_params()), []
    for q, d in data:
        params, opt_state, loss = step(params, opt_state, q, d)
        trajectory.append((params, loss))
    return trajectory, opt_state


@pytest.mark.parametrize("name", list(SAM_AND_SOPHIA))
def test_sam_and_sophia_match_full_batch(name):
    tx, keywords = SAM_AND_SOPHIA[name]
    data = batches(4)
    want, want_opt_state = reference_with(tx, data, keywords)
    step = jax.jit(gc_jax.make_train_step(infonce, ENCODERS, 5, optimizer=tx))
    got, (_, opt_state) = run_training(step, (init_params(), tx.init(init_params())), data)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(opt_state, want_opt_state, rtol=1e-4, atol=1e-5)
    if name == "sophia":  # the Hessian diagonal was estimated, from the cached loss
        assert float(optax.tree.norm(opt_state[0].nu)) > 0


def test_sophia_train_state_with_dropout():
    """A TrainState and dropout: obj_fn replays the step's own dropout keys."""
    tx = optax.contrib.sophia(1e-2, update_interval=1)
    q, d = batches(1)[0]
    rng = jax.random.key(3)
    state = TrainState.create(apply_fn=None, params=init_params(), tx=tx)
    step = jax.jit(gc_jax.make_train_step(infonce, ENCODERS, 12))  # one chunk: full batch
    new, _ = step(state, q, d, rng=rng)

    def total(p):
        keys = [jax.random.fold_in(jax.random.fold_in(rng, i), 0) for i in (0, 1)]
        return infonce(p, query_tower(p, q, keys[0]), doc_tower(p, d, keys[1]))

    grads = jax.grad(total)(init_params())
    updates, opt_state = tx.update(grads, tx.init(init_params()), init_params(), obj_fn=total)
    want = optax.apply_updates(init_params(), updates)
    chex.assert_trees_all_close(new.params, want, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(new.opt_state, opt_state, rtol=1e-4, atol=1e-5)  # the Hessian


def test_sophia_under_shard_map_sees_the_global_hessian():
    """obj_fn is the global loss: every device's Hessian estimate is the full batch's."""
    assert jax.device_count() >= 8, (
        "this test needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.contrib.sophia(1e-2, update_interval=1)
    data = batches(2, rows=32)
    want, want_opt_state = reference_with(tx, data, ("obj_fn",))

    def loss(p, q, d):
        return contrastive_loss(q, d, temperature=jnp.exp(p["log_temp"]), axis_name="data")

    step = gc_jax.make_train_step(loss, ENCODERS, 3, optimizer=tx, axis_name="data")
    step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
    )
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
    state = (init_params(), tx.init(init_params()))
    for q, d in data:
        state, _ = step(state, shard(q), shard(d))
    chex.assert_trees_all_close(state, (want[-1][0], want_opt_state), rtol=1e-4, atol=1e-5)


def test_a_non_finite_adversarial_gradient_skips_the_step():
    """SAM's second gradient is checked too: the update it gives must be finite."""
    poison = optax.stateless(lambda u, p: jax.tree.map(lambda x: x * jnp.nan, u))
    tx = optax.contrib.sam(optax.sgd(0.1), poison, opaque_mode=True)
    q, d = batches(1)[0]
    state = (init_params(), tx.init(init_params()))
    step = jax.jit(gc_jax.make_train_step(infonce, ENCODERS, 5, optimizer=tx))
    with pytest.warns(RuntimeWarning, match=r"gradients are finite, but the optimizer's update"):
        new, metrics = step(state, q, d)
        jax.effects_barrier()
    assert np.isfinite(float(metrics["loss"])) and not bool(metrics["is_finite"])
    chex.assert_trees_all_equal(new, state)


def test_a_chain_member_rejecting_a_needed_keyword():
    """sam rejects value=, reduce_on_plateau needs it: the error says what to write."""
    sam = optax.contrib.sam(optax.sgd(0.1), ADV)
    tx = optax.chain(sam, optax.contrib.reduce_on_plateau())
    step = jax.jit(gc_jax.make_train_step(infonce, ENCODERS, 5, optimizer=tx))
    q, d = batches(1)[0]
    state = (init_params(), tx.init(init_params()))
    with pytest.raises(TypeError, match=r"(?s)missing.*'value'.*transparent_update_fn\(\) takes "
                       r"no value=.*Wrap the rejecting member"):  # fmt: skip
        step(state, q, d)
    # What it says to write works.
    quiet = optax.GradientTransformationExtraArgs(
        sam.init, lambda u, s, p=None, *, grad_fn=None, **_: sam.update(u, s, p, grad_fn=grad_fn)
    )
    tx = optax.chain(quiet, optax.contrib.reduce_on_plateau())
    step = jax.jit(gc_jax.make_train_step(infonce, ENCODERS, 5, optimizer=tx))
    _, metrics = step((init_params(), tx.init(init_params())), q, d)
    assert bool(metrics["is_finite"])


def test_sharded_jit_with_auto_axes_and_batch_axis():
    assert jax.device_count() >= 8, (
        "this test needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = TXS["adamw_small"]
    data = batches(3, rows=32)
    want_params, want_losses = reference_training("adamw_small", data)
    step = gc_jax.make_train_step(infonce, ENCODERS, 3, optimizer=tx, batch_axis="data")
    step = jax.jit(step)
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
    state, losses = (init_params(), tx.init(init_params())), []
    with jax.set_mesh(mesh):
        for q, d in data:
            state, metrics = step(state, shard(q), shard(d))
            losses.append(metrics["loss"])
        hlo = step.lower(state, shard(q), shard(d)).compile().as_text()
    chex.assert_trees_all_close(jnp.stack(losses), want_losses, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state[0], want_params, rtol=1e-4, atol=1e-5)
    # batch_axis reached the chunking: every device encodes its own rows.
    assert "collective-permute" not in hlo and "all-to-all" not in hlo


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(optimizer="adam"), TypeError, r"optimizer must be an optax.*got str: 'adam'"),
        (dict(optimizer=optax.adam), TypeError, "optimizer must be an optax"),
        (dict(loss_scale="static"), ValueError, "loss_scale must be"),
        (dict(loss_scale="dynamic", skip_nonfinite=False), ValueError, "skip_nonfinite=True"),
        (dict(check_finite="yes"), ValueError, "check_finite must be"),
    ],
)
def test_construction_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        gc_jax.make_train_step(infonce, ENCODERS, 5, **kwargs)
