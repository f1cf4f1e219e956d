"""Misuse raises at trace time, with a message that names the problem."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
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
    with pytest.raises(ValueError, match="chunk_size has 3 entries for 2 inputs"):
        traced(f, W, Q, DOC)


# --- encoders and inputs -------------------------------------------------------------


def test_number_of_encoders_does_not_match_inputs():
    f = gc_jax.cached_value_and_grad(loss, (encode, encode, encode), 2)
    with pytest.raises(ValueError, match="encoders has 3 entries for 2 inputs"):
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
    with pytest.raises(
        ValueError,
        match=r"loss_scale must be None, a finite positive number or .dynamic., got .auto.",
    ):
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


# --- the mistakes users make first (no silent wrong gradients) ------------------------

DEVICES = 8


def _mesh():
    return jax.make_mesh((DEVICES,), ("data",))


def _global_rows():
    return rows(2 * DEVICES), rows(2 * DEVICES)[::-1]


def _shard_mapped(f, check_vma=True):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()
    step = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=(P(), P()),
            check_vma=check_vma,
        )
    )
    q, d = (jax.device_put(v, NamedSharding(mesh, P("data"))) for v in _global_rows())
    return lambda: step(W, q, d)


def _gathering_loss(p, q, d):
    return contrastive_loss(q, d, axis_name="data")


@pytest.mark.parametrize("check_vma", [True, False])
def test_axis_name_only_in_the_core_is_an_error(check_vma):
    f = gc_jax.cached_value_and_grad(loss, encode, 1, axis_name="data")
    with pytest.raises(ValueError, match=r"axis_name='data' was given, but loss_fn communicates"):
        _shard_mapped(f, check_vma)()


@pytest.mark.parametrize("check_vma", [True, False])
def test_axis_name_only_in_the_loss_is_an_error(check_vma):
    f = gc_jax.cached_value_and_grad(_gathering_loss, encode, 1)
    with pytest.raises(ValueError, match=r"communicates over mesh axes \['data'\] but axis_name"):
        _shard_mapped(f, check_vma)()


def test_axis_name_in_neither_place_inside_shard_map_is_an_error():
    f = gc_jax.cached_value_and_grad(loss, encode, 1)
    with pytest.raises(ValueError, match=r"inputs vary over mesh axes \['data'\]"):
        _shard_mapped(f)()


def test_axis_name_in_neither_place_untyped_is_an_error():
    """pmap and shard_map(check_vma=False): no types say the batch is split; still caught."""
    f = gc_jax.cached_value_and_grad(loss, encode, 1)
    match = (
        r"inside pmap or shard_map\(check_vma=False\) over mesh axes \['data'\].*axis_name='data'"
    )
    with pytest.raises(ValueError, match=match):
        _shard_mapped(f, check_vma=False)()
    q, d = (v.reshape(DEVICES, 2, D) for v in _global_rows())
    params = jax.tree.map(lambda v: jnp.broadcast_to(v, (DEVICES, *v.shape)), W)
    with pytest.raises(ValueError, match=match):
        jax.pmap(f, axis_name="data")(params, q, d)
    step = gc_jax.make_train_step(loss, encode, 1, optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match=match):
        jax.pmap(step, axis_name="data")((params, jax.vmap(optax.sgd(0.1).init)(params)), q, d)


def test_replicated_batch_inside_typed_shard_map_needs_no_axis_name():
    """Every device holds the whole batch (a model-parallel axis): allowed, and exact."""
    from jax.sharding import PartitionSpec as P

    f = gc_jax.cached_value_and_grad(loss, encode, 2)
    step = jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=P(), out_specs=P()))
    got = step(W, Q, DOC)
    want = jax.value_and_grad(lambda p: loss(p, encode(p, Q, None), encode(p, DOC, None)))(W)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("core", "loss_fn"), [("data", loss), (None, _gathering_loss)])
def test_axis_name_mismatch_under_pmap(core, loss_fn):
    f = gc_jax.cached_value_and_grad(loss_fn, encode, 1, axis_name=core)
    q, d = (v.reshape(DEVICES, 2, D) for v in _global_rows())
    params = jax.tree.map(lambda v: jnp.broadcast_to(v, (DEVICES, *v.shape)), W)
    with pytest.raises(ValueError, match="axis_name"):
        jax.pmap(f, axis_name="data")(params, q, d)


def test_axis_name_in_both_places_is_exact():
    f = gc_jax.cached_value_and_grad(_gathering_loss, encode, 1, axis_name="data")
    got = _shard_mapped(f)()
    q, d = _global_rows()
    want = jax.value_and_grad(lambda p: loss(p, encode(p, q, None), encode(p, d, None)))(W)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1]["w"], want[1]["w"], rtol=1e-4, atol=1e-6)


def test_loss_keywords_that_the_step_owns():
    def loss_with_rng(p, q, d, rng=None):
        return loss(p, q, d)

    with pytest.raises(TypeError, match=r"loss_fn has a parameter named 'rng'.*loss_rng"):
        gc_jax.cached_value_and_grad(loss_with_rng, encode, 2)
    with pytest.raises(TypeError, match=r"parameter named 'loss_scale'"):
        gc_jax.cached_value_and_grad(lambda p, q, d, loss_scale=1: loss(p, q, d), encode, 2)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_non_positive_loss_scale(scale):
    f = gc_jax.cached_value_and_grad(loss, encode, 2)
    with pytest.raises(ValueError, match=r"loss_scale must be a finite positive number"):
        traced(f, W, Q, DOC, loss_scale=scale)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_traced_bad_loss_scale_cannot_pass_as_a_good_step(scale):
    """A traced scale is only known at run time: loss and gradients come out NaN."""
    f = jax.jit(gc_jax.cached_value_and_grad(loss, encode, 2))
    value, grads = f(W, Q, DOC, loss_scale=jnp.float32(scale))
    assert np.isnan(value) and np.all(np.isnan(grads["w"]))
    good_value, good_grads = f(W, Q, DOC, loss_scale=jnp.float32(8.0))
    ref_value, ref_grads = jax.value_and_grad(
        lambda p: loss(p, encode(p, Q, None), encode(p, DOC, None))
    )(W)
    np.testing.assert_allclose(good_value, ref_value, rtol=1e-6)
    np.testing.assert_allclose(good_grads["w"], ref_grads["w"], rtol=1e-5, atol=1e-6)


def test_traced_bad_loss_scale_is_a_skipped_step():
    """In a train step whose scale is traced (the dynamic scale), the step is skipped."""
    opt = optax.sgd(0.1)
    step = jax.jit(gc_jax.make_train_step(loss, encode, 2, optimizer=opt, loss_scale="dynamic"))
    scale = gc_jax.DynamicLossScale(jnp.float32(0.0), jnp.int32(0))
    with pytest.warns(RuntimeWarning, match="make_train_step skipped this step"):
        (params, _, _), metrics = step((W, opt.init(W), scale), Q, DOC)
        jax.effects_barrier()
    assert not metrics["is_finite"]
    np.testing.assert_array_equal(params["w"], W["w"])
    with pytest.raises(ValueError, match="loss_scale must be a finite positive number, got 0"):
        gc_jax.DynamicLossScale.create(0.0)


@pytest.mark.parametrize(
    ("dtype", "match"),
    [
        (jnp.int32, r"cache_dtype must be a real floating-point dtype .*got int32.*non-float"),
        (
            jnp.complex64,
            r"cache_dtype must be a real floating-point dtype .*got complex64.*complex",
        ),
        ("nope", r"cache_dtype must be a floating-point dtype .* got 'nope'"),
    ],
)
def test_cache_dtype_must_be_real_float(dtype, match):
    with pytest.raises(TypeError, match=match):
        gc_jax.cached_value_and_grad(loss, encode, 2, cache_dtype=dtype)
    with pytest.raises(TypeError, match=match):
        gc_jax.make_train_step(loss, encode, 2, cache_dtype=dtype)


def test_encoder_with_no_float_output():
    ids = lambda p, x, key: jnp.round(encode(p, x, key) * 10).astype(jnp.int32)
    f = gc_jax.cached_value_and_grad(loss, (encode, ids), 2)
    with pytest.raises(
        ValueError,
        match=r"encoders\[1\] returns no floating-point output for "
        r"inputs\[1\] \(dtypes \['int32'\]\), so there is nothing to differentiate",
    ):
        traced(f, W, Q, DOC)
    # Integer outputs next to a float one are fine (and get no gradient).
    with_ids = lambda p, x, key: (encode(p, x, key), ids(p, x, key))
    both = lambda p, q, d: loss(p, q[0], d[0]) + 0.0 * jnp.sum(d[1])
    value, grads = traced(gc_jax.cached_value_and_grad(both, with_ids, 2), W, Q, DOC)
    ref_value, ref_grads = jax.value_and_grad(
        lambda p: loss(p, encode(p, Q, None), encode(p, DOC, None))
    )(W)
    chex.assert_trees_all_close((value, grads), (ref_value, ref_grads), rtol=1e-5, atol=1e-6)


def test_raw_key_of_the_wrong_shape():
    f = gc_jax.cached_value_and_grad(loss, encode, 2)
    with pytest.raises(ValueError, match=r"raw uint32 key of shape \(5,\).*jax.random.key"):
        traced(f, W, Q, DOC, rng=jnp.zeros((5,), jnp.uint32))


def test_output_that_depends_on_the_chunk_size():
    padded = lambda p, x, key: jnp.pad(encode(p, x, key), ((0, 0), (0, 3 - x.shape[0] % 3)))
    f = gc_jax.cached_value_and_grad(loss, padded, 3)
    with pytest.raises(
        ValueError, match=r"shape \(3, 7\).*shape \(2, 5\).*last chunk of 2 rows.*leading axis"
    ):
        traced(f, W, Q, DOC)
    as_dtype = lambda p, x, key: encode(p, x, key).astype(
        jnp.float32 if x.shape[0] == 3 else jnp.bfloat16
    )
    with pytest.raises(ValueError, match=r"dtype float32.*dtype bfloat16 for the last chunk"):
        traced(gc_jax.cached_value_and_grad(loss, as_dtype, 3), W, Q, DOC)


def test_batch_axis_that_does_not_divide_the_batch():
    from jax.sharding import AxisType

    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))
    f = gc_jax.cached_value_and_grad(loss, encode, 2, batch_axis="data")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"12 rows, which the 8 shards"):
        traced(f, W, rows(12), rows(12))


def test_replicated_leaf_before_a_sharded_leaf_is_resharded():
    """Explicit axes: a leaf whose leading axis is replicated is cut like the sharded ones."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()
    q, d = _global_rows()
    x = {
        "a_replicated": jax.device_put(q, NamedSharding(mesh, P())),
        "b_sharded": jax.device_put(q[::-1], NamedSharding(mesh, P("data"))),
    }
    ds = jax.device_put(d, NamedSharding(mesh, P("data")))
    f = gc_jax.cached_value_and_grad(loss, [encode_tree_ab, encode], 2)
    got = jax.jit(f)(jax.device_put(W, NamedSharding(mesh, P())), x, ds)
    plain = {"a_replicated": q, "b_sharded": q[::-1]}
    want = jax.value_and_grad(
        lambda p: loss(p, encode_tree_ab(p, plain, None), encode(p, d, None))
    )(W)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1]["w"], want[1]["w"], rtol=1e-4, atol=1e-6)


