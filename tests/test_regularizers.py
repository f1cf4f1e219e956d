"""EmbeddingGemma's terms (spread-out regulariser, embedding distillation) and SPLADE's
regularisers, against naive float64 references: alone, across 8 devices (shard_map with
and without vma checks, pmap, sharded jit with explicit and auto axes), and composed
with ``contrastive_loss`` and ``matryoshka`` in one loss inside
``cached_value_and_grad`` and ``make_train_step``.

The references compute every term from its definition over the whole batch (the
``N x N`` pair matrix, per-row distances), in float64, with plain ``jax.grad``.
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

import gc_jax
from gc_jax.losses import (
    contrastive_loss,
    embedding_distillation,
    flops_regularizer,
    l1_regularizer,
    matryoshka,
    sparse_regularizer,
    splade_pool,
    spread_out_regularizer,
)

D = 8  # devices
VARIANTS = ("second_moment", "gor")
TOL = {"rtol": 2e-5, "atol": 2e-6}  # float32 against float64


# The naive references: every term from its definition, whole batch, float64.


def naive_spread_out(x, variant="second_moment"):
    n, dim = x.shape
    products = x @ x.T
    pairs = ~jnp.eye(n, dtype=bool)  # every i != j
    m1 = jnp.sum(jnp.where(pairs, products, 0)) / (n * (n - 1))
    m2 = jnp.sum(jnp.where(pairs, products**2, 0)) / (n * (n - 1))
    return m2 if variant == "second_moment" else m1**2 + jnp.maximum(m2 - 1 / dim, 0)


def naive_distillation(s, t, metric="squared_l2"):
    t = jax.lax.stop_gradient(t)
    if metric == "squared_l2":
        return jnp.mean(jnp.sum((s - t) ** 2, axis=1))
    cos = jnp.sum(s * t, 1) / (jnp.linalg.norm(s, axis=1) * jnp.linalg.norm(t, axis=1))
    return jnp.mean(1 - cos)


def naive_flops(w):
    return jnp.sum(jnp.mean(jnp.abs(w), axis=0) ** 2)


def naive_l1(w):
    return jnp.mean(jnp.sum(jnp.abs(w), axis=1))


# (term under test, its naive reference), each a function of rows (x, t).
TERMS = {
    "spread_out": (spread_out_regularizer, naive_spread_out),
    "spread_out_gor": (
        functools.partial(spread_out_regularizer, variant="gor"),
        functools.partial(naive_spread_out, variant="gor"),
    ),
    "distill_l2": (embedding_distillation, naive_distillation),
    "distill_cosine": (
        functools.partial(embedding_distillation, metric="cosine"),
        functools.partial(naive_distillation, metric="cosine"),
    ),
    "flops": (flops_regularizer, naive_flops),
    "l1": (l1_regularizer, naive_l1),
}
TWO_INPUTS = ("distill_l2", "distill_cosine")


def _call(name, fn, x, t, **kw):
    return fn(x, t, **kw) if name in TWO_INPUTS else fn(x, **kw)


def _rows(n, dim, seed, shift=0.0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (n, dim)) / np.sqrt(dim) + shift
    t = x + 0.3 * jax.random.normal(k2, (n, dim)) / np.sqrt(dim)
    return x, t


def _reference(name, x, t):
    """Value and gradient with respect to x of the naive term, in float64."""
    _, naive = TERMS[name]
    with jax.enable_x64(True):
        x64, t64 = (np.asarray(v, np.float64) for v in (x, t))
        value, grad = jax.jit(jax.value_and_grad(lambda x: _call(name, naive, x, t64)))(x64)
        return np.asarray(value), np.asarray(grad)


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < D:
        pytest.skip(f"needs {D} devices: XLA_FLAGS=--xla_force_host_platform_device_count={D}")
    return jax.make_mesh((D,), ("d",), devices=jax.devices()[:D])


@pytest.mark.parametrize("name", list(TERMS))
def test_matches_the_float64_definition(name):
    term, _ = TERMS[name]
    x, t = _rows(24, 8, seed=1, shift=0.1)  # a common direction: M1 and the hinge active
    want = _reference(name, x, t)
    got = jax.jit(jax.value_and_grad(lambda x, t: _call(name, term, x, t)))(x, t)
    chex.assert_trees_all_close(got, want, **TOL)
    with jax.enable_x64(True):  # in float64 the Gram-matrix form is the pairwise one
        x64, t64 = (np.asarray(v, np.float64) for v in (x, t))
        got = jax.jit(jax.value_and_grad(lambda x, t: _call(name, term, x, t)))(x64, t64)
        assert got[0].dtype == jnp.float64
        chex.assert_trees_all_close(got, want, rtol=1e-12, atol=1e-14)


def _nearly_orthogonal(n, dim, seed=0):
    """Unit rows near the first ``n`` axes: ``M2`` about 2e-5, far below ``1/d``."""
    x = jnp.eye(dim)[:n] + 3e-3 * jax.random.normal(jax.random.key(seed), (n, dim))
    return x / jnp.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_nearly_orthogonal_rows_keep_float32_precision(variant):
    """With at most ``d`` rows the term sums the pairs' products directly: float32 within
    1e-5 of float64 (value and gradient) where the Gram form's ``|G|^2 - sum |x|^4``
    cancels (1e-3 here). GOR's hinge is off (``M2 < 1/d``): ``M1^2`` alone."""
    x = _nearly_orthogonal(6, 8)
    value, grad = _reference("spread_out" if variant == "second_moment" else "spread_out_gor",
                             x, x)  # fmt: skip
    assert value < 1e-4
    f = jax.jit(jax.value_and_grad(functools.partial(spread_out_regularizer, variant=variant)))
    chex.assert_trees_all_close(f(x), (value, grad), rtol=1e-5, atol=1e-7 * np.abs(grad).max())


