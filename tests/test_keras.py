"""Keras 3 models (JAX backend) as encoders, with dropout replayed exactly.

Plain Keras models always (when keras is installed); KerasHub's ``BertBackbone`` and
``GemmaBackbone`` built from a config, random weights, when keras_hub is importable (it
needs no TensorFlow to run), both also under sharded ``jit`` over explicit axes.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported

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

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported with another backend", allow_module_level=True)

TOL = {"rtol": 2e-5, "atol": 2e-6}


def loss(params, q, d):
    return contrastive_loss(q, d, temperature=0.5)


def inputs(rows=6, k=2):
    kq, kd = jax.random.split(jax.random.key(7))
    return jax.random.normal(kq, (rows, 6)), jax.random.normal(kd, (rows * k, 6))


def as_dict(x):
    return {"tokens": x, "scale": 1.0 + jnp.arange(x.shape[0], dtype=x.dtype)[:, None] % 3}


def tower(x):
    for _ in range(2):
        x = keras.layers.Dropout(0.3)(keras.layers.Dense(32, activation="gelu")(x))
    return keras.layers.Dense(8)(x)


def functional_model():
    """Dict inputs, two dropout layers (two SeedGenerators)."""
    keras.utils.set_random_seed(0)
    tokens, scale = keras.Input((6,), name="tokens"), keras.Input((1,), name="scale")
    return keras.Model({"tokens": tokens, "scale": scale}, tower(tokens * scale))


def sequential_model(*layers):
    """A Sequential model: array inputs."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), *layers, keras.layers.Dense(8)])


def sequential_dropout_model():
    return sequential_model(keras.layers.Dense(32, activation="gelu"), keras.layers.Dropout(0.3))


def rng():
    return jax.random.key(0)


def compare(encode, params, chunk_size, q, d, rng):
    got = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size))(params, q, d, rng=rng)
    want = full_batch_value_and_grad(loss, encode, chunk_size, params, q, d, rng=rng)
    chex.assert_trees_all_close(got, want, **TOL)
    return got


def test_functional_model_with_dict_inputs_and_dropout_matches_full_batch():
    model = functional_model()
    q, d = (as_dict(x) for x in inputs())
    encode, params = gc_jax.keras_encoder(model)
    assert sorted(params) == sorted(v.path for v in model.trainable_variables)
    cached = jax.jit(gc_jax.cached_value_and_grad(loss, encode, 4))
    value, grads = cached(params, q, d, rng=jax.random.key(1))
    want = full_batch_value_and_grad(loss, encode, 4, params, q, d, rng=jax.random.key(1))
    chex.assert_trees_all_close((value, grads), want, **TOL)
    other_key, _ = cached(params, q, d, rng=jax.random.key(2))
    assert not jnp.allclose(value, other_key), "dropout must follow the key"
    # Without a key: training=False, the model's own inference output.
    chex.assert_trees_all_close(encode(params, q, None), model(q), rtol=1e-6)


def bert_backbone():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    return keras_hub.models.BertBackbone(
        vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=16, dropout=0.1,
    )  # fmt: skip


def gemma_backbone():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=50, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8, dropout=0.1,
    )  # fmt: skip


def token_batch(rows, length=8, seed=0):
    lengths = 3 + jnp.arange(rows) % (length - 2)
    return {
        "token_ids": jax.random.randint(jax.random.key(seed), (rows, length), 1, 50),
        "segment_ids": jnp.zeros((rows, length), jnp.int32),
        "padding_mask": (jnp.arange(length) < lengths[:, None]).astype(jnp.int32),
    }


