"""chunked_encoder inside users' own differentiation, against the same program unchunked."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_distributed import while_bodies
from toy import batch, doc_tower, init_params, loss_fn, query_tower

import gc_jax

TOL = {"rtol": 2e-5, "atol": 2e-6}


def plain(encode, chunk_size):
    """The unchunked reference: chunk ``c`` gets ``fold_in(key, c)``, all in one graph."""

    def encode_batch(params, x, key=None):
        if key is None:
            return encode(params, x, None)
        rows = jax.tree.leaves(x)[0].shape[0]
        parts = [
            encode(
                params,
                jax.tree.map(lambda v, s=s: v[s : s + chunk_size], x),
                jax.random.fold_in(key, c),
            )
            for c, s in enumerate(range(0, rows, chunk_size))
        ]
        return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)

    return encode_batch


def two_tower_loss(make):
    """``loss(params, q, d, key)`` with ``make(encoder)`` wrapping each tower."""
    q_enc, d_enc = make(query_tower), make(doc_tower)

    def loss(params, q, d, key=None):
        kq = None if key is None else jax.random.fold_in(key, 0)
        return loss_fn(params, q_enc(params, q, kq), d_enc(params, d, None))

    return loss


def compare(make_loss, chunk_size, *args, argnums=0, **tol):
    cached = make_loss(lambda e: gc_jax.chunked_encoder(e, chunk_size))
    full = make_loss(lambda e: plain(e, chunk_size))
    got = jax.jit(jax.value_and_grad(cached, argnums))(*args)
    want = jax.jit(jax.value_and_grad(full, argnums))(*args)
    chex.assert_trees_all_close(got, want, **(tol or TOL))
    return got


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 12, 100])
def test_matches_full_batch(chunk_size):
    compare(two_tower_loss, chunk_size, init_params(), *batch(12, 1))


@pytest.mark.parametrize("chunk_size", [2, 5])
def test_dropout_is_replayed(chunk_size):
    _, grads = compare(two_tower_loss, chunk_size, init_params(), *batch(11, 2), jax.random.key(3))
    assert jnp.abs(grads["w1"]).max() > 0


@pytest.mark.parametrize("k", [2, 4])
def test_hard_negatives(k):
    compare(two_tower_loss, 3, init_params(), *batch(7, 3, k=k))


def test_tied_use_sums_both_calls():
    def make_loss(make):
        enc = make(query_tower)  # one wrapped encoder for queries and passages
        return lambda p, q, d: loss_fn(p, enc(p, q, None), enc(p, d, None))

    _, grads = compare(make_loss, 4, init_params(), *batch(9, 4))
    assert jnp.abs(grads["doc"]).max() == 0.0


def test_gradient_with_respect_to_float_batch_leaves():
    """Soft prompts / input embeddings: the batch's float leaves get their gradient."""

    def make_loss(make):
        enc = make(lambda p, x, key: query_tower(p, x["emb"] * x["scale"][:, None], key))
        return lambda p, x, d: loss_fn(p, enc(p, x, None), doc_tower(p, d, None))

    q, d = batch(10, 5)
    x = {"emb": q, "scale": jnp.linspace(0.5, 1.5, 10)}
    (_, (_, gx)) = compare(make_loss, 3, init_params(), x, d, argnums=(0, 1))
    assert jnp.abs(gx["emb"]).max() > 0 and jnp.abs(gx["scale"]).max() > 0


