"""gc_jax.compat.functional: cached, cat_inputs and gather_inputs against full-batch grads."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gc_jax.compat.functional import cached, cat_inputs, gather_inputs
from gc_jax.losses import contrastive_loss

DIN, DOUT, N_DEV = 5, 4, 8
TOL = dict(atol=2e-5, rtol=2e-5)


def init(seed: int = 0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (DIN, 8)) / 2,
        "w2": jax.random.normal(k2, (8, DOUT)) / 2,
    }


def encode(params, chunk, key):
    """An MLP with dropout when given a key; chunk is {"x": [rows, DIN], "scale": [rows]}."""
    h = jnp.tanh(chunk["x"] @ params["w1"]) * chunk["scale"][:, None]
    if key is not None:
        h = h * jax.random.bernoulli(key, 0.5, h.shape) * 2.0
    return h @ params["w2"]


def batch(seed: int, rows: int):
    kx, ks = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (rows, DIN)), "scale": jax.random.uniform(ks, (rows,)) + 0.5}


def rows(tree, start, stop):
    return jax.tree.map(lambda x: x[start:stop], tree)


def require_8_devices():
    assert jax.device_count() >= N_DEV, (
        f"needs {N_DEV} devices, found {jax.device_count()}: "
        "export XLA_FLAGS=--xla_force_host_platform_device_count=8 before starting Python"
    )


@pytest.mark.parametrize("with_key", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_cached_matches_vjp(with_key, jit):
    params, chunk = init(), batch(1, 6)
    key = jax.random.key(3) if with_key else None
    f = cached(encode)
    if jit:
        f = jax.jit(f)  # backward is a Partial: it can leave jit as a pytree
    reps, backward = f(params, chunk, key)
    rep_grad = jax.random.normal(jax.random.key(9), reps.shape)
    ref_reps, vjp = jax.vjp(lambda p: encode(p, chunk, key), params)
    chex.assert_trees_all_close(reps, ref_reps, **TOL)
    chex.assert_trees_all_close(backward(rep_grad), vjp(rep_grad)[0], **TOL)
    chex.assert_trees_all_close(
        jax.jit(lambda b, g: b(g))(backward, rep_grad), vjp(rep_grad)[0], **TOL
    )


def test_cached_integer_outputs_and_params_get_no_gradient():
    """As in every other form (the same passes): ids pass through, integer params get float0."""
    params = {**init(), "n": jnp.array(2, jnp.int32)}

    def with_ids(p, c, key):
        reps = encode(p, c, key) * p["n"]
        return {"emb": reps, "ids": jnp.argmax(reps, axis=1)}

    chunk, key = batch(2, 6), jax.random.key(4)
    reps, backward = jax.jit(cached(with_ids))(params, chunk, key)
    ref, vjp = jax.vjp(lambda p: with_ids(p, chunk, key), params)
    chex.assert_trees_all_close(reps, ref, **TOL)
    g = jax.random.normal(jax.random.key(5), reps["emb"].shape)
    got = backward({"emb": g, "ids": jnp.zeros_like(reps["ids"])})
    want = vjp({"emb": g, "ids": np.zeros(reps["ids"].shape, jax.dtypes.float0)})[0]
    chex.assert_trees_all_close(
        {k: got[k] for k in ("w1", "w2")}, {k: want[k] for k in ("w1", "w2")}, **TOL
    )
    assert got["n"].dtype == want["n"].dtype == jax.dtypes.float0


def test_forward_keeps_no_activations(monkeypatch):
    """The first call never runs jax.vjp (pass 1 of gc_jax._passes); backward holds only inputs."""
    calls = {"encode": 0, "vjp": 0}
    vjp = jax.vjp

    def counting_encode(params, chunk, key):
        calls["encode"] += 1
        return encode(params, chunk, key)

    def counting_vjp(*args, **kwargs):
        calls["vjp"] += 1
        return vjp(*args, **kwargs)

    monkeypatch.setattr(jax, "vjp", counting_vjp)
    params, chunk, key = init(), batch(1, 4), jax.random.key(0)
    reps, backward = cached(counting_encode)(params, chunk, key)
    assert calls["encode"] >= 1 and calls["vjp"] == 0
    leaves, expected = jax.tree.leaves(backward), jax.tree.leaves((params, chunk, key))
    assert len(leaves) == len(expected)
    assert all(a is b for a, b in zip(leaves, expected, strict=True))
    backward(jnp.ones_like(reps))
    assert calls["vjp"] == 1
    # The forward's jaxpr has no linearization: nothing is saved for a backward pass.
    fwd = str(jax.make_jaxpr(lambda p, c: cached(encode)(p, c, None)[0])(params, chunk))
    assert "transpose" not in fwd and "jvp" not in fwd and "custom" not in fwd


def test_cat_inputs():
    seen = {}

    @cat_inputs
    def loss(x, pair, y=None, *, tree, weight):
        seen.update(x=x.shape, pair=type(pair), y=y.shape, tree=tree["a"].shape, weight=weight)
        return jnp.sum(x) + jnp.sum(y) + jnp.sum(tree["a"]) * weight

    ones = lambda n: jnp.ones((n, 2))
    out = loss(
        [ones(1), ones(3)], (ones(1), ones(1)), y=[ones(2)], tree=[{"a": ones(2)}, {"a": ones(5)}],
        weight=2.0,
    )  # fmt: skip
    assert seen == dict(x=(4, 2), pair=tuple, y=(2, 2), tree=(7, 2), weight=2.0)
    assert float(out) == 8 + 4 + 28
    assert loss.__name__ == "loss"
    with pytest.raises(ValueError, match="argument 0 is an empty list"):
        loss([], (), y=[ones(1)], tree=[{"a": ones(1)}], weight=1.0)
    with pytest.raises(ValueError, match="tree is an empty list"):
        loss([ones(1)], (), y=[ones(1)], tree=[], weight=1.0)


def accumulate(params, log_t, qs, ds, loss_fn, key=None):
    """The original's loop: cache reps and closures per sub-batch, one loss, then backwards."""
    enc = cached(encode)
    cache_q, cache_d, closures = [], [], []
    for i, (q, d) in enumerate(zip(qs, ds, strict=True)):
        kq, kd = (None, None) if key is None else jax.random.split(jax.random.fold_in(key, i))
        (rq, cq), (rd, cd) = enc(params, q, kq), enc(params, d, kd)
        cache_q.append(rq), cache_d.append(rd), closures.append((cq, cd))
    loss, (g_t, g_q, g_d) = jax.value_and_grad(loss_fn, (0, 1, 2))(log_t, cache_q, cache_d)
    grads = jax.tree.map(jnp.zeros_like, params)
    for (cq, cd), gq, gd in zip(closures, g_q, g_d, strict=True):
        grads = jax.tree.map(lambda a, b, c: a + b + c, grads, cq(gq), cd(gd))
    return loss, (grads, g_t)


