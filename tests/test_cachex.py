"""gc_jax.compat.cachex (the original grad_cache.cachex API) against the same programs uncached.

Every reference encodes each chunk with its own key and concatenates, all in one
graph (no caching, no checkpointing), and is differentiated with plain JAX.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from gc_jax.compat import cachex
from gc_jax.compat.cachex.training import cache_train_step

TOL = {"rtol": 2e-5, "atol": 2e-6}
# Numerics tests skip LLVM's optimizations (not XLA's HLO passes): on CPU, compiling
# threefry dropout otherwise dominates the run time. The memory test uses the defaults.
FAST = {"xla_backend_optimization_level": 0}


def fast_jit(f, **kwargs):
    return jax.jit(f, compiler_options=FAST, **kwargs)


VOCAB, SEQ, DIM = 32, 8, 16


# --- a small transformer-ish encoder (HF-style call: model(**batch, params=, train=)) ---


def init_model(seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    normal = lambda k, shape, scale: jax.random.normal(k, shape) * scale
    return {
        "embed": normal(k[0], (VOCAB, DIM), 0.5),
        "pos": normal(k[1], (SEQ, DIM), 0.1),
        "qkv": normal(k[2], (DIM, 3 * DIM), DIM**-0.5),
        "mlp_in": normal(k[3], (DIM, 2 * DIM), DIM**-0.5),
        "mlp_out": normal(k[4], (2 * DIM, DIM), (2 * DIM) ** -0.5),
    }


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-6)


def _dropout(key, x, rate=0.1):
    return x * jax.random.bernoulli(key, 1 - rate, x.shape) / (1 - rate)


def model(input_ids, attention_mask, params, dropout_rng=None, train=False):
    """One pre-norm block: masked self-attention, then an MLP with dropout."""
    x = params["embed"][input_ids] + params["pos"]
    q, k, v = jnp.split(_norm(x) @ params["qkv"], 3, axis=-1)
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(DIM)
    attn = jax.nn.softmax(jnp.where(attention_mask[:, None, :] > 0, scores, -1e9), axis=-1)
    x = x + jnp.einsum("bqk,bkd->bqd", attn, v)
    h = jax.nn.gelu(_norm(x) @ params["mlp_in"]) @ params["mlp_out"]
    if train:
        h = _dropout(dropout_rng, h)
    return (_norm(x + h),)


def bag_model(input_ids, attention_mask, params, dropout_rng):
    """A cheaper encoder (masked mean of embeddings, an MLP with dropout)."""
    mask = attention_mask[..., None].astype(jnp.float32)
    x = (params["embed"][input_ids] * mask).sum(1) / mask.sum(1)
    h = _dropout(dropout_rng, jax.nn.gelu(x @ params["mlp_in"]))
    return h @ params["mlp_out"]


def token_batch(rows, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    ids = jax.random.randint(k1, (rows, SEQ), 1, VOCAB, jnp.int32)
    lengths = jax.random.randint(k2, (rows, 1), 2, SEQ + 1)
    mask = (jnp.arange(SEQ)[None] < lengths).astype(jnp.int32)
    return {"input_ids": ids * mask, "attention_mask": mask}


def contrastive_loss(ss, tt, scale_by_dim=True):
    """Tevatron's loss: query i's positive is passage i * k, then k - 1 hard negatives."""
    if scale_by_dim:
        ss, tt = ss / math.sqrt(ss.shape[-1]), tt / math.sqrt(ss.shape[-1])
    labels = jnp.arange(0, tt.shape[0], tt.shape[0] // ss.shape[0])
    scores = jnp.einsum("si,ti->st", ss, tt, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(scores, labels)


def uncached(fwd_fn):
    """The same per-chunk program without caching: every chunk encoded with its own key."""

    def f(params, batch):
        return cachex.tree_unchunk(jax.vmap(fwd_fn, in_axes=(None, 0))(params, batch))

    return f


# --- 1. Tevatron's TPU trainer (tevax/experimental/mp/train.py) ---

Q_ROWS, K_PASSAGES, Q_CHUNKS, P_CHUNKS = 8, 2, 4, 8
OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))


def tevatron_train_step(grad_cache):
    def train_step(params, opt_state, queries, passages, dropout_rng):
        q_rngs, p_rngs = jax.random.split(dropout_rng, 2)
        queries = cachex.tree_chunk(queries, Q_CHUNKS)
        passages = cachex.tree_chunk(passages, P_CHUNKS)
        q_rngs = jax.random.split(q_rngs, Q_CHUNKS)
        p_rngs = jax.random.split(p_rngs, P_CHUNKS)
        queries["dropout_rng"] = q_rngs
        passages["dropout_rng"] = p_rngs

        def fwd_fn(params, batch):
            out = model(**batch, params=params, train=True)[0]
            return out[:, 0]

        fwd_fn = cachex.grad_cached(fwd_fn, None) if grad_cache else uncached(fwd_fn)

        def compute_loss(params, qq, pp):
            hq = fwd_fn(params, qq)
            hp = fwd_fn(params, pp)
            return contrastive_loss(hq, hp).mean()

        loss, grads = jax.value_and_grad(compute_loss, argnums=0)(params, queries, passages)
        updates, new_opt_state = OPTIMIZER.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return new_params, new_opt_state, {"loss": loss, "grads": grads}

    return fast_jit(train_step)


def test_tevatron_trainer_matches_uncached():
    params = init_model()
    runs = {}
    for grad_cache in (True, False):
        step = tevatron_train_step(grad_cache)
        p, opt_state, metrics = params, OPTIMIZER.init(params), []
        for i in range(3):
            qq, pp = token_batch(Q_ROWS, 2 * i), token_batch(Q_ROWS * K_PASSAGES, 2 * i + 1)
            p, opt_state, m = step(p, opt_state, qq, pp, jax.random.fold_in(jax.random.key(7), i))
            metrics.append(m)
        runs[grad_cache] = (p, metrics)
    chex.assert_trees_all_close(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-6)
    chex.assert_trees_all_close(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-6)
    assert not np.allclose(runs[True][0]["qkv"], params["qkv"])  # it trained
    assert float(optax.tree.norm(runs[True][1][0]["grads"])) > 0


@pytest.mark.parametrize("raw", [False, True], ids=["typed_keys", "raw_keys"])
def test_grad_cached_per_chunk_keys(raw):
    """Keys [n_chunk] (typed) or [n_chunk, 2] (raw uint32) in the batch; dropout replayed."""

    def fwd(params, batch):
        h = jnp.tanh(batch["x"] @ params["w"])
        keep = jax.random.bernoulli(batch["dropout_rng"], 0.7, h.shape)
        return keep * h / 0.7 @ params["out"]

    params = {"w": jax.random.normal(jax.random.key(1), (6, 12)), "out": jnp.ones((12, 4)) / 3}
    keys = jax.random.split(jax.random.key(3), 4)
    batch = cachex.tree_chunk({"x": jax.random.normal(jax.random.key(2), (12, 6))}, 4)
    batch["dropout_rng"] = jax.random.key_data(keys) if raw else keys

    def loss(f):
        return lambda p, b: contrastive_loss(f(p, b)[:4], f(p, b)[4:]).mean()

    got = fast_jit(jax.value_and_grad(loss(cachex.grad_cached(fwd, None))))(params, batch)
    want = fast_jit(jax.value_and_grad(loss(uncached(fwd))))(params, batch)
    chex.assert_trees_all_close(got, want, **TOL)


@pytest.mark.parametrize(
    "policy",
    [None, jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.dots_saveable],
    ids=["None", "nothing_saveable", "dots_saveable"],
)
def test_grad_cached_policies_pytrees_and_batch_grads(policy):
    """Pytree outputs, int outputs passed through, float batch leaves differentiated."""

    def fwd(params, batch):
        h = jnp.tanh((batch["x"] + batch["prompt"]) @ params)
        return {"rep": h, "ids": batch["ids"]}

    w = jax.random.normal(jax.random.key(0), (5, 3))
    batch = {
        "x": jax.random.normal(jax.random.key(1), (3, 2, 5)),
        "prompt": jnp.full((3, 2, 5), 0.1),
        "ids": jnp.arange(6, dtype=jnp.int32).reshape(3, 2),
    }

    def loss(f):
        def value(w, prompt):
            out = f(w, dict(batch, prompt=prompt))
            return jnp.sum(out["rep"] ** 3 * out["ids"][:, None])

        return value

    cached = cachex.grad_cached(fwd, policy, prevent_cse=False)
    got = fast_jit(jax.value_and_grad(loss(cached), argnums=(0, 1)))(w, batch["prompt"])
    want = fast_jit(jax.value_and_grad(loss(uncached(fwd)), argnums=(0, 1)))(w, batch["prompt"])
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=1e-5)  # gradients ~1
    out = cached(w, batch)
    assert out["ids"].dtype == jnp.int32 and out["ids"].tolist() == list(range(6))


def test_grad_cached_is_chunked_encoder():
    """One implementation: grad_cached is gc_jax's custom VJP, not a checkpointed scan."""
    cached = cachex.grad_cached(lambda w, b: b @ w, None)
    jaxpr = str(jax.make_jaxpr(cached)(jnp.eye(2), jnp.ones((3, 2, 2))))
    assert "custom_vjp_call" in jaxpr and "checkpoint" not in jaxpr and "remat" not in jaxpr


