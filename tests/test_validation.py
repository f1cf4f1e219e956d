"""Misuse raises at trace time, with a message that names the problem."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import gc_jax
from gc_jax import _validation
from gc_jax.losses import contrastive_loss

D = 4
W = {"w": jnp.eye(D)}


def encode(p, x, key):
    return jnp.tanh(x @ p["w"])


def encode_tree(p, x, key):
    return jnp.tanh(x["a"] @ p["w"] + x["b"] @ p["w"])


def loss(p, q, d):
    return contrastive_loss(q, d)


def rows(n):
    return jnp.arange(n * D, dtype=jnp.float32).reshape(n, D) / (n * D)


Q, DOC = rows(8), rows(8)


def traced(f, *args, **kwargs):
    """Runs ``f`` under jit: every error below is raised while tracing."""
    return jax.jit(lambda *a: f(*a, **kwargs))(*args)


# --- chunk_size -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk_size", "error", "match"),
    [
        (0, ValueError, "chunk_size must be a positive int, got 0"),
        (-3, ValueError, "chunk_size must be a positive int, got -3"),
        (2.0, TypeError, r"chunk_size must be a positive int, got 2\.0 \(float\)"),
        ("4", TypeError, r"chunk_size must be a positive int, got '4' \(str\)"),
        (None, TypeError, r"chunk_size must be a positive int, got None \(NoneType\)"),
        (True, TypeError, r"chunk_size must be a positive int, got True \(bool\)"),
        ((), ValueError, "chunk_size is an empty sequence"),
        ((4, 0), ValueError, r"chunk_size\[1\] must be a positive int, got 0"),
        ((4, 2.5), TypeError, r"chunk_size\[1\] must be a positive int"),
    ],
)
def test_bad_chunk_size(chunk_size, error, match):
    with pytest.raises(error, match=match):
        gc_jax.cached_value_and_grad(loss, encode, chunk_size)
    with pytest.raises(error, match=match):
        gc_jax.make_train_step(loss, encode, chunk_size)


def test_numpy_int_chunk_size_is_accepted():
    f = gc_jax.cached_value_and_grad(loss, encode, np.int64(3))
    value, _ = traced(f, W, Q, DOC)
    assert value.shape == ()


def test_per_input_chunk_sizes_of_wrong_length():
    f = gc_jax.cached_value_and_grad(loss, encode, (2, 2, 2))
    with pytest.raises(ValueError, match="chunk_size has 3 entries but 2 inputs were given"):
        traced(f, W, Q, DOC)


# --- encoders and inputs -------------------------------------------------------------


def test_number_of_encoders_does_not_match_inputs():
    f = gc_jax.cached_value_and_grad(loss, (encode, encode, encode), 2)
    with pytest.raises(ValueError, match="encoders has 3 entries but 2 inputs were given"):
        traced(f, W, Q, DOC)


def test_empty_encoders_and_non_callables():
    with pytest.raises(ValueError, match="encoders is an empty sequence"):
        gc_jax.cached_value_and_grad(loss, (), 2)
    with pytest.raises(TypeError, match=r"encoders\[1\] must be callable, got 3 \(int\)"):
        gc_jax.cached_value_and_grad(loss, (encode, 3), 2)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        gc_jax.cached_value_and_grad("loss", encode, 2)


def test_no_inputs():
    f = gc_jax.cached_value_and_grad(loss, encode, 2)
    with pytest.raises(ValueError, match="no inputs were given"):
        traced(f, W)


def test_leaves_with_different_leading_sizes_are_named():
    f = gc_jax.cached_value_and_grad(loss, encode_tree, 2)
    bad = {"a": rows(8), "b": rows(6)}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "leaves of inputs[0] have different leading (batch) sizes: "
            "inputs[0]['a']: 8, inputs[0]['b']: 6"
        ),
    ):
        traced(f, W, bad, {"a": rows(8), "b": rows(8)})


def test_empty_batch():
    f = gc_jax.cached_value_and_grad(loss, encode, 2)
    with pytest.raises(ValueError, match=r"inputs\[1\] is an empty batch \(leading size 0\)"):
        traced(f, W, Q, rows(0))


def test_input_without_leaves():
    f = gc_jax.cached_value_and_grad(loss, encode, 2)
    with pytest.raises(ValueError, match=r"inputs\[1\] has no array leaves"):
        traced(f, W, Q, {})


def test_non_array_leaves():
    f = gc_jax.cached_value_and_grad(loss, encode_tree, 2)
    with pytest.raises(TypeError, match=r"inputs\[0\]\['b'\] must be an array .* got str"):
        jax.eval_shape(lambda q: f(W, {"a": q, "b": "text"}, {"a": q, "b": q}), Q)
    with pytest.raises(ValueError, match=r"inputs\[0\] is a scalar"):
        traced(gc_jax.cached_value_and_grad(loss, encode, 2), W, jnp.float32(1.0), DOC)


def test_encoder_returning_a_different_number_of_rows():
    f = gc_jax.cached_value_and_grad(loss, lambda p, x, k: encode(p, x, k)[:1], 4)
    with pytest.raises(
        ValueError, match=r"encoder returned .*shape \(1, 4\) for a chunk of 4 rows"
    ):
        traced(f, W, Q, DOC)
    per_input = gc_jax.cached_value_and_grad(loss, (encode, lambda p, x, k: x.T @ x @ p["w"]), 8)
    with pytest.raises(ValueError, match=r"encoders\[1\] returned .*shape \(4, 4\)"):
        traced(per_input, W, Q, DOC)


def test_encoder_returning_no_arrays():
    f = gc_jax.cached_value_and_grad(loss, lambda p, x, k: None, 2)
    with pytest.raises(ValueError, match="encoder returned NoneType None with no array leaves"):
        traced(f, W, Q, DOC)
    f = gc_jax.cached_value_and_grad(loss, lambda p, x, k: jnp.sum(x @ p["w"]), 2)
    with pytest.raises(ValueError, match=r"shape \(\) for a chunk of 2 rows"):
        traced(f, W, Q, DOC)


# --- the loss ------------------------------------------------------------------------


def test_loss_returning_a_non_scalar_names_the_shape():
    per_row = lambda p, q, d: contrastive_loss(q, d, reduction="none")
    f = gc_jax.cached_value_and_grad(per_row, encode, 2)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar loss, got shape \(8,\)"):
        traced(f, W, Q, DOC)


def test_loss_returning_a_pair_without_has_aux():
    pair = lambda p, q, d: (loss(p, q, d), {"n": q.shape[0]})
    f = gc_jax.cached_value_and_grad(pair, encode, 2)
    with pytest.raises(
        TypeError, match=r"scalar array loss, got tuple .*did you mean has_aux=True"
    ):
        traced(f, W, Q, DOC)


def test_has_aux_with_a_loss_returning_no_pair():
    f = gc_jax.cached_value_and_grad(loss, encode, 2, has_aux=True)
    with pytest.raises(
        TypeError,
        match=r"has_aux=True, so it must return a pair \(loss, aux\); got an array of shape \(\)",
    ):
        traced(f, W, Q, DOC)
    triple = lambda p, q, d: (loss(p, q, d), 1, 2)
    f = gc_jax.cached_value_and_grad(triple, encode, 2, has_aux=True)
    with pytest.raises(TypeError, match="got a tuple of length 3"):
        traced(f, W, Q, DOC)


def test_integer_loss():
    f = gc_jax.cached_value_and_grad(lambda p, q, d: jnp.argmax(q @ d.T).sum(), encode, 2)
    with pytest.raises(TypeError, match="floating-point loss, got dtype int32"):
        traced(f, W, Q, DOC)


# --- axis_name -------------------------------------------------------------------------


def test_axis_name_not_bound():
    f = gc_jax.cached_value_and_grad(loss, encode, 2, axis_name="batch")
    with pytest.raises(ValueError, match=r"axis_name='batch' is not bound here.*pmap"):
        traced(f, W, Q, DOC)
    step = gc_jax.make_train_step(loss, encode, 2, optimizer=optax.sgd(0.1), axis_name="batch")
    with pytest.raises(ValueError, match=r"axis_name='batch' is not bound here"):
        traced(step, (W, optax.sgd(0.1).init(W)), Q, DOC)


# --- make_train_step -----------------------------------------------------------------


def test_train_step_state_forms():
    tx = optax.sgd(0.1)
    ts = TrainState.create(apply_fn=None, params=W, tx=tx)
    with pytest.raises(
        TypeError,
        match=r"TrainState \(optimizer=None\); to train a \(params, opt_state\) tuple",
    ):
        traced(gc_jax.make_train_step(loss, encode, 2), (W, tx.init(W)), Q, DOC)
    with pytest.raises(TypeError, match="got a TrainState but optimizer= was given"):
        traced(gc_jax.make_train_step(loss, encode, 2, optimizer=tx), ts, Q, DOC)
    with pytest.raises(TypeError, match=r"a tuple \(params, opt_state\) .*got dict"):
        traced(gc_jax.make_train_step(loss, encode, 2, optimizer=tx), W, Q, DOC)
    dynamic = gc_jax.make_train_step(loss, encode, 2, optimizer=tx, loss_scale="dynamic")
    with pytest.raises(TypeError, match=r"\(params, opt_state, DynamicLossScale\)"):
        traced(dynamic, (W, tx.init(W)), Q, DOC)
    with pytest.raises(TypeError, match="third element of the state must be a"):
        traced(dynamic, (W, tx.init(W), 1024.0), Q, DOC)
    with pytest.raises(TypeError, match="needs the scale in the state"):
        traced(gc_jax.make_train_step(loss, encode, 2, loss_scale="dynamic"), ts, Q, DOC)


def test_train_step_options():
    with pytest.raises(TypeError, match=r"optimizer must be an optax\.GradientTransformation"):
        gc_jax.make_train_step(loss, encode, 2, optimizer=lambda g: g)
    with pytest.raises(ValueError, match="loss_scale must be None, a positive number or"):
        gc_jax.make_train_step(loss, encode, 2, loss_scale="auto")
    with pytest.raises(ValueError, match="finite positive number, got 0"):
        gc_jax.make_train_step(loss, encode, 2, loss_scale=0)
    with pytest.raises(TypeError, match="loss_scale must be None"):
        gc_jax.make_train_step(loss, encode, 2, loss_scale=True)
    with pytest.raises(ValueError, match="needs skip_nonfinite=True"):
        gc_jax.make_train_step(loss, encode, 2, loss_scale="dynamic", skip_nonfinite=False)
    with pytest.raises(ValueError, match="growth_interval must be a positive int"):
        gc_jax.make_train_step(loss, encode, 2, growth_interval=0)
    for bad in (1, "raise"):
        with pytest.raises(ValueError, match="check_finite must be False, True, 'debug'"):
            gc_jax.make_train_step(loss, encode, 2, check_finite=bad)


@pytest.mark.parametrize(
    ("rng", "error", "match"),
    [
        (
            0,
            TypeError,
            r"rng must be a JAX random key .* got an array of shape \(\) and dtype int32",
        ),
        (jnp.zeros(2), TypeError, r"got an array of shape \(2,\) and dtype float32"),
        (jax.random.split(jax.random.key(0)), ValueError, r"a key array of shape \(2,\)"),
    ],
)
def test_train_step_bad_rng(rng, error, match):
    tx = optax.sgd(0.1)
    step = gc_jax.make_train_step(loss, encode, 2, optimizer=tx)
    with pytest.raises(error, match=match):
        jax.jit(step)((W, tx.init(W)), Q, DOC, rng=rng)


def test_rng_key_accepts_typed_and_raw_keys():
    _validation.rng_key(None)
    _validation.rng_key(jax.random.key(0))
    _validation.rng_key(jax.random.PRNGKey(0))
