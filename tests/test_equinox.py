"""Equinox modules as encoders, with dropout replayed exactly (per-row keys)."""

import os
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import full_batch_value_and_grad

import gc_jax
from gc_jax.losses import contrastive_loss

eqx = pytest.importorskip("equinox")

TOL = {"rtol": 2e-5, "atol": 2e-6}


def loss(params, q, d):
    return contrastive_loss(q, d, temperature=0.5)


def inputs(rows=6, k=2):
    kq, kd = jax.random.split(jax.random.key(7))
    return jax.random.normal(kq, (rows, 6)), jax.random.normal(kd, (rows * k, 6))


def as_dict(x):
    return {"tokens": x, "scale": 1.0 + jnp.arange(x.shape[0], dtype=x.dtype)[:, None] % 3}


class Tower(eqx.Module):
    """One example at a time, as ``eqx.nn`` layers are: two hidden layers of 32."""

    layers: list
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = [eqx.nn.Linear(6, 32, key=k1), eqx.nn.Linear(32, 32, key=k2),
                       eqx.nn.Linear(32, 8, key=k3)]  # fmt: skip
        self.dropout = eqx.nn.Dropout(0.3)

    def __call__(self, tokens, scale=1.0, *, key=None):
        keys = [None, None] if key is None else list(jax.random.split(key))
        h = tokens * scale
        for layer, k in zip(self.layers[:2], keys, strict=True):
            h = self.dropout(jax.nn.gelu(layer(h)), key=k)
        return self.layers[2](h)


class NoKeyTower(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __call__(self, x):
        return self.dropout(self.linear(x))


def tower():
    return Tower(jax.random.key(0))


def compare(encode, params, chunk_size, q, d, rng):
    got = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size))(params, q, d, rng=rng)
    want = full_batch_value_and_grad(loss, encode, chunk_size, params, q, d, rng=rng)
    chex.assert_trees_all_close(got, want, **TOL)
    return got


def test_per_row_model_with_dict_inputs_and_dropout_matches_full_batch():
    model = tower()
    encode, params = gc_jax.equinox_encoder(model)
    q, d = (as_dict(x) for x in inputs())
    cached = jax.jit(gc_jax.cached_value_and_grad(loss, encode, 4))
    value, grads = cached(params, q, d, rng=jax.random.key(1))
    want = full_batch_value_and_grad(loss, encode, 4, params, q, d, rng=jax.random.key(1))
    chex.assert_trees_all_close((value, grads), want, **TOL)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    other_key, _ = cached(params, q, d, rng=jax.random.key(2))
    assert not jnp.allclose(value, other_key), "dropout must follow the key"
    # Without a key: inference mode, the model's own deterministic output.
    plain = jax.vmap(eqx.nn.inference_mode(model))(**q)
    chex.assert_trees_all_close(encode(params, q, None), plain, rtol=1e-5)


def test_rows_of_a_chunk_get_their_own_keys():
    encode, params = gc_jax.equinox_encoder(tower())
    same_rows, key = jnp.ones((4, 6)), jax.random.key(0)
    out = encode(params, same_rows, key)
    assert not jnp.allclose(out[0], out[1]), "each row must draw its own dropout mask"
    chex.assert_trees_all_close(out, encode(params, same_rows, key))  # replayed exactly
    row_keys = jax.random.split(key, 4)
    chex.assert_trees_all_close(out[2], tower()(same_rows[2], key=row_keys[2]), rtol=1e-5)


class BatchedTower(eqx.Module):
    """A model written for a whole chunk (``vmap=False``): one key for the chunk."""

    tower: Tower

    def __call__(self, x, *, key=None):
        keys = None if key is None else jax.random.split(key, x.shape[0])
        return jax.vmap(lambda row, k: self.tower(row, key=k))(x, keys)


def test_whole_chunk_model_in_chunked_encoder_matches_full_batch():
    encode, params = gc_jax.equinox_encoder(BatchedTower(tower()), vmap=False)
    encode_batch = gc_jax.chunked_encoder(encode, 4)
    q, d = inputs()
    rng = jax.random.key(3)

    def my_loss(p, q, d, rng):  # gc_jax's keys: fold_in(rng, i) for input i
        keys = [jax.random.fold_in(rng, i) for i in range(2)]
        return loss(p, encode_batch(p, q, keys[0]), encode_batch(p, d, keys[1]))

    got = jax.jit(jax.value_and_grad(my_loss))(params, q, d, rng)
    want = full_batch_value_and_grad(loss, encode, 4, params, q, d, rng=rng)
    chex.assert_trees_all_close(got, want, **TOL)


def test_make_train_step_optax_loop_matches_full_batch():
    model = tower()
    encode, params = gc_jax.equinox_encoder(model)
    tx = optax.adamw(1e-2)
    step = jax.jit(gc_jax.make_train_step(loss, encode, 4, optimizer=tx))
    full = jax.jit(gc_jax.testing.full_batch_value_and_grad(loss, encode, 4))
    state, want, want_opt = (params, tx.init(params)), params, tx.init(params)
    for i in range(3):
        q, d = (as_dict(x + i) for x in inputs())
        rng = jax.random.key(10 + i)
        state, metrics = step(state, q, d, rng=rng)
        value, grads = full(want, q, d, rng=rng)
        updates, want_opt = tx.update(grads, want_opt, want)
        want = optax.apply_updates(want, updates)
        chex.assert_trees_all_close(metrics["loss"], value, rtol=1e-5)
    chex.assert_trees_all_close(state[0], want, rtol=1e-4, atol=1e-5)
    # The trained model (documented recipe) gives the encoder's outputs.
    trained = eqx.combine(state[0], eqx.partition(model, eqx.is_inexact_array)[1])
    q, _ = (as_dict(x) for x in inputs())
    trained = eqx.nn.inference_mode(trained)
    chex.assert_trees_all_close(jax.vmap(trained)(**q), encode(state[0], q, None), rtol=1e-6)