def test_keras_hub_bert_backbone_in_chunked_encoder_matches_full_batch():
    """A KerasHub backbone built from a config (no preset download), dropout on."""
    encode, params = gc_jax.keras_encoder(bert_backbone(), get_rep=lambda o: o["pooled_output"])
    batch, key = token_batch(8), jax.random.key(3)
    in_batch_loss = lambda reps: loss(None, reps[:4], reps[4:])  # rows 0-3 vs rows 4-7
    encode_batch = gc_jax.chunked_encoder(encode, 4)
    got = jax.jit(jax.value_and_grad(lambda p: in_batch_loss(encode_batch(p, batch, key))))(params)

    def full(p):  # chunk c gets fold_in(key, c)
        chunks = [jax.tree.map(lambda x, c=c: x[4 * c : 4 * c + 4], batch) for c in range(2)]
        reps = [encode(p, x, jax.random.fold_in(key, c)) for c, x in enumerate(chunks)]
        return in_batch_loss(jnp.concatenate(reps))

    chex.assert_trees_all_close(got, jax.jit(jax.value_and_grad(full))(params), **TOL)
    assert float(optax.tree.norm(got[1])) > 0


BACKBONES = {
    "BertBackbone": (bert_backbone, lambda out: out["pooled_output"]),
    "GemmaBackbone": (gemma_backbone, lambda out: out.mean(1)),  # mean over the tokens
}


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_a_keras_hub_backbone_under_sharded_jit_over_explicit_axes(backbone):
    """KerasHub's embedding (``ReversibleEmbedding``, an ``ops.take``) over ids split by
    rows on explicit mesh axes: gc_jax encodes each device's rows with plain local
    types, so the backbone runs as written (plain ``jit`` of the same backbone over
    that mesh stops at the lookup and asks for ``out_sharding``)."""
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    build, get_rep = BACKBONES[backbone]
    encode, params = gc_jax.keras_encoder(build(), get_rep=get_rep)
    q, d = token_batch(32, seed=1), token_batch(32, seed=2)
    if backbone == "GemmaBackbone":  # a decoder: no segments
        q, d = ({k: v for k, v in x.items() if k != "segment_ids"} for x in (q, d))
    full = lambda p: loss(p, encode(p, q, None), encode(p, d, None))
    want = jax.jit(jax.value_and_grad(full))(params)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rows = NamedSharding(mesh, P("data"))
    step = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size=2))
    got = step(jax.device_put(params, NamedSharding(mesh, P())), *jax.device_put((q, d), rows))
    chex.assert_trees_all_close(got, want, **TOL)


def fsdp_specs(params, axis="data", shards=8):
    """Each weight split over ``axis`` along its largest dimension that divides."""

    def one(v):
        dims = [i for i in range(v.ndim) if v.shape[i] % shards == 0]
        if not dims:
            return P()
        big = max(dims, key=lambda i: v.shape[i])
        return P(*(axis if i == big else None for i in range(v.ndim)))

    return {k: one(v) for k, v in params.items()}


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_a_keras_hub_backbone_with_fsdp_weights(axis_type):
    """Weights sharded over the batch axis: the chunks span the devices. Over auto axes
    the compiler places KerasHub's lookup, exactly; over explicit axes the lookup needs
    an ``out_sharding`` KerasHub does not write, and the error says what to do."""
    encode, params = gc_jax.keras_encoder(bert_backbone(), get_rep=lambda o: o["pooled_output"])
    q, d = token_batch(32, seed=1), token_batch(32, seed=2)
    want = jax.jit(jax.value_and_grad(lambda p: loss(p, encode(p, q, None), encode(p, d, None))))(
        params
    )
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    specs = fsdp_specs(params)
    assert sum(s != P() for s in specs.values()) > len(specs) // 2, "most weights sharded"
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    q, d = jax.device_put((q, d), NamedSharding(mesh, P("data")))
    axis = "data" if axis_type == "Auto" else None
    step = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size=2, batch_axis=axis))
    with jax.set_mesh(mesh):
        if axis_type == "Auto":
            chex.assert_trees_all_close(step(placed, q, d), want, **TOL)
            return
        with pytest.raises(Exception, match="out_sharding") as raised:
            step(placed, q, d)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "table.at[ids].get(out_sharding=P('data'))" in notes, notes
    assert "axis_types=(AxisType.Auto,)" in notes, notes