def encode_tree_ab(p, x, key):
    return jnp.tanh(x["a_replicated"] @ p["w"] - x["b_sharded"] @ p["w"])


def test_loss_without_params_first_names_the_fix():
    f = gc_jax.cached_value_and_grad(lambda q, d: contrastive_loss(q, d), encode, 2)
    with pytest.raises(
        TypeError,
        match=r"loss_fn\(q, d\) is called as loss_fn\(params, \*reps"
        r".*params come first: write loss_fn=lambda params, \*reps",
    ):
        traced(f, W, Q, DOC)


def test_dropout_encoder_without_rng_names_the_argument():
    def dropout(p, x, key):
        return encode(p, x, key) * jax.random.bernoulli(key, 0.9, (x.shape[0], D))

    f = gc_jax.cached_value_and_grad(loss, dropout, 2)
    with pytest.raises(
        TypeError,
        match=r"encoder draws random numbers.*got key=None.*"
        r"rng=jax\.random\.key\(seed\)",
    ):
        traced(f, W, Q, DOC)
    encode_batch = gc_jax.chunked_encoder(dropout, 2)
    with pytest.raises(TypeError, match=r"encode draws random numbers.*encode_batch\(params, "):
        traced(lambda p: encode_batch(p, Q), W)


P_INT = {"w": jnp.eye(D), "n": jnp.array(3, jnp.int32)}