def test_nearly_orthogonal_rows_across_devices(mesh):
    """The same across 8 devices: each device pairs its rows with every device's."""
    x = _nearly_orthogonal(2 * D, 24, seed=1)
    want = _reference("spread_out", x, x)
    per_device = jax.value_and_grad(functools.partial(spread_out_regularizer, axis_name="d"))
    for check_vma in (True, False):
        f = jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=(P(), P("d")),
                          check_vma=check_vma)  # fmt: skip
        got = jax.jit(f)(*_sharded(mesh, x))
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7 * np.abs(want[1]).max())


def test_bfloat16_rows_float32_term_bfloat16_gradients():
    x, t = _rows(16, 8, seed=2)
    for name, (term, _) in TERMS.items():
        f = jax.value_and_grad(lambda x, name=name, term=term: _call(name, term, x, t))
        value, grad = jax.jit(f)(x.astype(jnp.bfloat16))
        assert value.dtype == jnp.float32 and grad.dtype == jnp.bfloat16, name
        want = _reference(name, x.astype(jnp.bfloat16).astype(jnp.float32), t)
        chex.assert_trees_all_close(value, want[0], rtol=1e-4)


def test_no_gradient_reaches_the_teacher():
    x, t = _rows(8, 4, seed=3)
    for metric in ("squared_l2", "cosine"):
        grad = jax.grad(functools.partial(embedding_distillation, x, metric=metric))(t)
        assert not np.any(np.asarray(grad)), metric


# Across 8 devices: each term is a function of the whole (global) batch.


def _sharded(mesh, *values):
    return [jax.device_put(v, NamedSharding(mesh, P("d"))) for v in values]