# --- 2. cache_train_step: Flax TrainState under pmap ---


def p_contrastive_loss(ss, tt, axis="device"):
    """Tevatron's per-device loss: gathers every device's passages itself."""
    per_shard = tt.shape[0]
    labels = jnp.arange(0, per_shard, per_shard // ss.shape[0]) + per_shard * jax.lax.axis_index(
        axis
    )
    tt = jax.lax.all_gather(tt, axis).reshape(-1, ss.shape[-1])
    return optax.softmax_cross_entropy_with_integer_labels(ss @ tt.T, labels)


def plain_train_step(loss_fn, state, ss, tt, axis="device"):
    def encode(params, xx):
        apply = lambda p, chunk: state.apply_fn(params=p, **chunk)
        return uncached(apply)(params, xx)

    def loss(params):
        return jnp.mean(loss_fn(encode(params, ss), encode(params, tt), axis=axis))

    loss, grads = jax.value_and_grad(loss)(state.params)
    loss, grads = jax.lax.pmean((loss, grads), axis)
    return loss, state.apply_gradients(grads=grads)


def test_cache_train_step_under_pmap():
    n_dev = jax.local_device_count()
    assert n_dev == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"

    def apply_fn(params, input_ids, attention_mask, dropout_rng):
        return bag_model(input_ids, attention_mask, params, dropout_rng)

    state = train_state.TrainState.create(
        apply_fn=apply_fn, params=init_model(1), tx=optax.adamw(1e-3)
    )
    state = jax.tree.map(lambda v: jnp.broadcast_to(v, (n_dev, *jnp.shape(v))), state)

    def inputs(rows, n_chunk, seed):  # [device, n_chunk, rows / n_chunk, ...]
        batch = cachex.tree_chunk(token_batch(n_dev * rows, seed), n_dev)
        batch = cachex.tree_chunk(batch, n_chunk, axis=1)
        keys = jax.random.split(jax.random.key(seed), n_dev * n_chunk)
        batch["dropout_rng"] = jax.random.key_data(keys).reshape(n_dev, n_chunk, -1)  # raw
        return batch

    states = {}
    for name, step_fn in (("cached", cache_train_step), ("plain", plain_train_step)):
        step = jax.pmap(functools.partial(step_fn, p_contrastive_loss), axis_name="device")
        batches = [(inputs(2, 2, 2 * i), inputs(4, 2, 2 * i + 1)) for i in range(2)]
        step = step.lower(state, *batches[0]).compile(compiler_options=FAST)
        s, losses = state, []
        for ss, tt in batches:
            loss, s = step(s, ss, tt)
            losses.append(loss)
        states[name] = (losses, s.params)
    chex.assert_trees_all_close(states["cached"], states["plain"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(states["cached"][0][0], states["cached"][0][0][0])  # pmean'd


# --- 3. chunk_encode + cache_grad + unchunk_args by hand (Tevatron's retriever step) ---


def test_functional_by_hand_matches_uncached():
    def encode_query(params, **kwargs):
        h = jnp.tanh(kwargs["x"] @ params["q"])
        return h * jax.random.bernoulli(kwargs["dropout_rng"], 0.8, h.shape) / 0.8

    def encode_passage(params, **kwargs):
        return jnp.tanh(kwargs["x"] @ params["p"])

    k = jax.random.split(jax.random.key(0), 4)
    params = {"q": jax.random.normal(k[0], (6, 4)), "p": jax.random.normal(k[1], (6, 4))}
    queries = {"x": jax.random.normal(k[2], (6, 6))}
    passages = {"x": jax.random.normal(k[3], (12, 6))}

    @fast_jit
    def step(params, queries, passages, dropout_rng):
        queries, passages = cachex.tree_chunk(queries, 3), cachex.tree_chunk(passages, 4)
        q_rngs, p_rngs = jax.random.split(dropout_rng)
        q_rngs = jax.random.split(q_rngs, 3)
        p_rngs = jax.random.split(p_rngs, 4)

        q_reps = cachex.chunk_encode(functools.partial(encode_query, params))(
            **queries, dropout_rng=q_rngs
        )
        p_reps = cachex.chunk_encode(functools.partial(encode_passage, params))(
            **passages, dropout_rng=p_rngs
        )

        @cachex.unchunk_args(axis=0, argnums=(0, 1))
        def compute_loss(xx, yy):
            return jnp.mean(contrastive_loss(xx, yy))

        loss, (q_grads, p_grads) = jax.value_and_grad(compute_loss, argnums=(0, 1))(q_reps, p_reps)
        grads = jax.tree.map(jnp.zeros_like, params)
        grads = cachex.cache_grad(encode_query)(
            params, grads, q_grads, **queries, dropout_rng=q_rngs
        )
        grads = cachex.cache_grad(encode_passage)(
            params, grads, p_grads, **passages, dropout_rng=p_rngs
        )

        def plain(params):
            enc = lambda f: uncached(lambda p, b: f(p, **b))
            qq = enc(encode_query)(params, dict(queries, dropout_rng=q_rngs))
            pp = enc(encode_passage)(params, dict(passages, dropout_rng=p_rngs))
            return jnp.mean(contrastive_loss(qq, pp)), qq

        (want_loss, want_q), want_grads = jax.value_and_grad(plain, has_aux=True)(params)
        return (loss, q_reps, grads), (want_loss, cachex.tree_chunk(want_q, 3), want_grads)

    got, want = step(params, queries, passages, jax.random.key(5))
    chex.assert_trees_all_close(got, want, **TOL)
    assert got[1].shape == (3, 2, 4)


def test_grad_with_cache_is_a_vjp():
    f = lambda w, x: {"a": jnp.sin(x @ w), "b": x @ w**2}
    w, x = jnp.arange(6.0).reshape(3, 2) / 6, jnp.ones((4, 3))
    cache = {"a": jnp.full((4, 2), 0.5), "b": jnp.arange(8.0).reshape(4, 2)}
    want = jax.vjp(lambda w: f(w, x), w)[1](cache)[0]
    chex.assert_trees_all_close(cachex.grad_with_cache(f)(w, cache, x), want, **TOL)
    by_x = cachex.grad_with_cache(f, argnums=2)(w, cache, x)
    chex.assert_trees_all_close(by_x, jax.vjp(lambda x: f(w, x), x)[1](cache)[0], **TOL)


def test_tree_chunk_round_trip():
    keys = jax.random.split(jax.random.key(0), 6)
    tree = {"a": jnp.arange(24).reshape(6, 4), "b": [jnp.ones((6,))], "key": keys}
    chunked = cachex.tree_chunk(tree, 3)
    assert chunked["a"].shape == (3, 2, 4) and chunked["key"].shape == (3, 2)
    np.testing.assert_array_equal(chunked["a"][1], tree["a"][2:4])
    back = cachex.tree_unchunk(chunked)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    chex.assert_trees_all_equal(
        jax.tree.map(jax.random.key_data, back["key"]), jax.random.key_data(keys)
    )
    chex.assert_trees_all_equal(back["a"], tree["a"])
    x = jnp.arange(60).reshape(3, 4, 5)
    for axis, shape in ((1, (3, 2, 2, 5)), (-1, (3, 4, 5, 1)), (2, (3, 4, 5, 1))):
        n = 2 if axis == 1 else 5
        y = cachex.tree_chunk(x, n, axis=axis)
        assert y.shape == shape
        chex.assert_trees_all_equal(cachex.tree_unchunk(y, axis=axis if axis >= 0 else axis - 1), x)
    assert cachex.tree_unchunk(jnp.zeros((2, 3, 4)), axis=-2).shape == (2, 12)


ENC = lambda params, x: x @ params
W = jnp.ones((3, 2))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: cachex.tree_chunk(jnp.zeros((5, 2)), 2), ValueError, "n_chunk=2 does not divide"),
        (lambda: cachex.tree_chunk(jnp.zeros((4, 2)), 0), ValueError, "n_chunk must be a positive"),
        (lambda: cachex.tree_chunk(jnp.zeros((4, 2)), 2.0), TypeError, "n_chunk must be"),
        (lambda: cachex.tree_chunk(jnp.zeros((4, 2)), 2, axis=2), ValueError, "axis=2 is out"),
        (lambda: cachex.tree_chunk({"a": 3}, 1), TypeError, r"tree\['a'\] must be an array"),
        (lambda: cachex.tree_chunk(jnp.zeros(4), 2, axis="0"), TypeError, "axis must be an int"),
        (lambda: cachex.tree_unchunk(jnp.zeros((4,))), ValueError, "expected a"),
        (lambda: cachex.unchunk_args(argnums=(0.5,)), TypeError, "argnums must be"),
        (lambda: cachex.unchunk_args(argnums=(1,))(ENC)(W), ValueError, "argnums"),
        (lambda: cachex.grad_cached("f"), TypeError, "f must be callable"),
        (lambda: cachex.grad_cached(ENC, policy=3), TypeError, "policy must be callable"),
        (lambda: cachex.grad_cached(ENC, None, prevent_cse="no"), TypeError, "prevent_cse"),
        (
            lambda: cachex.grad_cached(lambda p, b: jnp.sum(b @ p))(W, jnp.ones((2, 2, 3))),
            ValueError,
            "one representation row",
        ),
        (  # a [B, d] batch not cut with tree_chunk: f would see one row per "chunk"
            lambda: cachex.grad_cached(ENC)(W, jnp.ones((8, 3))),
            ValueError,
            r"f returned an output with 2 rows for a chunk whose leaves have \[3\] rows\. "
            r"grad_cached's batch must be pre-chunked.*cachex\.tree_chunk\(batch, n_chunk\)",
        ),
        (
            lambda: cachex.chunk_encode(lambda **k: k["x"])(x=jnp.ones((2, 3)), y=jnp.ones((3,))),
            ValueError,
            r"different leading \(chunk\) sizes",
        ),
        (lambda: cachex.chunk_encode(lambda **k: 0)(), ValueError, "xx has no array leaves"),
        (lambda: cachex.chunk_encode(None), TypeError, "encode_fn must be callable"),
        (
            lambda: cachex.cache_grad(lambda params, x: x @ params)(
                W, jnp.zeros_like(W), jnp.ones((2, 2, 3)), x=jnp.ones((2, 2, 3))
            ),
            ValueError,
            r"cached_grad has shape \(2, 2, 3\).*\(2, 2, 2\)",
        ),
        (
            lambda: cachex.cache_grad(lambda params, x: x @ params)(
                W, {"w": W}, jnp.ones((2, 2, 2)), x=jnp.ones((2, 2, 3))
            ),
            ValueError,
            "grad_accumulator has structure",
        ),
        (
            lambda: cachex.grad_with_cache(ENC)(W, [jnp.ones((2, 2))], jnp.ones((2, 3))),
            ValueError,
            "cache has structure",
        ),
    ],
)
def test_argument_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- 4. memory: grad_cached's gradient holds one chunk's activations ---