def full_batch(log_t, q, d, keys=None):
    """Reference loss on the whole batch; keys[i] = (kq, kd) is sub-batch i's dropout keys."""

    def loss(params, log_t):
        if keys is None:
            rq, rd = encode(params, q, None), encode(params, d, None)
        else:
            n = len(keys)
            size = q["x"].shape[0] // n
            rq = jnp.concatenate(
                [
                    encode(params, rows(q, i * size, (i + 1) * size), k[0])
                    for i, k in enumerate(keys)
                ]
            )
            rd = jnp.concatenate(
                [
                    encode(params, rows(d, i * size, (i + 1) * size), k[1])
                    for i, k in enumerate(keys)
                ]
            )
        return contrastive_loss(rq, rd, temperature=jnp.exp(log_t))

    return jax.jit(jax.value_and_grad(loss, (0, 1)))(init(), log_t)


@pytest.mark.parametrize("num_sub", [1, 2, 4])
@pytest.mark.parametrize("dropout", [False, True])
def test_accumulation_loop_equals_full_batch(num_sub, dropout):
    q, d, log_t, size = batch(1, 8), batch(2, 8), jnp.float32(-0.5), 8 // num_sub
    key = jax.random.key(5) if dropout else None
    qs = [rows(q, i * size, (i + 1) * size) for i in range(num_sub)]
    ds = [rows(d, i * size, (i + 1) * size) for i in range(num_sub)]
    loss_fn = cat_inputs(lambda log_t, x, y: contrastive_loss(x, y, temperature=jnp.exp(log_t)))
    step = jax.jit(lambda p, t, qs, ds, k: accumulate(p, t, qs, ds, loss_fn, k))
    out = step(init(), log_t, qs, ds, key)
    keys = None
    if dropout:
        keys = [jax.random.split(jax.random.fold_in(key, i)) for i in range(num_sub)]
    chex.assert_trees_all_close(out, full_batch(log_t, q, d, keys), **TOL)


def _global_loss_fn():
    @cat_inputs
    @gather_inputs("d")
    def loss(log_t, x, y):
        return contrastive_loss(x, y, temperature=jnp.exp(log_t))

    return loss