@pytest.mark.parametrize("name", list(TERMS))
def test_across_devices(mesh, name):
    term, _ = TERMS[name]
    x, t = _rows(D * 3, 8, seed=4, shift=0.1)
    want = _reference(name, x, t)
    xs, ts = _sharded(mesh, x, t)
    per_device = jax.value_and_grad(lambda x, t: _call(name, term, x, t, axis_name="d"))
    specs = {"in_specs": (P("d"), P("d")), "out_specs": (P(), P("d"))}
    for check_vma in (True, False):  # replicated-typed losses, and pmap-style values
        f = jax.shard_map(per_device, mesh=mesh, check_vma=check_vma, **specs)
        chex.assert_trees_all_close(jax.jit(f)(xs, ts), want, **TOL)
    split = lambda v: v.reshape(D, 3, -1)
    value, grad = jax.pmap(per_device, axis_name="d")(split(x), split(t))
    chex.assert_trees_all_close((value[0], grad.reshape(x.shape)), want, **TOL)
    # Sharded jit: explicit axes from the types; auto axes named with jax.set_mesh.
    whole = jax.jit(jax.value_and_grad(lambda x, t: _call(name, term, x, t)))
    chex.assert_trees_all_close(whole(xs, ts), want, **TOL)
    auto = jax.make_mesh((D,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    named = jax.jit(jax.value_and_grad(lambda x, t: _call(name, term, x, t, axis_name="d")))
    with jax.set_mesh(auto):
        xa, ta = (jax.device_put(v, NamedSharding(auto, P("d"))) for v in (x, t))
        chex.assert_trees_all_close(named(xa, ta), want, **TOL)


# EmbeddingGemma's loss over one cache: NCE with a hard negative, the spread-out term on
# queries and on positives, distillation of queries, positives and hard negatives, under
# Matryoshka widths (teacher truncated with the student).

DIMS, WEIGHTS = (16, 8, 4), (1.0, 0.5, 0.25)
TEMPERATURE, SPREAD, DISTILL = 0.1, 0.5, 2.0


def gemma_terms(params, q, d, tq, td, *, contrastive, spread, distill, axis_name=None):
    positives, negatives = d[::2], d[1::2]  # k = 2 documents per query
    kw = {"axis_name": axis_name}
    nce = contrastive(q, d, temperature=TEMPERATURE, **kw)
    spread_out = spread(q, **kw) + spread(positives, **kw)
    distilled = (
        distill(q, tq, **kw)
        + distill(positives, td[::2], **kw)
        + distill(negatives, td[1::2], **kw)
    )
    return nce + SPREAD * spread_out + DISTILL * distilled


def naive_contrastive(q, d, temperature, axis_name=None):
    logits = q @ d.T / temperature
    targets = 2 * jnp.arange(len(q))
    return jnp.mean(jax.nn.logsumexp(logits, 1) - logits[jnp.arange(len(q)), targets])


def gemma_loss(contrastive=contrastive_loss, naive=False, **kw):
    """``loss_fn(params, q, d, *, teacher)`` for the gradient cache: every width."""
    terms = functools.partial(
        gemma_terms,
        contrastive=functools.partial(naive_contrastive if naive else contrastive, **kw),
        spread=(lambda x, axis_name=None: naive_spread_out(x)) if naive else spread_out_regularizer,
        distill=(lambda s, t, axis_name=None: naive_distillation(s, t))
        if naive
        else embedding_distillation,
    )
    mrl = matryoshka(terms, DIMS, weights=WEIGHTS, argnums=(1, 2, 3, 4))

    def loss_fn(params, q, d, *, teacher, axis_name=None):
        return mrl(params, q, d, *teacher, axis_name=axis_name)

    return loss_fn


def encode(params, x, key):
    return jnp.tanh(x @ params["w"])


def _gemma_batch(n, seed=5):
    kq, kd, kt, kw = jax.random.split(jax.random.key(seed), 4)
    q, d = jax.random.normal(kq, (n, 12)), jax.random.normal(kd, (2 * n, 12))
    teacher_w = jax.random.normal(kt, (12, DIMS[0])) / 3
    teacher = (jnp.tanh(q @ teacher_w), jnp.tanh(d @ teacher_w))
    params = {"w": jax.random.normal(kw, (12, DIMS[0])) / 3}
    return params, q, d, teacher


def _gemma_reference(params, q, d, teacher):
    """The whole batch, float64, every term naive: value and parameter gradient."""
    loss = gemma_loss(naive=True)
    with jax.enable_x64(True):
        to64 = lambda tree: jax.tree.map(lambda v: np.asarray(v, np.float64), tree)
        p64, q64, d64, t64 = to64((params, q, d, teacher))
        total = lambda p: loss(p, encode(p, q64, None), encode(p, d64, None), teacher=t64)
        value, grads = jax.jit(jax.value_and_grad(total))(p64)
        return jax.tree.map(np.asarray, (value, grads))


@pytest.mark.parametrize("form", [{}, {"block_size": 3}])
def test_gemma_loss_on_one_device(form):
    params, q, d, teacher = _gemma_batch(10)
    want = _gemma_reference(params, q, d, teacher)
    grad_fn = gc_jax.cached_value_and_grad(gemma_loss(**form), encode, chunk_size=4)
    chex.assert_trees_all_close(jax.jit(grad_fn)(params, q, d, teacher=teacher), want, **TOL)


@pytest.mark.parametrize("method", ["gather", "ring"])
def test_gemma_loss_cached_inside_shard_map(mesh, method):
    params, q, d, teacher = _gemma_batch(D * 2)
    want = _gemma_reference(params, q, d, teacher)
    loss = gemma_loss(method=method, block_size=2)
    grad_fn = gc_jax.cached_value_and_grad(loss, encode, chunk_size=1, axis_name="d")
    per_device = lambda p, q, d, tq, td: grad_fn(p, q, d, teacher=(tq, td), axis_name="d")
    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), *[P("d")] * 4), out_specs=(P(), P()))
    got = jax.jit(f)(params, *_sharded(mesh, q, d, *teacher))
    chex.assert_trees_all_close(got, want, **TOL)