WIDTH, DEPTH, ROWS, DIM_OUT = 256, 8, 128, 16


def deep_mlp(params, batch):
    x = batch["x"]
    for w in params["layers"]:
        x = jnp.tanh(x @ w)
    return x @ params["out"]


def temp_bytes(fwd, n_chunk):
    params = {
        "layers": [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * DEPTH,
        "out": jax.ShapeDtypeStruct((WIDTH, DIM_OUT), jnp.float32),
    }
    batch = {"x": jax.ShapeDtypeStruct((n_chunk, ROWS, WIDTH), jnp.float32)}
    loss = lambda p, b: -jnp.mean(fwd(p, b) ** 2)  # O(batch): only the cache grows
    compiled = jax.jit(jax.grad(loss)).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_grad_cached_temp_memory_is_flat_in_chunks():
    chunk_activations = ROWS * WIDTH * 4 * DEPTH  # one chunk's layer outputs, 1 MiB
    cached = cachex.grad_cached(deep_mlp, None)
    growth = temp_bytes(cached, 8) - temp_bytes(cached, 2)
    plain_growth = temp_bytes(uncached(deep_mlp), 8) - temp_bytes(uncached(deep_mlp), 2)
    # 4x the batch at fixed chunk rows: only the [B, DIM_OUT] cache and its gradient grow.
    assert growth < chunk_activations / 2, f"grew by {growth} bytes"
    assert plain_growth > 5 * chunk_activations, f"uncached grew by {plain_growth} bytes"