def test_integer_side_outputs_pass_through():
    """Ids next to embeddings, used by the loss to mask duplicates: no allow_int error."""

    def tower(p, x, key):
        return {"emb": query_tower(p, x["x"], key), "id": x["id"], "ok": x["id"] >= 0}

    def make_loss(make):
        enc = make(tower)

        def loss(p, q, d):
            rq, rd = enc(p, q, None), enc(p, d, None)
            same = (rq["id"][:, None] == rd["id"][None, :]) & ~jnp.eye(len(rq["id"]), dtype=bool)
            logits = rq["emb"] @ rd["emb"].T - 1e4 * same
            return (
                optax.losses.softmax_cross_entropy_with_integer_labels(
                    logits, jnp.arange(len(logits))
                ).mean()
                + 0.0 * rd["ok"].sum()
            )

        return loss

    xq, xd = batch(8, 6)
    ids = jnp.array([0, 1, 1, 2, 3, 3, 4, 5], jnp.int32)
    compare(make_loss, 3, init_params(), {"x": xq, "id": ids}, {"x": xd[:, :6], "id": ids})


@pytest.mark.parametrize("chunk_size", [3, 4])
def test_encoder_closing_over_the_differentiated_params(chunk_size):
    """``lambda _, x, key: f(w, x)`` built inside ``loss(w)``: exact, with dropout too."""

    def make_loss(make):
        def loss(params, q, d, key):
            q_enc = make(lambda _, x, k: query_tower(params, x, k))
            d_enc = make(lambda _, x, k: doc_tower(params, x, k))
            return loss_fn(params, q_enc(None, q, key), d_enc(None, d, None))

        return loss

    _, grads = compare(make_loss, chunk_size, init_params(), *batch(11, 4), jax.random.key(5))
    assert all(jnp.abs(g).max() > 0 for g in jax.tree.leaves(grads))


def test_encoder_closing_over_values_staged_by_jit_only():
    """Closed-over values that are not differentiated stay closed over (no extra gradient)."""

    def make_loss(make):
        def loss(params, q, d, frozen):
            q_enc = make(lambda p, x, k: query_tower({**p, "w1": frozen}, x, k))
            return loss_fn(params, q_enc(params, q, None), doc_tower(params, d, None))

        return loss

    params = init_params()
    compare(make_loss, 3, params, *batch(9, 6), params["w1"] * 2)


def test_forward_alone_equals_the_encoder():
    enc = gc_jax.chunked_encoder(query_tower, 3)
    q, _ = batch(10, 7)
    got = jax.jit(enc)(init_params(), q, jax.random.key(1))
    want = plain(query_tower, 3)(init_params(), q, jax.random.key(1))
    chex.assert_trees_all_close(got, want, **TOL)


def test_policy_keeps_the_gradient():
    cached = two_tower_loss(
        lambda e: gc_jax.chunked_encoder(e, 3, policy=jax.checkpoint_policies.nothing_saveable)
    )
    full = two_tower_loss(lambda e: plain(e, 3))
    args = (init_params(), *batch(10, 8), jax.random.key(2))
    chex.assert_trees_all_close(
        jax.jit(jax.value_and_grad(cached))(*args), jax.jit(jax.value_and_grad(full))(*args), **TOL
    )


def test_five_optax_steps_match_full_batch_training():
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-2))

    def trainer(make):
        loss = two_tower_loss(make)

        @jax.jit
        def step(params, opt_state, q, d, key):
            value, grads = jax.value_and_grad(loss)(params, q, d, key)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        params = init_params()
        state, losses = optimizer.init(params), []
        for i in range(5):
            params, state, value = step(params, state, *batch(12, 10 + i), jax.random.key(i))
            losses.append(value)
        return params, losses

    got = trainer(lambda e: gc_jax.chunked_encoder(e, 5))
    want = trainer(lambda e: plain(e, 5))
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)
    assert got[1][-1] < got[1][0]


