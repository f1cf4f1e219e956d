"""Cached sparse (SPLADE) encoders: the pooling, the regularisers with their schedules,
the dot-product loss on vocabulary-sized rows (dense, blockwise, ring on 8 devices),
against float64 references; and ``examples/splade.py``'s tiny masked-LM retriever, one
cached step exact against the full batch, trained briefly.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import splade  # examples/ (pytest's pythonpath)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax.losses import (
    contrastive_loss,
    flops_regularizer,
    l1_regularizer,
    quadratic_warmup,
    sparse_regularizer,
    splade_pool,
)

D = 8
VOCAB = 30_522  # BERT's vocabulary, SPLADE's
TOL = {"rtol": 2e-5, "atol": 2e-6}


def naive_pool(logits, mask):
    w = np.log1p(np.maximum(logits, 0)) * mask[..., None]
    return w.max(axis=-2)


def test_splade_pool_matches_its_definition():
    k1, k2 = jax.random.split(jax.random.key(0))
    logits = jax.random.normal(k1, (3, 5, 40)) * 2
    mask = jax.random.bernoulli(k2, 0.7, (3, 5)).at[2].set(False)  # row 2: no tokens
    with jax.enable_x64(True):
        want = naive_pool(np.asarray(logits, np.float64), np.asarray(mask))
    got = jax.jit(functools.partial(splade_pool, dtype=None))(logits, mask)
    chex.assert_trees_all_close(got, want, **TOL)
    assert not np.any(np.asarray(got[2])) and np.all(np.asarray(got) >= 0)
    chex.assert_trees_all_close(jax.jit(splade_pool)(logits, mask), want, rtol=4e-3)
    assert splade_pool(logits).dtype == jnp.bfloat16
    # Gradient: through each entry's maximising, unmasked, positive logit only.
    grad = jax.grad(lambda z: jnp.sum(splade_pool(z, mask, dtype=None)))(logits)
    assert not np.any(np.asarray(grad)[~np.asarray(mask)]) and not np.any(np.asarray(grad)[2])
    with pytest.raises(ValueError, match="mask must have the logits' shape"):
        splade_pool(logits, mask[:, :3])
    with pytest.raises(ValueError, match="tokens, vocab"):
        splade_pool(jnp.ones(4))


def test_regularizers_weights_and_schedules():
    """Each side's own weight (a number or a schedule of a traced step) and kind."""
    q, d = (jax.nn.relu(jax.random.normal(k, (n, 50))) for k, n in
            zip(jax.random.split(jax.random.key(1)), (6, 12), strict=True))  # fmt: skip
    schedule = quadratic_warmup(2e-3, warmup_steps=10)
    for t in (0, 3, 10, 50):
        assert float(schedule(t)) == pytest.approx(2e-3 * min(t / 10, 1) ** 2)
    with jax.enable_x64(True):
        q64, d64 = np.asarray(q, np.float64), np.asarray(d, np.float64)
        flops = lambda w: np.sum(np.mean(np.abs(w), 0) ** 2)
        l1 = lambda w: np.mean(np.sum(np.abs(w), 1))

        def want(step):
            return 0.5 * l1(q64) + 2e-3 * min(step / 10, 1) ** 2 * flops(d64)

    reg = jax.jit(functools.partial(sparse_regularizer, query_weight=0.5, doc_weight=schedule,
                                    query_kind="l1"))  # fmt: skip
    for t in (0, 4, 20):
        assert float(reg(q, d, step=jnp.int32(t))) == pytest.approx(want(t), rel=1e-5)
    # An optax schedule works as a weight too.
    linear = optax.linear_schedule(0.0, 1.0, transition_steps=4)
    got = sparse_regularizer(q, d, query_weight=linear, doc_weight=linear, step=2)
    assert float(got) == pytest.approx(0.5 * (flops(q64) + flops(d64)), rel=1e-5)
    assert float(flops_regularizer(q)) == pytest.approx(flops(q64), rel=1e-5)
    assert float(l1_regularizer(q)) == pytest.approx(l1(q64), rel=1e-5)
    with pytest.raises(ValueError, match="pass step="):
        sparse_regularizer(q, d, query_weight=schedule, doc_weight=1.0)
    with pytest.raises(ValueError, match="doc_kind must be one of"):
        sparse_regularizer(q, d, query_weight=1.0, doc_weight=1.0, doc_kind="l2")
    with pytest.raises(ValueError, match="warmup_steps"):
        quadratic_warmup(1.0, 0)


# The dot-product loss on vocabulary-sized rows, plus the regulariser, float64 reference.


def _sparse_rows(n, k, seed, vocab=VOCAB, active=200):
    """Non-negative rows with about ``active`` non-zeros each, SPLADE-like."""
    keys = jax.random.split(jax.random.key(seed), 4)
    rows = []
    for key_v, key_m, m in ((keys[0], keys[1], n), (keys[2], keys[3], n * k)):
        values = jax.random.exponential(key_v, (m, vocab)) * 0.3
        rows.append(jnp.where(jax.random.bernoulli(key_m, active / vocab, (m, vocab)), values, 0))
    return rows


def sparse_objective(q, d, *, axis_name=None, **kw):
    nce = contrastive_loss(q, d, axis_name=axis_name, **kw)
    return nce + sparse_regularizer(q, d, query_weight=3e-4, doc_weight=1e-4, axis_name=axis_name)