def test_keras_distribution_api_shards_a_keras_hub_backbone():
    """Keras's own FSDP: ``ModelParallel`` with a ``LayoutMap`` shards the backbone's
    weights over ``data`` as it builds them; gc_jax then runs over that mesh (auto
    axes), exactly."""
    keras_hub = pytest.importorskip("keras_hub")
    devices = keras.distribution.list_devices()
    assert len(devices) >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    mesh = keras.distribution.DeviceMesh((8,), ["data"], devices[:8])
    layout = keras.distribution.LayoutMap(mesh)
    layout[".*token_embedding.*embeddings"] = ("data", None)
    layout[".*(query|key|value).*kernel"] = ("data", None, None)
    layout[".*feedforward.*kernel"] = ("data", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout))
    try:
        keras.utils.set_random_seed(0)
        model = keras_hub.models.BertBackbone(
            vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
            max_sequence_length=16, dropout=0.0,
        )  # fmt: skip
    finally:
        keras.distribution.set_distribution(None)
    encode, params = gc_jax.keras_encoder(model, get_rep=lambda o: o["pooled_output"])
    sharded = [k for k, v in params.items() if not v.sharding.is_fully_replicated]
    assert len(sharded) >= 8, sharded  # embeddings, attention and feed-forward kernels
    mesh = params[sharded[0]].sharding.mesh
    q, d = token_batch(32, seed=1), token_batch(32, seed=2)
    full = lambda p: loss(p, encode(p, q, None), encode(p, d, None))
    want = jax.jit(jax.value_and_grad(full))(jax.device_get(params))
    q, d = jax.device_put((q, d), NamedSharding(mesh, P("data")))
    step = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size=2, batch_axis="data"))
    with jax.set_mesh(mesh):
        chex.assert_trees_all_close(step(params, q, d), want, **TOL)


def test_make_train_step_optax_loop_matches_full_batch_and_writes_back():
    model = functional_model()
    encode, params = gc_jax.keras_encoder(model)
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
    # Writing the trained values back into the Keras model (documented recipe).
    for v in model.trainable_variables:
        v.assign(state[0][v.path])
    q, _ = (as_dict(x) for x in inputs())
    chex.assert_trees_all_close(model(q), encode(state[0], q, None), rtol=1e-5, atol=1e-6)


def test_sharded_jit_on_eight_devices_matches_the_documented_keys():
    """Device ``s``'s rows of chunk ``c`` of input ``i`` get
    ``fold_in(fold_in(fold_in(rng, i), c), s)``."""
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    mesh = jax.make_mesh((8,), ("data",))  # explicit axes (JAX 0.12's default)
    encode, params = gc_jax.keras_encoder(sequential_dropout_model())
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


def test_batch_norm_frozen_runs_on_moving_statistics_and_training_mode_raises():
    norm = keras.layers.BatchNormalization()
    model = sequential_model(keras.layers.Dense(32), norm, keras.layers.Dropout(0.3))
    norm.moving_mean.assign(jnp.linspace(-1.0, 1.0, 32))
    q, d = inputs()
    step = lambda encode: gc_jax.cached_value_and_grad(loss, encode, 4)
    encode, params = gc_jax.keras_encoder(model)
    with pytest.raises(ValueError, match=r"updated its non-trainable variables.*moving_mean.*"
                       r"layer.trainable = False"):  # fmt: skip
        jax.eval_shape(step(encode), params, q, d, rng=rng())
    norm.trainable = False  # Keras runs a frozen BatchNormalization on its moving statistics
    encode, params = gc_jax.keras_encoder(model)
    assert not any("batch_normalization" in path for path in params)
    jax.eval_shape(step(encode), params, q, d, rng=rng())
    chex.assert_trees_all_close(encode(params, q, None), model(q), rtol=1e-5, atol=1e-6)


