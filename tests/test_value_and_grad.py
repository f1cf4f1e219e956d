"""cached_value_and_grad against plain full-batch jax.value_and_grad."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import full_batch_value_and_grad
from toy import batch, doc_tower, init_params, loss_fn, query_tower

import gc_jax


def check(loss_fn, encoders, chunk_size, *inputs, rng=None, has_aux=False, **kw):
    params = init_params()
    f = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, chunk_size, has_aux=has_aux))
    got = f(params, *inputs, rng=rng, **kw)
    want = full_batch_value_and_grad(
        loss_fn, encoders, chunk_size, params, *inputs, rng=rng, has_aux=has_aux, **kw
    )
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
    return got


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 10, 12, 100])
def test_chunk_sizes_match_full_batch(chunk_size):
    check(loss_fn, query_tower, chunk_size, *batch(12, 1))


@pytest.mark.parametrize("chunk_size", [(5, 2), (12, 1), [4, 7]])
def test_per_input_chunk_sizes(chunk_size):
    check(loss_fn, [query_tower, doc_tower], chunk_size, *batch(12, 2))


@pytest.mark.parametrize("k", [2, 4])
def test_hard_negatives(k):
    check(loss_fn, query_tower, 5, *batch(7, 3, k=k))


def test_tied_encoder_gets_summed_gradient():
    _, grads = check(loss_fn, query_tower, 4, *batch(9, 4))
    assert jnp.abs(grads["doc"]).max() == 0.0  # unused tower gets zero gradient
    assert jnp.abs(grads["w1"]).max() > 0.0


def test_loss_side_parameters_get_gradient():
    _, grads = check(loss_fn, [query_tower, doc_tower], 3, *batch(8, 5))
    assert grads["log_temp"] != 0.0


def test_loss_kwargs_reach_the_loss():
    (value, _) = check(loss_fn, query_tower, 3, *batch(8, 6), scale=2.0)
    (plain, _) = check(loss_fn, query_tower, 3, *batch(8, 6))
    assert not jnp.allclose(value, plain)


def test_has_aux():
    def loss_with_aux(params, q, d):
        value = loss_fn(params, q, d)
        return value, {"norm": jnp.linalg.norm(q, axis=-1).mean(), "value": value}

    (value, aux), _ = check(loss_with_aux, query_tower, 3, *batch(8, 7), has_aux=True)
    chex.assert_trees_all_close(aux["value"], value)


def test_dict_and_tuple_inputs():
    def encode_dict(params, x, key):
        return query_tower(params, x["tokens"] * x["mask"][:, None], key)

    def encode_tuple(params, x, key):
        a, b = x
        return doc_tower(params, a + b, key)

    q, d = batch(10, 8)
    q_dict = {"tokens": q, "mask": (jnp.arange(10) % 3 != 0).astype(jnp.float32)}
    check(loss_fn, [encode_dict, encode_tuple], 4, q_dict, (d, d * 0.5))


def test_pytree_representations():
    def encode(params, x, key):
        rep = query_tower(params, x, key)
        return {"rep": rep, "norm": jnp.linalg.norm(rep, axis=-1)}

    def loss(params, q, d):
        return loss_fn(params, q["rep"], d["rep"]) + 0.1 * jnp.mean(q["norm"] ** 2)

    check(loss, encode, 3, *batch(8, 9))


@pytest.mark.parametrize("chunk_size", [1, 3, 8])
def test_dropout_is_replayed_with_the_documented_keys(chunk_size):
    rng = jax.random.key(42)
    value, _ = check(loss_fn, query_tower, chunk_size, *batch(8, 10), rng=rng)
    no_dropout, _ = check(loss_fn, query_tower, chunk_size, *batch(8, 10))
    assert not jnp.allclose(value, no_dropout)  # dropout really was applied


def test_keys_follow_fold_in_rule():
    """Chunk c of input i is encoded with fold_in(fold_in(rng, i), c), in both passes."""
    seen = []

    def spy(params, x, key):
        jax.debug.callback(
            lambda k: seen.append(tuple(np.asarray(k).ravel())), jax.random.key_data(key)
        )
        return query_tower(params, x, None)

    q, d = batch(6, 11)
    rng = jax.random.key(3)
    f = jax.jit(gc_jax.cached_value_and_grad(lambda p, a, b: jnp.sum(a * b), spy, [2, 3]))
    jax.block_until_ready(f(init_params(), q, d, rng=rng))
    want = {
        tuple(
            np.asarray(
                jax.random.key_data(jax.random.fold_in(jax.random.fold_in(rng, i), c))
            ).ravel()
        )
        for i, chunks in enumerate([3, 2])
        for c in range(chunks)
    }
    assert set(seen) == want
    # Pass 1 encodes every chunk, pass 2 all but the kept last one: 2 * 5 - 1.
    assert len(seen) == 9, len(seen)


def test_works_with_donation_and_loss_scale():
    params = init_params()
    q, d = batch(8, 12)
    want = full_batch_value_and_grad(loss_fn, query_tower, 3, params, q, d)
    f = jax.jit(gc_jax.cached_value_and_grad(loss_fn, query_tower, 3), donate_argnums=0)
    got = f(init_params(), q, d, loss_scale=1024.0)
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    ("cache_dtype", "seen_dtype"), [(None, jnp.bfloat16), (jnp.float32, jnp.float32)]
)
def test_low_precision_encoder_cache_dtype(cache_dtype, seen_dtype):
    """A bfloat16 encoder's cache is bfloat16 by default (lossless), float32 on request."""

    def bf16_tower(params, x, key):
        p = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
        return query_tower(p, x.astype(jnp.bfloat16), key)

    seen = set()

    def loss(params, q, d):
        seen.add(q.dtype)
        return loss_fn(params, q, d)

    params = init_params()
    f = gc_jax.cached_value_and_grad(loss, bf16_tower, 3, cache_dtype=cache_dtype)
    value, grads = jax.jit(f)(params, *batch(8, 13))
    assert seen == {jnp.dtype(seen_dtype)}
    chex.assert_trees_all_equal_dtypes(grads, params)
    ref_value, ref = full_batch_value_and_grad(loss, bf16_tower, 3, params, *batch(8, 13))
    chex.assert_trees_all_close(value, ref_value, rtol=5e-3)
    chex.assert_trees_all_close(grads, ref, rtol=5e-2, atol=5e-2)


def test_integer_side_outputs_reach_the_loss_without_gradients():
    """Doc ids carried through the encoder to mask false negatives: no allow_int error."""

    def tower(p, x, key):
        return {"emb": query_tower(p, x["x"], key), "id": x["id"], "ok": x["id"] >= 0}

    def masked_loss(p, q, d):
        same = (q["id"][:, None] == d["id"][None, :]) & ~jnp.eye(len(q["id"]), dtype=bool)
        logits = (q["emb"] @ d["emb"].T) / jnp.exp(p["log_temp"]) - 1e4 * same
        return (
            -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(logits)), jnp.arange(len(logits))])
            + 0.0 * d["ok"].sum()
        )

    xq, xd = batch(8, 14)
    ids = jnp.array([0, 1, 1, 2, 3, 3, 4, 5], jnp.int32)
    check(masked_loss, tower, 3, {"x": xq, "id": ids}, {"x": xd, "id": ids})