class Tower(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(6, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.tanh(self.dense(x)))


def test_inside_nnx_jit_and_nnx_grad():
    """The NNX form: wrap gc_jax.nnx_encoder of the traced model inside the loss."""

    def trainer(make):
        model = Tower(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, q, d, key):
            def loss(model):
                enc = make(gc_jax.nnx_encoder(model))
                no_dropout = make(gc_jax.nnx_encoder(nnx.view(model, deterministic=True)))
                params = nnx.state(model, nnx.Param)
                reps = enc(params, q, key), no_dropout(params, d, None)  # documents: no dropout
                return gc_jax.losses.contrastive_loss(*reps)

            value, grads = nnx.value_and_grad(loss)(model)
            optimizer.update(model, grads)
            return value

        losses = [step(model, optimizer, *batch(8, 20 + i), jax.random.key(i)) for i in range(3)]
        return losses, nnx.state(model, nnx.Param)

    got = trainer(lambda e: gc_jax.chunked_encoder(e, 3))
    want = trainer(lambda e: plain(e, 3))
    chex.assert_trees_all_close(got, want, **TOL)
    assert got[0][2] < got[0][0]


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="chunk_size must be a positive int"):
        gc_jax.chunked_encoder(query_tower, 2.0)
    with pytest.raises(TypeError, match="encode must be callable"):
        gc_jax.chunked_encoder(None, 2)
    enc = gc_jax.chunked_encoder(lambda p, x, k: x[:1] @ p["w1"], 2)
    with pytest.raises(ValueError, match="one representation row per input row"):
        enc(init_params(), batch(6, 0)[0])
    with pytest.raises(TypeError, match="key must be a JAX random key"):
        gc_jax.chunked_encoder(query_tower, 2)(init_params(), batch(6, 0)[0], 3)
    with pytest.raises(ValueError, match="last chunk"):
        gc_jax.chunked_encoder(lambda p, x, k: jnp.zeros((x.shape[0], x.shape[0])), 4)(
            init_params(), np.zeros((6, 2))
        )


# ----------------------------------------------------------------- data parallelism

DEVICES = 8


def _distributed_loss(enc, axis_name):
    def loss(p, q, d):
        temp = jnp.exp(p["log_temp"])
        rq, rd = enc(p, q, None), enc(p, d, None)
        return gc_jax.losses.contrastive_loss(rq, rd, temperature=temp, axis_name=axis_name)

    return loss


def _global_reference():
    q, d = batch(DEVICES * 6, 30)
    full = _distributed_loss(plain(query_tower, 2), None)
    return (q, d), jax.jit(jax.value_and_grad(full))(init_params(), q, d)


def test_inside_shard_map_the_gradient_is_global():
    """Shared parameters get every device's gradient summed by JAX (no axis_name needed)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    (q, d), want = _global_reference()
    mesh = jax.make_mesh((DEVICES,), ("data",))
    loss = _distributed_loss(gc_jax.chunked_encoder(query_tower, 2), "data")
    step = jax.jit(
        jax.shard_map(
            jax.value_and_grad(loss),
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=(P(), P()),
        )
    )
    q, d = (jax.device_put(v, NamedSharding(mesh, P("data"))) for v in (q, d))
    got = step(init_params(), q, d)
    chex.assert_trees_all_close(got, want, **TOL)
    bodies = while_bodies(step.lower(init_params(), q, d).compile().as_text())
    assert bodies, "expected the chunk loops in the compiled step"
    assert all("all-reduce" not in b for b in bodies), "an all-reduce runs once per chunk"


def test_under_pmap_per_device_gradients_sum_to_the_global_one():
    """As for any JAX function under pmap: each device's gradient, reduced by the user."""
    (q, d), want = _global_reference()
    loss = _distributed_loss(gc_jax.chunked_encoder(query_tower, 2), "data")

    def step(p, q, d):
        value, grads = jax.value_and_grad(loss)(p, q, d)
        return value, jax.lax.psum(grads, "data")

    params = jax.tree.map(lambda v: jnp.broadcast_to(v, (DEVICES, *v.shape)), init_params())
    split = lambda v: v.reshape(DEVICES, -1, *v.shape[1:])
    value, grads = jax.pmap(step, axis_name="data")(params, split(q), split(d))
    chex.assert_trees_all_close((value[0], jax.tree.map(lambda g: g[0], grads)), want, **TOL)
