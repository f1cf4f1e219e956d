"""maxsim_loss across 8 devices and inside the gradient cache, token budgets included.

Every result is compared with plain full-batch ``jax.value_and_grad`` under ``jit``.
CI runs with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_maxsim import BLOCK_TOL, TOL, data
from test_token_chunks import BUCKETS, PADDED, VOCAB, WIDTH, make_params, text_batch

import gc_jax
from gc_jax.losses import contrastive_loss, maxsim_loss

D = 8  # devices


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices: XLA_FLAGS=--xla_force_host_platform_device_count={D}")
    return jax.make_mesh((D,), ("d",), devices=jax.devices()[:D])  # explicit axes


def shard(mesh, *values):
    return [jax.device_put(v, NamedSharding(mesh, P("d"))) for v in values]


def loss(q, d, q_mask, d_mask, t, **kw):
    return maxsim_loss(q, d, q_mask=q_mask, d_mask=d_mask, temperature=t, **kw)


@functools.cache
def full_batch(k=2):
    q, d, q_mask, d_mask = data(D * 3, k, seed=1)
    f = jax.jit(jax.value_and_grad(loss, (0, 1, 4)))
    return (q, d, q_mask, d_mask), f(q, d, q_mask, d_mask, jnp.float32(0.6))


FORMS = [(m, b) for m in ("gather", "ring") for b in (None, 2)]  # (method, block_size)


@pytest.mark.parametrize(("method", "block_size"), FORMS)
def test_shard_map_matches_full_batch(mesh, method, block_size):
    """3 queries and 6 documents per device; the temperature replicated (P())."""
    inputs, want = full_batch()
    kw = {"axis_name": "d", "method": method, "block_size": block_size}
    per_device = jax.value_and_grad(functools.partial(loss, **kw), (0, 1, 4))
    f = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P("d"),) * 4 + (P(),),
        out_specs=(P(), (P("d"), P("d"), P())),
    )
    got = jax.jit(f)(*shard(mesh, *inputs), jnp.float32(0.6))
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


@pytest.mark.parametrize("method", ["gather", "ring"])
def test_shard_map_none_reduction_is_local_rows(mesh, method):
    (q, d, q_mask, d_mask), _ = full_batch()
    kw = {"reduction": "none", "block_size": 2, "axis_name": "d", "method": method}
    f = jax.shard_map(
        lambda *a: loss(*a, 0.6, **kw), mesh=mesh, in_specs=(P("d"),) * 4, out_specs=P("d")
    )
    got = jax.jit(f)(*shard(mesh, q, d, q_mask, d_mask))
    want = loss(q, d, q_mask, d_mask, 0.6, reduction="none")
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_pmap_matches_full_batch(mesh):
    inputs, (value, (dq, dd, _)) = full_batch()
    kw = {"axis_name": "d", "block_size": 2, "docs_per_query": 2}
    per_device = jax.value_and_grad(functools.partial(loss, **kw), (0, 1))
    f = jax.pmap(per_device, axis_name="d", in_axes=(0, 0, 0, 0, None), devices=jax.devices()[:D])
    split = lambda v: v.reshape(D, -1, *v.shape[1:])
    got_value, (got_dq, got_dd) = f(*map(split, inputs), jnp.float32(0.6))
    chex.assert_trees_all_close(got_value, jnp.full(D, value), **BLOCK_TOL)
    chex.assert_trees_all_close((got_dq, got_dd), (split(dq), split(dd)), **BLOCK_TOL)


@pytest.mark.parametrize(("method", "block_size"), FORMS)
def test_sharded_jit_matches_full_batch(mesh, method, block_size):
    """Plain jit over rows sharded with NamedSharding (explicit axes), no axis_name."""
    inputs, want = full_batch()
    f = jax.value_and_grad(functools.partial(loss, method=method, block_size=block_size), (0, 1, 4))
    got = jax.jit(f)(*shard(mesh, *inputs), jnp.float32(0.6))
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)
    for g in got[1][:2]:  # the rows' gradients keep the rows' sharding
        assert jax.typeof(g).sharding.spec[0] == "d"


def test_sharded_jit_with_token_dim_sharded_over_another_axis():
    """A (data=4, model=2) mesh, the token vectors' dim split over "model"."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:D])
    inputs, want = full_batch()
    q, d, q_mask, d_mask = inputs
    vectors = NamedSharding(mesh, P("data", None, "model"))
    masks = NamedSharding(mesh, P("data"))
    placed = [jax.device_put(v, vectors) for v in (q, d)] + [
        jax.device_put(m, masks) for m in (q_mask, d_mask)
    ]
    for block_size in (None, 2):
        f = jax.value_and_grad(functools.partial(loss, block_size=block_size), (0, 1, 4))
        got = jax.jit(f)(*placed, jnp.float32(0.6))
        chex.assert_trees_all_close(got, want, **BLOCK_TOL)