class Scale(keras.layers.Layer):
    """A subclassed layer whose ``call`` takes no ``training``."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[1:], initializer="ones")

    def call(self, x):
        return x * self.w


class TwoWeights(keras.layers.Layer):
    def build(self, input_shape):
        self.a = self.add_weight(shape=input_shape[1:], name="w")
        self.b = self.add_weight(shape=input_shape[1:], name="w")

    def call(self, x):
        return x * self.a * self.b


def test_subclassed_layer_and_call_kwargs():
    layer, x, key = Scale(), jnp.ones((3, 6)), jax.random.key(0)
    layer.build((None, 6))
    encode, params = gc_jax.keras_encoder(layer)
    chex.assert_trees_all_close(encode(params, x, key), x)
    model = sequential_dropout_model()
    encode, params = gc_jax.keras_encoder(model, training=False)  # no dropout, even with a key
    chex.assert_trees_all_close(encode(params, x, key), model(x), rtol=1e-6)
    with pytest.raises(ValueError, match=r"params must be the dict keras_encoder returned.*"
                       r"got list"):  # fmt: skip
        encode([params], x, key)


def test_bad_models_and_arguments_are_named(monkeypatch):
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"no trainable variables \(it is not built.*keras.Input"):
        gc_jax.keras_encoder(unbuilt)
    frozen = sequential_model()
    frozen.trainable = False
    with pytest.raises(ValueError, match=r"no trainable variables \(every variable is frozen"):
        gc_jax.keras_encoder(frozen)
    two = TwoWeights()
    two.build((None, 6))
    with pytest.raises(ValueError, match=r"share the path\(s\) \['two_weights/w'\].*add_weight"):
        gc_jax.keras_encoder(two)
    with pytest.raises(TypeError, match=r"model must be a Keras 3 model or layer, got 'x'"):
        gc_jax.keras_encoder("x")
    with pytest.raises(ValueError, match=r"non_trainable must map every.*got \['a'\]"):
        gc_jax.keras_encoder(sequential_dropout_model(), non_trainable={"a": 1})
    monkeypatch.setattr(keras.backend, "backend", lambda: "tensorflow")
    with pytest.raises(ValueError, match=r"needs Keras on the JAX backend.*'tensorflow'.*"
                       r"KERAS_BACKEND'\] = 'jax'"):  # fmt: skip
        gc_jax.keras_encoder(sequential_model())


@pytest.mark.parametrize(("get_rep", "got"), [(lambda out: "pooled", "str 'pooled'"),
                                              (lambda out: None, "NoneType None")])  # fmt: skip
def test_get_rep_returning_a_non_array_is_named(get_rep, got):
    encode, params = gc_jax.keras_encoder(sequential_dropout_model(), get_rep=get_rep)
    q, d = inputs()
    with pytest.raises(TypeError, match=rf"get_rep returned {got}, not an array.*"
                       r"model.s output is \(\d+, 8\)"):  # fmt: skip
        jax.eval_shape(gc_jax.cached_value_and_grad(loss, encode, 4), params, q, d)


def test_importing_gc_jax_does_not_import_keras():
    code = "import sys, gc_jax; print('keras' in sys.modules)"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True, cwd=Path(__file__).parents[1])  # fmt: skip
    assert out.stdout.strip() == "False"


def test_a_keras_dict_model_names_a_missing_key():
    x = jnp.arange(32.0).reshape(8, 4) / 32
    a, other = keras.Input((4,), name="a"), keras.Input((4,), name="other")
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([a, other]))
    encode, params = gc_jax.keras_encoder(keras.Model({"a": a, "other": other}, out))
    with pytest.raises(ValueError, match=r"keys \['a', 'other'\], but the batch has no "
                       r"\['other'\] \(its keys: \['a'\]\).*Add \['other'\]"):  # fmt: skip
        encode(params, {"a": x}, None)
    assert encode(params, {"a": x, "other": x}, None).shape == (8, 2)
