"""sentence-transformers 6.2's sparse and regulariser options in gc_jax, against float64
references that transcribe sentence-transformers' definitions line by line
(``SpladePooling.forward``, ``FlopsLoss.compute_loss_from_embeddings``,
``GlobalOrthogonalRegularizationLoss.compute_gor``, ``EmbedDistillLoss``), in
``jax.numpy`` with float64 and plain ``jax.grad`` for their gradients (torch and
sentence-transformers are not needed; ``benchmarks/peer_sentence_transformers.py``
compares with them): on one device, across 8 devices inside ``shard_map``, and in one
``cached_value_and_grad`` step.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax.losses import (
    embedding_distillation,
    flops_regularizer,
    sparse_regularizer,
    splade_pool,
    spread_out_regularizer,
)

D = 8
TOL = {"rtol": 2e-5, "atol": 2e-6}  # float32 against float64
EXACT = {"rtol": 1e-12, "atol": 1e-14}  # float64 against float64

# The references: sentence-transformers 6.2's code, transcribed.


def st_splade_pooling(logits, mask, pooling_strategy="max", activation_function="relu"):
    """SpladePooling.forward (no chunking): logits * mask, relu, log1p (twice for
    "log1p_relu"), then max or sum over the tokens."""
    x = jax.nn.relu(logits * mask[..., None].astype(logits.dtype))
    x = jnp.log1p(x)
    if activation_function == "log1p_relu":
        x = jnp.log1p(x)
    return jnp.max(x, axis=1) if pooling_strategy == "max" else jnp.sum(x, axis=1)


def st_flops(embeddings, threshold=None):
    """FlopsLoss.compute_loss_from_embeddings."""
    if threshold is not None:
        l0_norm = jnp.sum(embeddings != 0, axis=1)
        mask = (l0_norm > threshold).astype(embeddings.dtype)
        embeddings = embeddings * mask[:, None]
    return jnp.sum(jnp.mean(embeddings, axis=0) ** 2)


def cos_sim(a, b):
    """sentence_transformers.util.cos_sim: F.normalize (eps 1e-12), then a @ b.T."""
    unit = lambda v: v / jnp.maximum(jnp.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    return unit(a) @ unit(b).T


def st_gor(embeddings, mean_weight=1.0, second_moment_weight=1.0, similarity_fct=cos_sim):
    """GlobalOrthogonalRegularizationLoss on one column: compute_gor, weighted; the
    trainer sums the returned dict's terms."""
    batch_size, hidden_dim = embeddings.shape
    sim_matrix = similarity_fct(embeddings, embeddings)
    sim_matrix = sim_matrix * (1 - jnp.eye(batch_size))  # fill_diagonal_(0.0)
    num_off_diagonal = batch_size * (batch_size - 1)
    mean_term = (sim_matrix.sum() / num_off_diagonal) ** 2
    second_moment = (sim_matrix**2).sum() / num_off_diagonal
    second_moment_term = jax.nn.relu(second_moment - 1.0 / hidden_dim)
    return (mean_weight or 0) * mean_term + (second_moment_weight or 0) * second_moment_term


def st_embed_distill(student, teacher, distance_metric):
    """EmbedDistillLoss on one column (no projection); the teacher is detached."""
    teacher = jax.lax.stop_gradient(teacher)
    if distance_metric == "mse":
        return jnp.mean((student - teacher) ** 2)  # nn.functional.mse_loss
    if distance_metric == "l2":
        return jnp.mean(jnp.linalg.norm(student - teacher, axis=-1))
    eps = 1e-8  # nn.functional.cosine_similarity: each norm clamped at eps
    norm = lambda v: jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), eps)
    return jnp.mean(1 - jnp.sum(student / norm(student) * (teacher / norm(teacher)), axis=-1))


def dot_score(a, b):
    return a @ b.T


# The cases: (gc_jax term of rows (x, t), its reference). x: [rows, dim].

unit = lambda v: v / jnp.linalg.norm(v, axis=1, keepdims=True)
CASES = {
    "flops, threshold 3": (
        lambda x, t: flops_regularizer(jax.nn.relu(x), threshold=3),
        lambda x, t: st_flops(jax.nn.relu(x), threshold=3),
    ),
    "gor, dot": (
        lambda x, t: spread_out_regularizer(x, variant="gor"),
        lambda x, t: st_gor(x, similarity_fct=dot_score),
    ),
    "gor, cos_sim, mean_weight 0 (EmbeddingGemma)": (
        lambda x, t: spread_out_regularizer(unit(x), variant="gor", mean_weight=0.0),
        lambda x, t: st_gor(x, mean_weight=0.0),
    ),
    "gor, cos_sim, weights 0.5 and None": (
        lambda x, t: spread_out_regularizer(
            unit(x), variant="gor", mean_weight=0.5, second_moment_weight=None
        ),
        lambda x, t: st_gor(x, mean_weight=0.5, second_moment_weight=None),
    ),
    "distill, mse": (
        lambda x, t: embedding_distillation(x, t, metric="mse"),
        lambda x, t: st_embed_distill(x, t, "mse"),
    ),
    "distill, l2": (
        lambda x, t: embedding_distillation(x, t, metric="l2"),
        lambda x, t: st_embed_distill(x, t, "l2"),
    ),
    "distill, cosine": (
        lambda x, t: embedding_distillation(x, t, metric="cosine"),
        lambda x, t: st_embed_distill(x, t, "cosine"),
    ),
}


