"""Round 4 of "no unclear error" (issue 34, items 5-10): each mistake is named, with the fix.

Second order through a token budget or packing, a key passed positionally, an
encoder without the key argument, an NNX model in place of its state, NNX dropout
with no key, and the Keras and Equinox adapters' own mistakes.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import gc_jax
from gc_jax import packing

TOL = {"rtol": 2e-5, "atol": 2e-6}


def loss_fn(params, q, d):
    return gc_jax.losses.contrastive_loss(q, d, temperature=0.5)


def texts(seed: int, rows: int = 8, padded: int = 16) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    lengths = jax.random.randint(k1, (rows, 1), 2, padded + 1)
    mask = (jnp.arange(padded) < lengths).astype(jnp.int32)
    ids = jax.random.randint(k2, (rows, padded), 1, 50) * mask
    return {"input_ids": ids, "attention_mask": mask}


def mean_encode(params, batch, key):  # per row: works with a TokenBudget
    mask = batch["attention_mask"][..., None]
    h = jnp.tanh(params["embed"][batch["input_ids"]] @ params["w"])
    return (h * mask).sum(1) / mask.sum(1)


def packed_encode(params, batch, key):  # reads the packing keys: works with a TokenPacking
    return packing.mean_pool(jnp.tanh(params["embed"][batch["input_ids"]] @ params["w"]), batch)


PARAMS = {"embed": jax.random.normal(jax.random.key(0), (50, 4)), "w": jnp.eye(4) / 2}
BY_TOKENS = {
    "budget": (mean_encode, gc_jax.TokenBudget(tokens=32, buckets=(8, 16))),
    "packing": (packed_encode, gc_jax.TokenPacking(tokens=32, segments=4)),
}


def grads_sum(grad_fn):
    """A scalar of the gradients: what a gradient of a gradient differentiates."""
    return lambda p: sum(jnp.sum(g) for g in jax.tree.leaves(grad_fn(p)[1]))


# --- 5. second order through a TokenBudget or TokenPacking -----------------------------


@pytest.mark.parametrize("kind", ["budget", "packing"])
def test_second_order_through_tokens_names_the_chunk_size(kind):
    encode, chunk_size = BY_TOKENS[kind]
    q, d = texts(1), texts(2)
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, encode, chunk_size)
    name = type(chunk_size).__name__
    match = rf"inputs\[0\] was differentiated twice.*{name}.*integer chunk_size"
    with pytest.raises(ValueError, match=match):  # a gradient of the gradients
        jax.jit(jax.grad(grads_sum(lambda p: grad_fn(p, q, d))))(PARAMS)
    with pytest.raises(ValueError, match=match):  # a gradient of the loss, outside jit
        jax.grad(lambda p: jax.jit(grad_fn)(p, q, d)[0])(PARAMS)


def test_a_meta_gradient_through_make_train_step_names_the_budget():
    encode, budget = BY_TOKENS["budget"]
    q, d = texts(1), texts(2)
    tx = optax.sgd(0.1)
    step = gc_jax.make_train_step(loss_fn, encode, budget, optimizer=tx)
    after = lambda p: step((p, tx.init(p)), q, d)[0][0]["w"].sum()
    with pytest.raises(ValueError, match=r"differentiated twice.*TokenBudget"):
        jax.jit(jax.grad(after))(PARAMS)


def test_forward_mode_over_a_budget_still_works():
    """Only reverse mode is refused: jax.jacfwd of the gradient is the integer chunk's."""
    encode, budget = BY_TOKENS["budget"]
    q, d = texts(1), texts(2)
    of = lambda size: jax.jit(
        jax.jacfwd(lambda w: gc_jax.cached_value_and_grad(loss_fn, encode, size)(
            {**PARAMS, "w": w}, q, d)[1]["w"])
    )(PARAMS["w"])  # fmt: skip
    chex.assert_trees_all_close(of(budget), of(3), **TOL)


def test_chunked_encoder_names_a_packing_too():
    encode, packed = BY_TOKENS["packing"]
    q = texts(1)
    enc = gc_jax.chunked_encoder(encode, packed)
    inner = jax.grad(lambda p: enc(p, q).sum())
    with pytest.raises(ValueError, match=r"chunked_encoder.*twice.*TokenPacking.*integer"):
        jax.jit(jax.grad(lambda p: inner(p)["w"].sum()))(PARAMS)


# --- 6. rng passed positionally ----------------------------------------------------------

X = jnp.arange(32.0).reshape(8, 4) / 32
linear = lambda w, x, key: x @ w


@pytest.mark.parametrize("key", [jax.random.key(0), jax.random.PRNGKey(0)], ids=["typed", "raw"])
def test_a_key_passed_positionally_names_rng(key):
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, linear, chunk_size=4)
    with pytest.raises(TypeError, match=r"inputs\[2\], is a JAX random key.*pass it as rng="):
        grad_fn(jnp.eye(4), X, X, key)
    step = gc_jax.make_train_step(loss_fn, linear, 4, optimizer=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"train_step\(state, queries, docs, rng=key\)"):
        step((jnp.eye(4), optax.sgd(0.1).init(jnp.eye(4))), X, X, key)
    gc = gc_jax.GradCache([nnx.Linear(4, 4, rngs=nnx.Rngs(0))] * 2, 4, loss_fn=lambda q, d: 0.0)
    with pytest.raises(TypeError, match=r"gc\(queries, docs, rng=key\)"):
        gc(X, X, key)