def test_gemma_loss_in_make_train_step_over_a_mesh(mesh):
    """Sharded jit (explicit axes): the terms read the layout from the rows' types."""
    params, q, d, teacher = _gemma_batch(D * 2)
    want_value, want_grads = _gemma_reference(params, q, d, teacher)
    opt = optax.sgd(0.1)
    step = jax.jit(gc_jax.make_train_step(gemma_loss(), encode, 2, optimizer=opt))
    qs, ds, tq, td = _sharded(mesh, q, d, *teacher)
    (new, _), metrics = step((params, opt.init(params)), qs, ds, teacher=(tq, td))
    chex.assert_trees_all_close(metrics["loss"], want_value, **TOL)
    updated = jax.tree.map(lambda p, g: p - 0.1 * g, params, want_grads)
    chex.assert_trees_all_close(new, updated, **TOL)


# Clear errors.


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: spread_out_regularizer(jnp.ones((4, 2)), variant="first"), "variant must be"),
        (lambda: spread_out_regularizer(jnp.ones(4)), r"x must be a float \[rows, dim\]"),
        (lambda: embedding_distillation(jnp.ones((4, 2)), jnp.ones((4, 3))), "project the teacher"),
        (lambda: embedding_distillation(jnp.ones((4, 2)), jnp.ones((4, 2)), metric="l1"), "metric"),
        (lambda: flops_regularizer(jnp.ones((4, 2), jnp.int32)), "w must be a float"),
        # Shapes known at trace time: no 0/0.
        (lambda: spread_out_regularizer(jnp.ones((1, 4))), "x has 1 row in the global batch"),
        (lambda: flops_regularizer(jnp.ones((0, 4))), "w has 0 rows in the global batch"),
        (lambda: l1_regularizer(jnp.ones((0, 4))), "w has 0 rows"),
        (lambda: embedding_distillation(jnp.ones((0, 2)), jnp.ones((0, 2))), "student has 0 rows"),
        (lambda: sparse(jnp.ones((0, 4)), jnp.ones((2, 4))), "queries has 0 rows"),
        # sentence-transformers' options.
        (lambda: spread_out_regularizer(jnp.ones((4, 2)), mean_weight=0.5), "weighs a term of"),
        (lambda: gor(mean_weight=-1.0), "mean_weight must be a non-negative number"),
        (lambda: gor(second_moment_weight=True), "second_moment_weight must be a non-neg"),
        (lambda: gor(mean_weight=0.0, second_moment_weight=None), "leave variant='gor' no"),
        (lambda: flops_regularizer(jnp.ones((4, 2)), threshold=-1), "threshold must be None"),
        (
            lambda: sparse(jnp.ones((4, 2)), jnp.ones((4, 2)), doc_kind="l1", doc_threshold=2),
            "doc_threshold=2 applies to the FLOPS regulariser",
        ),
        (lambda: splade_pool(jnp.ones((2, 3, 4)), pooling_strategy="mean"), "pooling_strategy"),
        (lambda: splade_pool(jnp.ones((2, 3, 4)), activation_function="gelu"), "activation_fun"),
    ],
)
def test_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def gor(**weights):
    return spread_out_regularizer(jnp.ones((4, 2)), variant="gor", **weights)