def _rows(n, dim=6, seed=0):
    """Rows with a common direction (M1 and GOR's hinge active), most entries positive
    (relu'd rows have 2 to 6 non-zeros: some at most 3), and their teacher's rows."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (n, dim)) + 0.8
    return x, x + 0.5 * jax.random.normal(k2, (n, dim))


def test_the_rows_exercise_every_option():
    x, _ = _rows(16)
    nonzeros = np.sum(np.asarray(jax.nn.relu(x)) != 0, axis=1)
    assert 0 < np.sum(nonzeros <= 3) < np.sum(nonzeros[:10] > 3)  # some dropped, most kept
    with jax.enable_x64(True):
        cosines = cos_sim(*[np.asarray(x[:10], np.float64)] * 2)
        m2 = (np.sum(np.asarray(cosines) ** 2) - 10) / 90
    assert m2 > 1 / 6  # the hinge max(0, M2 - 1/d) is active


def _reference(fn, *args):
    """Value and gradient of the first argument, float64."""
    with jax.enable_x64(True):
        args = [np.asarray(a, np.float64) for a in args]
        return jax.tree.map(np.array, jax.jit(jax.value_and_grad(fn))(*args))  # writable copies


@pytest.mark.parametrize("case", list(CASES))
def test_each_option_matches_sentence_transformers(case):
    term, reference = CASES[case]
    x, t = _rows(10)
    want = _reference(reference, x, t)
    chex.assert_trees_all_close(jax.jit(jax.value_and_grad(term))(x, t), want, **TOL)
    with jax.enable_x64(True):  # the same definitions: equal in float64
        x64, t64 = (np.asarray(v, np.float64) for v in (x, t))
        chex.assert_trees_all_close(jax.jit(jax.value_and_grad(term))(x64, t64), want, **EXACT)


def test_the_threshold_drops_rows_and_keeps_their_count():
    w = jnp.array([[1.0, 0, 0, 2.0], [1.0, 1.0, 1.0, 0], [0, 0, 0, 0]])
    assert float(flops_regularizer(w, threshold=2)) == pytest.approx(3 * (1 / 3) ** 2)
    assert float(flops_regularizer(w, threshold=0)) == pytest.approx(float(flops_regularizer(w)))
    grad = jax.grad(functools.partial(flops_regularizer, threshold=2))(w)
    assert not np.any(np.asarray(grad[0])) and np.all(np.asarray(grad[1, :3]) > 0)


@pytest.mark.parametrize("pooling_strategy", ["max", "sum"])
@pytest.mark.parametrize("activation_function", ["relu", "log1p_relu"])
def test_splade_pooling_options(pooling_strategy, activation_function):
    k1, k2 = jax.random.split(jax.random.key(1))
    logits = 2 * jax.random.normal(k1, (3, 5, 7))
    mask = jax.random.bernoulli(k2, 0.7, (3, 5)).at[2].set(False)  # row 2: no tokens
    opts = {"pooling_strategy": pooling_strategy, "activation_function": activation_function}
    pool = functools.partial(splade_pool, mask=mask, dtype=None, **opts)
    # A weighted sum of the weights: every entry's gradient matters.
    weights = jax.random.uniform(jax.random.key(2), (3, 7))
    mine = lambda z: jnp.sum(weights * pool(z))
    theirs = lambda z: jnp.sum(weights * st_splade_pooling(z, np.asarray(mask), **opts))
    want = _reference(theirs, logits)
    chex.assert_trees_all_close(jax.jit(jax.value_and_grad(mine))(logits), want, **TOL)
    assert not np.any(np.asarray(pool(logits))[2])


def test_cosine_distillation_of_an_all_zero_student_row_is_finite_as_torch():
    """torch clamps each norm at eps = 1e-8 without gradient, and differentiates the
    norm as 0 at 0: the zero row's loss is 1 and its gradient -t / (|t| eps N)."""
    x, t = _rows(4)
    x = x.at[1].set(0.0)
    value, grad = jax.jit(jax.value_and_grad(functools.partial(embedding_distillation,
                                                               metric="cosine")))(x, t)  # fmt: skip
    assert np.all(np.isfinite(np.asarray(grad)))
    want_value, want_grad = _reference(lambda x, t: st_embed_distill(x, t, "cosine"), x, t)
    # jax.grad of the reference is NaN on the zero row (the norm's derivative at 0);
    # torch's there, by hand:
    want_grad[1] = -np.asarray(t[1], np.float64) / np.linalg.norm(t[1]) / (1e-8 * len(x))
    chex.assert_trees_all_close((value, grad), (want_value, want_grad), **TOL)
    assert float(embedding_distillation(x[1:2], t[1:2], metric="cosine")) == 1.0
    # l2 at a student row equal to its teacher's: 0, as torch's norm.
    grad = jax.grad(functools.partial(embedding_distillation, metric="l2"))(t, t)
    assert np.all(np.asarray(grad) == 0)