def test_sharded_jit_on_eight_devices_matches_the_documented_keys():
    """Device ``s``'s rows of chunk ``c`` of input ``i`` get
    ``fold_in(fold_in(fold_in(rng, i), c), s)``, split over the rows."""
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    mesh = jax.make_mesh((8,), ("data",))  # explicit axes (JAX 0.12's default)
    encode, params = gc_jax.equinox_encoder(tower())
    q, d = inputs(rows=32, k=1)
    rng, shards, rows, chunk = jax.random.key(5), 8, 4, 2
    placed = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, d)]
    got = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk))(params, *placed, rng=rng)

    def reps(p, x, i):  # chunk by chunk, the shards side by side (vmap)
        x = x.reshape(shards, rows, -1)
        key = lambda c, s: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, i), c), s)
        one = lambda c: lambda x, s: encode(p, x, key(c, s))
        parts = [jax.vmap(one(c))(x[:, c * chunk : (c + 1) * chunk], jnp.arange(shards))
                 for c in range(rows // chunk)]  # fmt: skip
        return jnp.concatenate(parts, axis=1).reshape(shards * rows, -1)

    want = jax.jit(jax.value_and_grad(lambda p: loss(p, reps(p, q, 0), reps(p, d, 1))))(params)
    chex.assert_trees_all_close(got, want, **TOL)


def test_dropout_without_a_key_argument_is_named():
    model = NoKeyTower(eqx.nn.Linear(6, 8, key=jax.random.key(0)), eqx.nn.Dropout(0.3))
    with pytest.raises(ValueError, match=r"eqx.nn.Dropout in training mode \(model.dropout\).*"
                       r"NoKeyTower.__call__ takes no `key`.*\*, key=None"):  # fmt: skip
        gc_jax.equinox_encoder(model)
    # In inference mode it has no dropout to key: accepted.
    encode, params = gc_jax.equinox_encoder(eqx.nn.inference_mode(model))
    assert encode(params, jnp.ones((3, 6)), jax.random.key(0)).shape == (3, 8)


def test_bad_models_and_get_rep_are_named():
    with pytest.raises(TypeError, match=r"model must be a callable equinox.Module, got <function"):
        gc_jax.equinox_encoder(lambda x: x)
    with pytest.raises(ValueError, match=r"no arrays to differentiate"):
        gc_jax.equinox_encoder(eqx.nn.Lambda(jnp.tanh))
    encode, params = gc_jax.equinox_encoder(tower(), get_rep=lambda out: out.tolist)
    q, d = inputs()
    with pytest.raises(TypeError, match=r"equinox_encoder\(Tower\): get_rep returned .*not an "
                       r"array.*model's output is \(\d+, 8\)"):  # fmt: skip
        jax.eval_shape(gc_jax.cached_value_and_grad(loss, encode, 4), params, q, d)


def test_importing_gc_jax_does_not_import_equinox():
    code = "import sys, gc_jax; print('equinox' in sys.modules)"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True, cwd=Path(__file__).parents[1])  # fmt: skip
    assert out.stdout.strip() == "False"


def test_equinox_vmap_false_on_a_per_example_model_hints_vmap():
    x = jnp.arange(32.0).reshape(8, 4) / 32
    model = eqx.nn.MLP(4, 2, width_size=8, depth=1, key=jax.random.key(0))
    encode, params = gc_jax.equinox_encoder(model, vmap=False)
    with pytest.raises(TypeError, match=r"dot_general(.|\n)*vmap=False calls the model once on "
                       r"the whole chunk.*leave vmap=True"):  # fmt: skip
        encode(params, x, None)
    encode, params = gc_jax.equinox_encoder(model)
    assert encode(params, x, None).shape == (8, 2)


def test_equinox_state_is_named_unsupported():

    class Normed(eqx.Module):
        linear: eqx.nn.Linear
        norm: eqx.nn.BatchNorm

        def __init__(self):
            self.linear = eqx.nn.Linear(4, 2, key=jax.random.key(0))
            self.norm = eqx.nn.BatchNorm(2, "batch", mode="batch")

        def __call__(self, x, state, *, key=None):
            return self.norm(self.linear(x), state)

    match = r"uses an eqx.nn.State \(model.norm, model\(\.\.\., state\)\).*not supported"
    with pytest.raises(ValueError, match=match):
        gc_jax.equinox_encoder(Normed())
    seq = eqx.nn.Sequential(
        [eqx.nn.Linear(4, 2, key=jax.random.key(0)), eqx.nn.BatchNorm(2, "b", mode="batch")]
    )
    with pytest.raises(ValueError, match=r"eqx.nn.State \(model.layers\[1\]\).*not supported"):
        gc_jax.equinox_encoder(seq)