sparse = functools.partial(sparse_regularizer, query_weight=1.0, doc_weight=1.0)


# Rows passed replicated (in_specs=P()) with axis_name: every device would count them as
# its own. A typed shard_map sees it and raises, as the losses do.

REPLICATED = {  # name: (term of (x, t), in_specs, the argument named)
    "spread_out": (lambda x, t, **kw: spread_out_regularizer(x, **kw), (P(), P()), "x"),
    "flops": (lambda x, t, **kw: flops_regularizer(x, **kw), (P(), P()), "w"),
    "l1": (lambda x, t, **kw: l1_regularizer(x, **kw), (P(), P()), "w"),
    "distill": (lambda x, t, **kw: embedding_distillation(x, t, **kw), (P(), P()), "student"),
    "distill, teacher only": (  # the whole teacher's first 2 rows on every device
        lambda x, t, **kw: embedding_distillation(x, t[: len(x)], **kw),
        (P("d"), P()),
        "teacher",
    ),
    "sparse, docs": (
        lambda x, t, **kw: sparse(x, t, **kw),
        (P("d"), P()),
        "docs",
    ),
}


@pytest.mark.parametrize("name", list(REPLICATED))
def test_replicated_rows_raise_under_a_typed_shard_map(mesh, name):
    term, in_specs, arg = REPLICATED[name]
    x, t = _rows(2 * D, 4, seed=6)
    f = jax.shard_map(functools.partial(term, axis_name="d"), mesh=mesh, in_specs=in_specs,
                      out_specs=P())  # fmt: skip
    placed = [
        jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip((x, t), in_specs, strict=True)
    ]
    with pytest.raises(ValueError, match=rf"{arg} is replicated over mesh axes \['d'\]"):
        jax.jit(f)(*placed)


@pytest.mark.parametrize("name", ["spread_out", "flops"])
def test_replicated_rows_without_types_count_once_per_device(mesh, name):
    """Under shard_map(check_vma=False) (as under pmap) nothing says the rows are
    replicated: as the docstrings say, the term is that of the batch repeated once per
    device, and each device's gradient a share (1/8) of its gradient."""
    term, naive = TERMS[name]
    x, _ = _rows(6, 4, seed=6, shift=0.1)
    f = jax.shard_map(jax.value_and_grad(functools.partial(term, axis_name="d")), mesh=mesh,
                      in_specs=P(), out_specs=(P(), P()), check_vma=False)  # fmt: skip
    value, grad = jax.jit(f)(x)
    with jax.enable_x64(True):
        repeated = lambda x: naive(jnp.tile(x, (D, 1)))
        want = jax.jit(jax.value_and_grad(repeated))(np.asarray(x, np.float64))
        want_value, want_grad = (np.asarray(w) for w in want)
    chex.assert_trees_all_close((value, grad), (want_value, want_grad / D), **TOL)