def _scaled(p, x, key):
    return jnp.tanh(x @ p["w"] * p["n"].astype(jnp.float32) / 3)


def _full_loss(p):
    return loss(p, _scaled(p, Q, None), _scaled(p, DOC, None))


def test_integer_param_leaf_gets_no_gradient_cached_value_and_grad():
    """Zeros of the leaf's dtype (so optimizers leave it as it is); floats exact."""
    value, grads = jax.jit(gc_jax.cached_value_and_grad(loss, _scaled, 3))(P_INT, Q, DOC)
    ref_value, ref_grads = jax.value_and_grad(_full_loss, allow_int=True)(P_INT)
    chex.assert_trees_all_close(
        (value, grads["w"]), (ref_value, ref_grads["w"]), rtol=1e-5, atol=1e-6
    )
    assert grads["n"].dtype == jnp.int32 and int(grads["n"]) == 0
    opt = optax.adam(0.1)
    step = jax.jit(gc_jax.make_train_step(loss, _scaled, 3, optimizer=opt))
    (params, _), metrics = step((P_INT, opt.init(P_INT)), Q, DOC)
    assert bool(metrics["is_finite"]) and int(params["n"]) == 3


def test_integer_param_leaf_gets_no_gradient_chunked_encoder():
    """Inside the user's jax.grad(allow_int=True): float0, as for the plain encoder."""
    encode_batch = gc_jax.chunked_encoder(_scaled, 3)
    cached = lambda p: loss(p, encode_batch(p, Q), encode_batch(p, DOC))
    got = jax.jit(jax.value_and_grad(cached, allow_int=True))(P_INT)
    want = jax.value_and_grad(_full_loss, allow_int=True)(P_INT)
    chex.assert_trees_all_close(
        (got[0], got[1]["w"]), (want[0], want[1]["w"]), rtol=1e-5, atol=1e-6
    )
    assert got[1]["n"].dtype == want[1]["n"].dtype == jax.dtypes.float0


# --- A key passed positionally, an encoder without the key argument (issue 34) ------------

X = jnp.arange(32.0).reshape(8, 4) / 32
linear = lambda w, x, key: x @ w
loss_fn = lambda params, q, d: contrastive_loss(q, d, temperature=0.5)


@pytest.mark.parametrize("key", [jax.random.key(0), jax.random.PRNGKey(0)], ids=["typed", "raw"])
def test_a_key_passed_positionally_names_rng(key):
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, linear, chunk_size=4)
    with pytest.raises(TypeError, match=r"inputs\[2\], is a JAX random key.*pass it as rng="):
        grad_fn(jnp.eye(4), X, X, key)
    step = gc_jax.make_train_step(loss_fn, linear, 4, optimizer=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"train_step\(state, queries, docs, rng=key\)"):
        step((jnp.eye(4), optax.sgd(0.1).init(jnp.eye(4))), X, X, key)
    gc = gc_jax.compat.GradCache(
        [nnx.Linear(4, 4, rngs=nnx.Rngs(0))] * 2, 4, loss_fn=lambda q, d: 0.0
    )
    with pytest.raises(TypeError, match=r"gc\(queries, docs, rng=key\)"):
        gc(X, X, key)


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