# Inside the gradient cache: an encoder with a token axis, returning its mask too.


def token_tower(name, one_hot=False):
    """``encode(params, batch, key) -> (vectors [rows, len, WIDTH], mask [rows, len])``:
    one masked attention layer per token, no pooling (test_token_chunks' transformer).
    ``one_hot``: the lookup as a product, which traces under explicit mesh axes."""

    def encode(params, batch, key):
        p = params[name]
        ids, mask = batch["input_ids"], batch["attention_mask"]
        x = (jax.nn.one_hot(ids, VOCAB) @ p["emb"] if one_hot else p["emb"][ids]) + p["pos"][
            : ids.shape[1]
        ]
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        s = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(WIDTH)
        x = x + jax.nn.softmax(jnp.where(mask[:, None, :] > 0, s, -1e9), axis=-1) @ v
        return jnp.tanh(x @ p["out"]), mask

    return encode


def loss_fn(params, q, d, **kw):
    """``q`` and ``d`` are the encoders' (vectors, mask) pairs."""
    t = jnp.exp(params["log_temp"])
    return maxsim_loss(q[0], d[0], q_mask=q[1], d_mask=d[1], temperature=t, **kw)


def towers(one_hot=False):
    return [token_tower("q", one_hot), token_tower("d", one_hot)]


def want_full_batch(params, q, d, one_hot=False):
    encs = towers(one_hot)
    full = lambda p: loss_fn(p, encs[0](p, q, None), encs[1](p, d, None))
    return jax.jit(jax.value_and_grad(full))(params)


BUDGET = gc_jax.TokenBudget(tokens=48, buckets=BUCKETS)  # chunks of 12x4, 6x8, 3x16


@pytest.mark.parametrize("chunk_size", [BUDGET], ids=["budget"])  # rows: across devices
def test_cached_value_and_grad_chunked_encoder_and_train_step(chunk_size):
    params = make_params()
    q, d = text_batch(20, "bimodal", 1), text_batch(40, "uniform", 2)
    want = want_full_batch(params, q, d)
    blockwise = functools.partial(loss_fn, block_size=7)
    got = jax.jit(gc_jax.cached_value_and_grad(blockwise, towers(), chunk_size))(params, q, d)
    chex.assert_trees_all_close(got, want, **TOL)

    enc_q, enc_d = (gc_jax.chunked_encoder(e, chunk_size) for e in towers())
    total = lambda p: blockwise(p, enc_q(p, q), enc_d(p, d))
    chex.assert_trees_all_close(jax.jit(jax.value_and_grad(total))(params), want, **TOL)

    opt = optax.sgd(0.1)
    step = jax.jit(gc_jax.make_train_step(blockwise, towers(), chunk_size, optimizer=opt))
    (new, _), metrics = step((params, opt.init(params)), q, d)
    chex.assert_trees_all_close(metrics["loss"], want[0], **TOL)
    chex.assert_trees_all_close(new, jax.tree.map(lambda p, g: p - 0.1 * g, params, want[1]), **TOL)


def test_testing_reference_takes_token_outputs():
    """``gc_jax.testing`` with a budget and token-vector outputs: the padded batch's
    vectors past each row's bucket are cut as the cache holds them, so an exact
    encoder passes (its padding vectors are nonzero) and one whose vectors see the
    padding still fails the trimming check."""
    params = make_params()
    q, d = text_batch(12, "bimodal", 5), text_batch(12, "uniform", 6)
    check = gc_jax.testing.assert_matches_full_batch
    for rng in (None, jax.random.key(1)):
        check(loss_fn, towers(), BUDGET, params, q, d, rng=rng, **TOL)

    def sees_padding(p, batch, key):  # every position's vector moved by an unmasked mean
        vectors, mask = towers()[1](p, batch, key)
        return vectors + p["d"]["emb"][batch["input_ids"]].mean(1, keepdims=True), mask

    with pytest.raises(AssertionError, match="trimmed to their bucket's length"):
        check(loss_fn, [towers()[0], sees_padding], BUDGET, params, q, d, **TOL)