def _reference(q, d, k):
    with jax.enable_x64(True):

        def loss(q, d):
            logits = q @ d.T
            targets = k * jnp.arange(len(q))
            nce = jnp.mean(jax.nn.logsumexp(logits, 1) - logits[jnp.arange(len(q)), targets])
            flops = lambda w: jnp.sum(jnp.mean(jnp.abs(w), 0) ** 2)
            return nce + 3e-4 * flops(q) + 1e-4 * flops(d)

        q64, d64 = (np.asarray(v, np.float64) for v in (q, d))
        return jax.tree.map(np.asarray, jax.value_and_grad(loss, (0, 1))(q64, d64))


@pytest.mark.parametrize("block_size", [None, 5])
def test_vocabulary_sized_rows_on_one_device(block_size):
    q, d = _sparse_rows(12, 2, seed=2)
    want = _reference(q, d, 2)
    f = jax.jit(
        jax.value_and_grad(functools.partial(sparse_objective, block_size=block_size), (0, 1))
    )
    chex.assert_trees_all_close(f(q, d), want, **TOL)


@pytest.mark.parametrize("method", ["gather", "ring"])
def test_vocabulary_sized_rows_across_devices(method):
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices: XLA_FLAGS=--xla_force_host_platform_device_count={D}")
    mesh = jax.make_mesh((D,), ("d",), devices=jax.devices()[:D])
    q, d = _sparse_rows(D * 2, 2, seed=3)
    want = _reference(q, d, 2)
    per_device = functools.partial(sparse_objective, axis_name="d", method=method, block_size=2)
    f = jax.shard_map(jax.value_and_grad(per_device, (0, 1)), mesh=mesh,
                      in_specs=(P("d"), P("d")), out_specs=(P(), (P("d"), P("d"))))  # fmt: skip
    rows = NamedSharding(mesh, P("d"))
    got = jax.jit(f)(jax.device_put(q, rows), jax.device_put(d, rows))
    chex.assert_trees_all_close(got, want, **TOL)


def test_bfloat16_cache_costs_a_bounded_rounding():
    """The cost of bfloat16 sparse rows: 8 significant bits per weight. The loss and its
    gradient, computed from the rounded rows (float32 accumulation), stay within 1 %
    of the float32 rows' (docs/recipes.md gives the measured figures)."""
    q, d = _sparse_rows(16, 2, seed=4)
    f = jax.jit(jax.value_and_grad(sparse_objective, (0, 1)))
    v32, g32 = f(q, d)
    v16, g16 = f(q.astype(jnp.bfloat16), d.astype(jnp.bfloat16))
    assert g16[0].dtype == jnp.bfloat16 and v16.dtype == jnp.float32
    assert abs(float(v16) - float(v32)) <= 1e-2 * abs(float(v32))
    for a, b in zip(g16, g32, strict=True):
        err = np.linalg.norm(np.asarray(a, np.float32) - b) / np.linalg.norm(b)
        assert err <= 1e-2, err


# The worked example: examples/splade.py.

CONFIG = splade.Config(vocab=64, hidden=8, query_tokens=3, doc_tokens=6, warmup_steps=4)


def test_the_example_step_is_exact_against_the_full_batch():
    """One cached step (chunks of 4 rows) against plain jax.value_and_grad of the whole
    batch in float64, with the masked-LM head's SPLADE vectors in float64 too."""
    params = splade.init(CONFIG, jax.random.key(0))
    queries, docs = splade.make_pairs(CONFIG, 10, seed=1)
    queries["mask"] = queries["mask"].at[3, 2].set(False)  # a padded query token
    step = jnp.int32(2)
    loss = functools.partial(splade.loss_fn, config=CONFIG)
    got = jax.jit(gc_jax.cached_value_and_grad(loss, splade.encode, chunk_size=4))(
        params, queries, docs, step=step
    )
    with jax.enable_x64(True):
        enc = lambda p, b: splade_pool(
            splade.mlm_logits(p, b["ids"], b["mask"]), b["mask"], dtype=None
        )
        total = lambda p: loss(p, enc(p, queries), enc(p, docs), step=step)
        p64 = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
        want = jax.tree.map(np.asarray, jax.value_and_grad(total)(p64))
    # bfloat16 representations: the loss and gradient within bfloat16 rounding.
    chex.assert_trees_all_close(got[0], want[0], rtol=1e-2)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        assert np.linalg.norm(np.asarray(g) - w) <= 3e-2 * np.linalg.norm(w) + 1e-6
    # And exactly (float32 against float64) with float32 representations.
    exact_encode = lambda p, b, key: enc(p, b).astype(jnp.float32)
    got = jax.jit(gc_jax.cached_value_and_grad(loss, exact_encode, chunk_size=4))(
        params, queries, docs, step=step
    )
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_example_trains_sparser_and_better():
    lines = []
    _, history = splade.train(CONFIG, steps=30, batch=32, chunk=8, lr=1e-2, log_every=29,
                              log=lines.append)  # fmt: skip
    first, last = history[0], history[-1]
    assert len(lines) == len(history) == 2
    assert last["loss"] < first["loss"]
    assert last["recall_at_1"] > first["recall_at_1"]
    assert last["nonzeros_d"] < first["nonzeros_d"] and last["nonzeros_q"] < first["nonzeros_q"]