def _per_device_step(params, log_t, q, d, varying):
    """Two sub-batches per device, global loss via gather_inputs, one psum of gradients."""
    if varying:  # shard_map: keep per-device gradients local until the explicit psum
        params, log_t = jax.tree.map(lambda x: jax.lax.pcast(x, "d", to="varying"), (params, log_t))
    half = q["x"].shape[0] // 2
    qs = [rows(q, 0, half), rows(q, half, 2 * half)]
    ds = [rows(d, 0, half), rows(d, half, 2 * half)]
    loss, grads = accumulate(params, log_t, qs, ds, _global_loss_fn())
    return loss[None], jax.lax.psum(grads, "d")


@pytest.mark.parametrize("transform", ["shard_map", "pmap"])
def test_gather_inputs_gives_the_global_gradient(transform):
    require_8_devices()
    rows_per_device = 4
    q, d = batch(1, N_DEV * rows_per_device), batch(2, N_DEV * rows_per_device)
    params, log_t = init(), jnp.float32(0.3)
    if transform == "shard_map":
        mesh = jax.make_mesh((N_DEV,), ("d",))
        shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))
        step = jax.shard_map(
            lambda p, t, q, d: _per_device_step(p, t, q, d, varying=True),
            mesh=mesh, in_specs=(P(), P(), P("d"), P("d")), out_specs=(P("d"), P()),
        )  # fmt: skip
        losses, grads = jax.jit(step)(params, log_t, shard(q), shard(d))
    else:
        per_device = lambda x: x.reshape(N_DEV, rows_per_device, *x.shape[1:])
        step = jax.pmap(
            lambda p, t, q, d: _per_device_step(p, t, q, d, varying=False),
            axis_name="d", in_axes=(None, None, 0, 0), devices=jax.devices()[:N_DEV],
        )  # fmt: skip
        losses, grads = step(
            params, log_t, jax.tree.map(per_device, q), jax.tree.map(per_device, d)
        )
        grads = jax.tree.map(lambda g: g[0], grads)
    ref_loss, ref_grads = full_batch(log_t, q, d)
    # Every device computes the global loss; the summed gradients are the global gradient.
    chex.assert_trees_all_close(losses.reshape(-1), jnp.full(N_DEV, ref_loss), **TOL)
    chex.assert_trees_all_close(grads, ref_grads, **TOL)


def test_gather_inputs_selects_arguments_and_keeps_aux():
    require_8_devices()
    mesh = jax.make_mesh((N_DEV,), ("d",))
    shapes = {}

    def record(name):
        def loss(x, y, w, *, z):
            shapes[name] = (x.shape, y.shape, jnp.shape(w), z.shape)
            return jnp.sum(x) * w + jnp.sum(y) + jnp.sum(z), {"w": w}

        return loss

    variants = {
        "all": gather_inputs("d", has_aux=True)(record("all")),
        "argnums": gather_inputs("d", argnums=(1,), has_aux=True)(record("argnums")),
        "argnames": gather_inputs("d", argnames=("z",), has_aux=True)(record("argnames")),
    }

    def per_device(x):
        out = {}
        for name, fn in variants.items():
            (loss, aux), g = jax.value_and_grad(fn, has_aux=True)(x, x, jnp.float32(2.0), z=x)
            out[name] = (loss[None], g, aux["w"][None])
        return out

    x = jax.device_put(jnp.arange(16.0).reshape(16, 1), NamedSharding(mesh, P("d")))
    out = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
    local, full = (2, 1), (16, 1)
    assert shapes == {
        "all": (full, full, (), full),
        "argnums": (local, full, (), local),
        "argnames": (local, local, (), full),
    }
    # Gathered arguments: each device's input gradient is its rows of the global
    # gradient; local arguments keep their own (local) gradient, scaled by 1 / D.
    loss_all, grad_all, aux = out["all"]
    chex.assert_trees_all_close(aux, jnp.full(N_DEV, 2.0))
    chex.assert_trees_all_close(loss_all, jnp.full(N_DEV, 2 * 120.0 + 120.0 + 120.0))
    chex.assert_trees_all_close(grad_all, jnp.full((16, 1), 2.0))
    chex.assert_trees_all_close(out["argnums"][1], jnp.full((16, 1), 2.0 / N_DEV))


def test_gather_inputs_errors():
    loss = gather_inputs("batch")(lambda x: jnp.sum(x))
    with pytest.raises(ValueError, match=r"axis_name='batch' is not bound"):
        loss(jnp.ones(3))
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        gather_inputs("d")(3)
    with pytest.raises(TypeError, match="encode must be callable"):
        cached(None)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        cat_inputs("loss")