# Across 8 devices, each device its rows (a typed shard_map, axis_name="d").


def test_options_across_devices():
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices: XLA_FLAGS=--xla_force_host_platform_device_count={D}")
    mesh = jax.make_mesh((D,), ("d",), devices=jax.devices()[:D])
    x, t = _rows(2 * D)

    def all_terms(x, t, **kw):  # every batch-wide option, summed with distinct weights
        return (
            flops_regularizer(jax.nn.relu(x), threshold=3, **kw)
            + 0.5 * spread_out_regularizer(x, variant="gor", mean_weight=0.3, **kw)
            + 2.0 * embedding_distillation(x, t, metric="mse", **kw)
            + 0.7 * embedding_distillation(x, t, metric="l2", **kw)
            + 1.3 * embedding_distillation(x, t, metric="cosine", **kw)
        )

    def reference(x, t):
        return (
            st_flops(jax.nn.relu(x), threshold=3)
            + 0.5 * st_gor(x, mean_weight=0.3, similarity_fct=dot_score)
            + 2.0 * st_embed_distill(x, t, "mse")
            + 0.7 * st_embed_distill(x, t, "l2")
            + 1.3 * st_embed_distill(x, t, "cosine")
        )

    want = _reference(reference, x, t)
    per_device = jax.value_and_grad(functools.partial(all_terms, axis_name="d"))
    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P(), P("d")))
    rows = NamedSharding(mesh, P("d"))
    got = jax.jit(f)(jax.device_put(x, rows), jax.device_put(t, rows))
    chex.assert_trees_all_close(got, want, **TOL)


# One cached step: a tiny masked-LM's SPLADE rows (sum pooling, log1p_relu) with every
# sparse option, and the same rows' GOR and distillation terms.

VOCAB, TOKENS, HIDDEN = 12, 3, 4


def mlm_logits(params, ids):
    h = jnp.tanh(params["embed"][ids] @ params["mix"])  # [rows, tokens, hidden]
    return h @ params["embed"].T + params["bias"]  # [rows, tokens, vocab]


def encode(params, ids, key, *, pool=splade_pool):
    opts = {"pooling_strategy": "sum", "activation_function": "log1p_relu"}
    if pool is splade_pool:
        opts["dtype"] = None
    return pool(mlm_logits(params, ids), jnp.ones(ids.shape, bool), **opts)


def cached_terms(params, q, d, *, teacher):
    return (
        sparse_regularizer(
            q, d, query_weight=0.3, doc_weight=0.2, query_threshold=4, doc_threshold=5
        )
        + spread_out_regularizer(q, variant="gor", mean_weight=0.0)
        + embedding_distillation(d, teacher, metric="l2")
    )


def reference_terms(params, q, d, *, teacher):  # SpladeLoss's regularisers, GOR, EmbedDistill
    return (
        0.3 * st_flops(q, threshold=4)
        + 0.2 * st_flops(d, threshold=5)
        + st_gor(q, mean_weight=0.0, similarity_fct=dot_score)
        + st_embed_distill(d, teacher, "l2")
    )


def test_in_a_cached_step():
    keys = jax.random.split(jax.random.key(3), 5)
    params = {
        "embed": jax.random.normal(keys[0], (VOCAB, HIDDEN)),
        "mix": jax.random.normal(keys[1], (HIDDEN, HIDDEN)),
        "bias": jnp.full((VOCAB,), -1.0),  # about half of the entries 0
    }
    q_ids, d_ids = (jax.random.randint(k, (8, TOKENS), 0, VOCAB) for k in keys[2:4])
    teacher = jax.random.uniform(keys[4], (8, VOCAB))
    rows = jax.jit(encode)(params, jnp.concatenate([q_ids, d_ids]), None)
    nonzeros = np.sum(np.asarray(rows) != 0, axis=1).reshape(2, 8)
    assert 0 < np.sum(nonzeros[0] <= 4) < 8 and 0 < np.sum(nonzeros[1] <= 5) < 8
    grad_fn = gc_jax.cached_value_and_grad(cached_terms, encode, chunk_size=4)
    got = jax.jit(grad_fn)(params, q_ids, d_ids, teacher=teacher)
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
        st_encode = functools.partial(encode, key=None, pool=st_splade_pooling)
        total = lambda p: reference_terms(
            p, st_encode(p, q_ids), st_encode(p, d_ids), teacher=np.asarray(teacher, np.float64)
        )
        want = jax.tree.map(np.asarray, jax.jit(jax.value_and_grad(total))(p64))
    chex.assert_trees_all_close(got, want, **TOL)