# --- 7. an encoder without the key argument ---------------------------------------------


def test_an_encoder_without_a_key_names_the_contract():
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, lambda w, x: x @ w, chunk_size=4)
    match = r"encode\(params, chunk, key\).*<lambda>\(w, x\).*third argument"
    with pytest.raises(TypeError, match=match):
        grad_fn(jnp.eye(4), X, X)
    with pytest.raises(TypeError, match=match):
        gc_jax.chunked_encoder(lambda w, x: x @ w, 4)(jnp.eye(4), X)


def test_a_type_error_inside_an_encoder_is_its_own():
    """An encoder that takes the key and fails inside keeps its own error."""

    def encode(w, x, key):
        raise TypeError("inside the model")

    with pytest.raises(TypeError, match=r"^inside the model"):
        gc_jax.cached_value_and_grad(loss_fn, encode, chunk_size=4)(jnp.eye(4), X, X)


# --- 8. an NNX model where its state belongs ---------------------------------------------


def test_an_nnx_model_as_params_names_nnx_state():
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, gc_jax.nnx_encoder(model), chunk_size=4)
    with pytest.raises(TypeError, match=r"got an nnx.Module \(Linear\) as params.*"
                       r"nnx.state\(model, nnx.Param\).*nnx.split"):  # fmt: skip
        grad_fn(model, X, X)
    other = nnx.state(nnx.Linear(4, 4, use_bias=False, rngs=nnx.Rngs(0)), nnx.Param)
    with pytest.raises(ValueError, match=r"params that do not match the model.*nnx.state"):
        grad_fn(other, X, X)
    grads = jax.jit(grad_fn)(nnx.state(model, nnx.Param), X, X)[1]
    assert isinstance(grads, nnx.State)


# --- 9. NNX dropout with no key ---------------------------------------------------------


class Dropped(nnx.Module):
    def __init__(self, rate: float = 0.5):
        self.dense = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.dropout = nnx.Dropout(rate, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.dropout(self.dense(x))


def test_nnx_dropout_without_a_key_raises_like_linen():
    model = Dropped()
    params = nnx.state(model, nnx.Param)
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, gc_jax.nnx_encoder(model), chunk_size=4)
    with pytest.raises(TypeError, match=r"model.dropout\) but got key=None.*rng=jax.random.key"
                       r".*nnx.view\(model, deterministic=True\)"):  # fmt: skip
        grad_fn(params, X, X)
    with pytest.raises(TypeError, match=r"dropout in training mode"):
        gc_jax.testing.assert_matches_full_batch(loss_fn, gc_jax.nnx_encoder(model), 4,
                                                 params, X, X)  # fmt: skip
    # With a key dropout is on; in eval mode (said explicitly) it is off.
    with_key, _ = grad_fn(params, X, X, rng=jax.random.key(0))
    plain = nnx.view(model, deterministic=True)
    off, _ = gc_jax.cached_value_and_grad(loss_fn, gc_jax.nnx_encoder(plain), 4)(params, X, X)
    chex.assert_trees_all_close(off, loss_fn(None, plain(X), plain(X)), **TOL)
    assert not jnp.allclose(with_key, off)
    model.eval()
    chex.assert_trees_all_close(gc_jax.nnx_encoder(model)(params, X, None), plain(X), **TOL)


def test_nnx_dropout_of_rate_zero_needs_no_key():
    model = Dropped(rate=0.0)
    out = gc_jax.nnx_encoder(model)(nnx.state(model, nnx.Param), X, None)
    chex.assert_trees_all_close(out, model.dense(X), **TOL)


# --- 10. the Keras and Equinox adapters ------------------------------------------------


def test_a_keras_dict_model_names_a_missing_key():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("Keras was imported with another backend")
    a, other = keras.Input((4,), name="a"), keras.Input((4,), name="other")
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([a, other]))
    encode, params = gc_jax.keras_encoder(keras.Model({"a": a, "other": other}, out))
    with pytest.raises(ValueError, match=r"keys \['a', 'other'\], but the batch has no "
                       r"\['other'\] \(its keys: \['a'\]\).*Add \['other'\]"):  # fmt: skip
        encode(params, {"a": X}, None)
    assert encode(params, {"a": X, "other": X}, None).shape == (8, 2)


def test_equinox_vmap_false_on_a_per_example_model_hints_vmap():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 2, width_size=8, depth=1, key=jax.random.key(0))
    encode, params = gc_jax.equinox_encoder(model, vmap=False)
    with pytest.raises(TypeError, match=r"dot_general(.|\n)*vmap=False calls the model once on "
                       r"the whole chunk.*leave vmap=True"):  # fmt: skip
        encode(params, X, None)
    encode, params = gc_jax.equinox_encoder(model)
    assert encode(params, X, None).shape == (8, 2)


def test_equinox_state_is_named_unsupported():
    eqx = pytest.importorskip("equinox")

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
