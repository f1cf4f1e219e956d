"""Linen and NNX modules as encoders, with dropout replayed exactly."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from reference import full_batch_value_and_grad

import gc_jax
from gc_jax.losses import contrastive_loss


def loss(params, q, d):
    return contrastive_loss(q, d, temperature=0.5)


def inputs(rows=10, k=2):
    kq, kd = jax.random.split(jax.random.key(7))
    return jax.random.normal(kq, (rows, 6)), jax.random.normal(kd, (rows * k, 6))


class LinenTower(nn.Module):
    @nn.compact
    def __call__(self, tokens, mask):
        h = nn.Dense(16)(tokens * mask[:, None])
        h = nn.Dropout(0.3, deterministic=False)(nn.gelu(h))
        return {"pooled": nn.Dense(8)(h), "hidden": h}


class NNXTower(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(6, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.dense2 = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.dropout(nnx.gelu(self.dense1(x))))


def as_dict(x):
    return {"tokens": x, "mask": (jnp.arange(x.shape[0]) % 4 != 0).astype(x.dtype)}


def compare(encode, params, chunk_size, q, d, rng):
    got = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size))(params, q, d, rng=rng)
    want = full_batch_value_and_grad(loss, encode, chunk_size, params, q, d, rng=rng)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
    return got


@pytest.mark.parametrize("chunk_size", [3, 10])
def test_linen_module_with_dict_inputs_and_dropout(chunk_size):
    model = LinenTower()
    q, d = inputs()
    params = model.init(jax.random.key(0), **as_dict(q))["params"]
    encode = gc_jax.linen_encoder(model, get_rep=lambda out: out["pooled"])
    with_dropout, _ = compare(encode, params, chunk_size, as_dict(q), as_dict(d), jax.random.key(1))
    other_key, _ = compare(encode, params, chunk_size, as_dict(q), as_dict(d), jax.random.key(2))
    assert not jnp.allclose(with_dropout, other_key)


@pytest.mark.parametrize("chunk_size", [4, 10])
def test_nnx_module_with_dropout(chunk_size):
    model = NNXTower(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    q, d = inputs()
    encode = gc_jax.nnx_encoder(model)
    _, grads = compare(encode, params, chunk_size, q, d, jax.random.key(3))
    assert isinstance(grads, nnx.State)
    # Without a key, dropout in training mode raises (as Linen's does): it is turned off
    # only where the user says so, with an encoder of the model in eval mode.
    with pytest.raises(
        TypeError, match=r"model has dropout in training mode \(model\.dropout\) but got key=None"
    ):
        compare(encode, params, chunk_size, q, d, None)
    plain = nnx.view(model, deterministic=True)
    eval_loss, _ = compare(gc_jax.nnx_encoder(plain), params, chunk_size, q, d, None)
    chex.assert_trees_all_close(eval_loss, loss(None, plain(q), plain(d)), rtol=1e-5)


def test_nnx_grads_update_the_model_with_an_optimizer():
    model = NNXTower(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss, gc_jax.nnx_encoder(model), 4))
    _, grads = grad_fn(nnx.state(model, nnx.Param), *inputs(), rng=jax.random.key(0))
    optimizer.update(model, grads)
    after = nnx.state(model, nnx.Param)
    moved = jax.tree.map(
        lambda a, b, g: jnp.allclose(a - 0.1 * g, b, atol=1e-6), before, after, grads
    )
    assert all(jax.tree.leaves(moved))


def test_chunks_are_passed_like_the_pytorch_gradcache():
    from gc_jax._model_calls import call_with_chunk

    def fn(*args, **kwargs):
        return args, kwargs

    x = jnp.ones(2)
    assert call_with_chunk(fn, x) == ((x,), {})
    assert call_with_chunk(fn, [x, x]) == ((x, x), {})
    assert call_with_chunk(fn, {"a": x}) == ((), {"a": x})
    assert call_with_chunk(fn, ([x], {"a": x})) == ((x,), {"a": x})


# --- BatchNorm on running statistics -------------------------------------------------


class LinenNormTower(nn.Module):
    train: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=not self.train)(nn.Dense(16)(x))
        h = nn.Dropout(0.3, deterministic=False)(nn.gelu(h))
        return nn.Dense(8)(h)


def running_stats(shift):
    return {
        "BatchNorm_0": {"mean": jnp.linspace(-shift, shift, 16), "var": jnp.linspace(0.5, 2, 16)}
    }


def test_linen_batch_norm_on_running_statistics_with_dropout():
    model = LinenNormTower()
    q, d = inputs()
    params = model.init(jax.random.key(0), q)["params"]

    def jitted(value_and_grad):
        # The encoder is built inside the step from the statistics passed to it, so
        # they are arguments of the compiled step, not constants baked into it.
        @jax.jit
        def step(params, batch_stats, q, d, rng):
            encode = gc_jax.linen_encoder(model, extra_variables={"batch_stats": batch_stats})
            return value_and_grad(loss, encode, 4)(params, q, d, rng=rng)

        return step

    cached = jitted(gc_jax.cached_value_and_grad)
    full = jitted(gc_jax.testing.full_batch_value_and_grad)
    outs = []
    for shift in (0.5, -1.0):
        args = (params, running_stats(shift), q, d, jax.random.key(1))
        outs.append(cached(*args))
        chex.assert_trees_all_close(outs[-1], full(*args), rtol=2e-5, atol=2e-6)
    assert not jnp.allclose(outs[0][0], outs[1][0]), "the statistics must be used"


@pytest.mark.parametrize(
    ("train", "extra", "error", "match"),
    [
        (False, None, ValueError, r"reads the variable collection 'batch_stats'.*extra_var"),
        (True, {"batch_stats": running_stats(0.0)}, ValueError, r"BatchNorm in training mode"),
        (False, {"params": {}}, ValueError, "extra_variables must not contain 'params'"),
        (False, [1], TypeError, "extra_variables must be a mapping.*got list"),
    ],
)
def test_linen_variable_collection_errors(train, extra, error, match):
    model = LinenNormTower(train=train)
    q, d = inputs()
    params = LinenNormTower().init(jax.random.key(0), q)["params"]
    with pytest.raises(error, match=match):
        encode = gc_jax.linen_encoder(model, extra_variables=extra)
        jax.eval_shape(gc_jax.cached_value_and_grad(loss, encode, 4), params, q, d)


def test_linen_variables_dict_as_params_names_the_fix():
    q, d = inputs()
    model = LinenTower()
    variables = model.init(jax.random.key(0), q, jnp.ones(q.shape[0]))
    encode = gc_jax.linen_encoder(model, get_rep=lambda out: out["pooled"])
    f = jax.jit(gc_jax.cached_value_and_grad(loss, encode, 4))
    with pytest.raises(
        ValueError,
        match=r"got a whole Linen variables dict as params.*"
        r"pass variables\['params'\].*extra_variables=",
    ):
        f(variables, (q, jnp.ones(q.shape[0])), (d, jnp.ones(d.shape[0])), rng=jax.random.key(1))
    # a dropout module with no rng: the missing argument is named
    with pytest.raises(
        TypeError,
        match=r"linen_encoder\(LinenTower\) draws random numbers.*"
        r"got key=None.*rng=jax\.random\.key\(seed\)",
    ):
        f(variables["params"], (q, jnp.ones(q.shape[0])), (d, jnp.ones(d.shape[0])))


class NNXNormTower(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(6, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.dense2 = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.dropout(nnx.gelu(self.norm(self.dense1(x)))))


def test_nnx_batch_norm_on_running_statistics_with_dropout():
    model = NNXNormTower(nnx.Rngs(0))
    model.norm.mean.set_value(jnp.linspace(-1.0, 1.0, 16))
    model.norm.var.set_value(jnp.linspace(0.5, 2.0, 16))
    params = nnx.state(model, nnx.Param)
    q, d = inputs()
    # What a user writes: a view on running statistics (dropout stays on).
    encode = gc_jax.nnx_encoder(nnx.view(model, use_running_average=True))
    compare(encode, params, 4, q, d, jax.random.key(3))
    # In training mode BatchNorm would normalise each chunk by its own statistics.
    with pytest.raises(ValueError, match=r"updated its nnx.BatchStat.*model.norm.mean"):
        grad_fn = gc_jax.cached_value_and_grad(loss, gc_jax.nnx_encoder(model), 4)
        jax.eval_shape(lambda p: grad_fn(p, q, d, rng=jax.random.key(0)), params)


class ScannedDropoutStack(nnx.Module):
    """Layers made by ``nnx.vmap`` and run by ``nnx.scan``, each with ``nnx.Dropout``
    (MaxText's ``scan_layers=True``): the dropout stream holds one key per layer."""

    def __init__(self, rngs: nnx.Rngs, layers: int = 3):
        self.embed = nnx.Linear(6, 8, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def block(rngs):
            return Block(rngs)

        self.blocks = block(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h)

        return run(self.embed(x), self.blocks)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(8, 8, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, h):
        return h + self.dropout(nnx.gelu(self.dense(h)))


def test_nnx_scanned_layers_with_dropout_in_every_form():
    """Dropout inside scanned layers is replayed exactly by nnx_encoder, GradCache and
    make_train_step; each layer draws its own mask from the chunk's key."""
    model = ScannedDropoutStack(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    q, d = inputs()
    encode = gc_jax.nnx_encoder(model)
    reference = jax.jit(gc_jax.testing.full_batch_value_and_grad(loss, encode, 4))
    want = reference(params, q, d, rng=jax.random.key(5))
    assert not jnp.allclose(want[0], reference(params, q, d, rng=jax.random.key(6))[0])
    got = jax.jit(gc_jax.cached_value_and_grad(loss, encode, 4))(
        params, q, d, rng=jax.random.key(5)
    )
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
    gc = gc_jax.compat.GradCache([model, model], 4, loss_fn=lambda a, b: loss(None, a, b))
    by_class = jax.jit(lambda p, q, d, k: gc(q, d, rng=k, params=p))(
        params, q, d, jax.random.key(5)
    )
    chex.assert_trees_all_close(by_class, want, rtol=2e-5, atol=2e-6)

    step = gc_jax.make_train_step(loss, encode, 4, optimizer=optax.sgd(1.0))
    tx = optax.sgd(1.0)
    (new_params, _), metrics = jax.jit(step)((params, tx.init(params)), q, d, rng=jax.random.key(5))
    chex.assert_trees_all_close(metrics["loss"], want[0], rtol=2e-5)
    moved = jax.tree.map(lambda p, g: p - g, params, want[1])
    chex.assert_trees_all_close(new_params, moved, rtol=2e-5, atol=2e-6)


# --- An NNX model where its state belongs; NNX dropout with no key (issue 34) --------------

X = jnp.arange(32.0).reshape(8, 4) / 32
TOL = {"rtol": 2e-5, "atol": 2e-6}


def test_an_nnx_model_as_params_names_nnx_state():
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    grad_fn = gc_jax.cached_value_and_grad(loss, gc_jax.nnx_encoder(model), chunk_size=4)
    with pytest.raises(TypeError, match=r"got an nnx.Module \(Linear\) as params.*"
                       r"nnx.state\(model, nnx.Param\).*nnx.split"):  # fmt: skip
        grad_fn(model, X, X)
    other = nnx.state(nnx.Linear(4, 4, use_bias=False, rngs=nnx.Rngs(0)), nnx.Param)
    with pytest.raises(ValueError, match=r"params that do not match the model.*nnx.state"):
        grad_fn(other, X, X)
    grads = jax.jit(grad_fn)(nnx.state(model, nnx.Param), X, X)[1]
    assert isinstance(grads, nnx.State)


class Dropped(nnx.Module):
    def __init__(self, rate: float = 0.5):
        self.dense = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.dropout = nnx.Dropout(rate, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.dropout(self.dense(x))


def test_nnx_dropout_without_a_key_raises_like_linen():
    model = Dropped()
    params = nnx.state(model, nnx.Param)
    grad_fn = gc_jax.cached_value_and_grad(loss, gc_jax.nnx_encoder(model), chunk_size=4)
    with pytest.raises(TypeError, match=r"model.dropout\) but got key=None.*rng=jax.random.key"
                       r".*nnx.view\(model, deterministic=True\)"):  # fmt: skip
        grad_fn(params, X, X)
    with pytest.raises(TypeError, match=r"dropout in training mode"):
        gc_jax.testing.assert_matches_full_batch(loss, gc_jax.nnx_encoder(model), 4,
                                                 params, X, X)  # fmt: skip
    # With a key dropout is on; in eval mode (said explicitly) it is off.
    with_key, _ = grad_fn(params, X, X, rng=jax.random.key(0))
    plain = nnx.view(model, deterministic=True)
    off, _ = gc_jax.cached_value_and_grad(loss, gc_jax.nnx_encoder(plain), 4)(params, X, X)
    chex.assert_trees_all_close(off, loss(None, plain(X), plain(X)), **TOL)
    assert not jnp.allclose(with_key, off)
    model.eval()
    chex.assert_trees_all_close(gc_jax.nnx_encoder(model)(params, X, None), plain(X), **TOL)


def test_nnx_dropout_of_rate_zero_needs_no_key():
    model = Dropped(rate=0.0)
    out = gc_jax.nnx_encoder(model)(nnx.state(model, nnx.Param), X, None)
    chex.assert_trees_all_close(out, model.dense(X), **TOL)