def test_token_budget_caches_token_outputs_padded_with_zeros():
    """The cache of a [rows, len, dim] output is [B, L, dim]: the encoder's values up to
    the length of the bucket the row was encoded in, zero after it (a bucket's leftover
    rows move up to the next); the mask output is the batch's mask."""
    params, (enc, _) = make_params(), towers()
    batch = text_batch(30, "bimodal", 3)
    vectors, mask = jax.jit(gc_jax.chunked_encoder(enc, BUDGET))(params, batch)
    assert vectors.shape == (30, PADDED, WIDTH) and mask.shape == (30, PADDED)
    np.testing.assert_array_equal(mask, batch["attention_mask"])
    full, _ = enc(params, batch, None)
    lengths = np.asarray(batch["attention_mask"]).sum(1)
    position = np.arange(PADDED)[None, :, None]
    for row, length in enumerate(lengths):  # its bucket: the first that holds it, or a later
        cut = [np.where(position[0] < n, full[row], 0.0) for n in BUCKETS if n >= length]
        assert any(np.allclose(vectors[row], c, **TOL) for c in cut), row


def test_token_budget_per_row_outputs_as_wide_as_a_bucket_are_not_token_axes():
    """Pooled outputs 8 (a bucket) and 16 (the padded length) wide stay per row."""
    params, (enc, _) = make_params(), towers()

    def pooled(p, batch, key):
        x, mask = enc(p, batch, key)
        mean = (x * mask[..., None]).sum(1) / jnp.maximum(mask.sum(1, keepdims=True), 1)
        return jnp.concatenate([mean, mean], axis=-1), mean  # [rows, 16], [rows, 8]

    loss = lambda p, q, d: contrastive_loss(q[0], d[0]) + contrastive_loss(q[1], d[1])
    q, d = text_batch(20, "uniform", 4), text_batch(20, "bimodal", 5)
    got = jax.jit(gc_jax.cached_value_and_grad(loss, pooled, BUDGET))(params, q, d)
    total = lambda p: loss(p, pooled(p, q, None), pooled(p, d, None))
    chex.assert_trees_all_close(got, jax.jit(jax.value_and_grad(total))(params), **TOL)


def test_token_budget_still_rejects_outputs_of_other_lengths():
    params, (enc, _) = make_params(), towers()
    half = lambda p, batch, key: enc(p, batch, key)[0][:, ::2]  # [rows, len / 2, dim]
    step = gc_jax.cached_value_and_grad(lambda p, q: jnp.sum(q), half, BUDGET)
    with pytest.raises(ValueError, match="or have the chunk's tokens as axis 1"):
        step(params, text_batch(20, "uniform", 6))


@pytest.mark.parametrize(
    ("method", "chunk_size"), [("gather", 3), ("ring", BUDGET)], ids=["gather-rows", "ring-budget"]
)
def test_cached_value_and_grad_across_devices(mesh, method, chunk_size):
    """shard_map (axis_name) and sharded jit (explicit axes), a plan per device."""
    params = make_params()
    q, d = text_batch(32, "bimodal", 7), text_batch(64, "uniform", 8)
    want = want_full_batch(params, q, d, one_hot=True)
    kw = {"block_size": 3, "method": method}
    inner = functools.partial(loss_fn, axis_name="d", **kw)
    step = gc_jax.cached_value_and_grad(inner, towers(True), chunk_size, axis_name="d")
    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    qs, ds = shard(mesh, q, d)
    chex.assert_trees_all_close(jax.jit(f)(params, qs, ds), want, **TOL)
    step = gc_jax.cached_value_and_grad(functools.partial(loss_fn, **kw), towers(True), chunk_size)
    chex.assert_trees_all_close(jax.jit(step)(params, qs, ds), want, **TOL)
