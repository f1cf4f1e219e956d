"""contrastive_loss's options on one device: directions, false-negative ids, a guide.

Every form (dense, blockwise with uneven blocks) is compared in value and in the
gradients of both sides and the temperature with the naive reference of
``options_reference`` (the definitions of sentence-transformers 6.2, masks decided
pair by pair). Across devices: tests/test_losses_options_sharded.py.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from options_reference import GTE, contrastive, dropped
from test_losses import BLOCK_TOL, TOL

import gc_jax
from gc_jax.losses import clip_loss, contrastive_loss, text_ids

GIST = ("query_to_doc", "query_to_query", "doc_to_doc")
SYMMETRIC = ("query_to_doc", "doc_to_query")


def data(n: int, k: int, seed: int = 0, dim: int = 5, guide_dim: int = 3):
    """Rows, a guide that agrees with the positives, and ids with many duplicates."""
    keys = jax.random.split(jax.random.key(seed), 7)
    x, y = jax.random.normal(keys[0], (n, dim)), jax.random.normal(keys[1], (n * k, dim))
    gx = jax.random.normal(keys[2], (n, guide_dim))
    gy = jax.random.normal(keys[3], (n * k, guide_dim))
    gy = gy.at[::k].set(gx + 0.7 * jax.random.normal(keys[4], (n, guide_dim)))
    unit = lambda g: g / jnp.linalg.norm(g, axis=1, keepdims=True)
    query_ids = jax.random.randint(keys[5], (n,), 0, max(2, n // 2))
    doc_ids = jax.random.randint(keys[6], (n * k,), 0, max(2, n * k // 2))
    return x, y, {"query_ids": query_ids, "doc_ids": doc_ids, "guide": (unit(gx), unit(gy))}


def _pick(arrays, *names):
    return {name: arrays[name] for name in names}


# name: (static options, arrays used, extra static options)
OPTIONS = {
    "gte": ({"directions": GTE}, ()),
    "symmetric": ({"directions": SYMMETRIC, "partition_mode": "per_direction"}, ()),
    "doc_ids": ({}, ("doc_ids",)),
    "query_ids": ({"directions": SYMMETRIC}, ("query_ids",)),
    "gte_ids": ({"directions": GTE}, ("query_ids", "doc_ids")),
    "gist": ({"directions": GIST, "margin": 0.1}, ("guide",)),
    "gist_relative": (
        {"directions": GTE, "margin_strategy": "relative", "margin": 0.3},
        ("guide", "doc_ids"),
    ),
    "symmetric_guided": (
        {"directions": SYMMETRIC, "partition_mode": "per_direction", "margin": -0.2},
        ("guide", "query_ids"),
    ),
    # sentence-transformers' hardness_mode: a bias on chosen negatives' logits.
    "hard_negatives": ({"hardness_mode": "hard_negatives", "hardness_strength": 5.0}, ()),
    "in_batch_hardness": (
        {"directions": GTE, "hardness_mode": "in_batch_negatives", "hardness_strength": 9.0},
        ("doc_ids",),
    ),
    "all_hardness_guided": (
        {"hardness_mode": "all_negatives", "hardness_strength": 2.0, "margin": 0.1},
        ("guide",),
    ),
}


def options(name, arrays):
    static, used = OPTIONS[name]
    return {**static, **_pick(arrays, *used)}


def _value_and_grads(loss, x, y, t, **kw):
    """Value and gradients (x, y, temperature), and the per-row losses, in one jit."""

    def run(x, y, t):
        f = lambda x, y, t: loss(x, y, t, **kw)
        rows = loss(x, y, t, reduction="none", **kw)
        return jax.value_and_grad(f, (0, 1, 2))(x, y, t), rows

    return jax.jit(run)(x, y, jnp.float32(t))


def _loss(x, y, t, **kw):
    return contrastive_loss(x, y, temperature=t, **kw)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name", [n for n in OPTIONS if OPTIONS[n][1]])
def test_the_data_exercise_the_masks(name, k):
    """Each option's ids or guide drop some pairs of this batch, not all."""
    _, _, arrays = data(12, k)
    n_dropped, total = dropped(12, k, **options(name, arrays))
    assert 0 < n_dropped < total / 2, (n_dropped, total)


@functools.cache
def _reference(name, k):
    x, y, arrays = data(12, k)
    return _value_and_grads(contrastive, x, y, 0.6, **options(name, arrays))


# Every option with every block size (dense, dividing and not dividing the rows), and
# with one and two documents per query; every (documents, block size) pair over the
# options: 3 of the 6 per option.
GRID = [
    (name, k, block_size)
    for i, name in enumerate(OPTIONS)
    for k, block_size in ([(1, None), (2, 4), (2, 5)] if i % 2 else [(2, None), (1, 4), (1, 5)])
]


@pytest.mark.parametrize(("name", "k", "block_size"), GRID)
def test_matches_reference(name, k, block_size):
    """Dense, blockwise in blocks dividing the rows (4) and not (5): the definition."""
    x, y, arrays = data(12, k)
    got = _value_and_grads(_loss, x, y, 0.6, block_size=block_size, **options(name, arrays))
    chex.assert_trees_all_close(got, _reference(name, k), **(BLOCK_TOL if block_size else TOL))


@pytest.mark.parametrize("name", ["gte_ids", "gist_relative", "symmetric_guided",
                                  "all_hardness_guided"])  # fmt: skip
def test_blockwise_is_the_dense_math_in_float64(name):
    with jax.enable_x64(True):
        x, y, arrays = jax.tree.map(lambda v: v.astype(jnp.float64) if v.dtype.kind == "f" else v,
                                    data(11, 3))  # fmt: skip
        kw = options(name, arrays)
        got = _value_and_grads(_loss, x, y, 0.6, block_size=4, **kw)
        want = _value_and_grads(_loss, x, y, 0.6, **kw)
        assert got[0][0].dtype == jnp.float64
        chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)


def _float64(tree):
    return jax.tree.map(lambda v: v.astype(jnp.float64) if v.dtype.kind == "f" else v, tree)


@pytest.mark.parametrize("name", ["hard_negatives", "in_batch_hardness", "all_hardness_guided"])
def test_hardness_strength_is_differentiated(name):
    """d loss / d alpha, dense and blockwise, is jax.grad of the float64 reference's."""
    with jax.enable_x64(True):
        x, y, arrays = _float64(data(11, 3))
        kw = options(name, arrays)
        alpha = kw.pop("hardness_strength")
        ref = lambda x, y, t, a: contrastive(x, y, t, hardness_strength=a, **kw)
        want = jax.grad(ref, (0, 1, 2, 3))(x, y, 0.6, alpha)
        assert abs(float(want[3])) > 1e-2
        for block_size in (None, 4):
            loss = lambda x, y, t, a, b=block_size: _loss(x, y, t, hardness_strength=a,
                                                          block_size=b, **kw)  # fmt: skip
            got = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(x, y, 0.6, alpha)
            chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)


def test_symmetric_per_direction_is_clip_loss():
    """k = 1, query_to_doc and doc_to_query averaged: CLIP's loss at scale 1 / t."""
    x, y, _ = data(10, 1)
    got = contrastive_loss(x, y, temperature=0.5, directions=SYMMETRIC,
                           partition_mode="per_direction")  # fmt: skip
    chex.assert_trees_all_close(got, clip_loss(x, y, jnp.log(2.0)), **TOL)


def test_distinct_ids_and_a_lenient_guide_change_nothing():
    x, y, arrays = data(10, 2)
    distinct = {"query_ids": jnp.arange(10), "doc_ids": jnp.arange(20) + 100}
    lenient = {"guide": arrays["guide"], "margin": -10.0}  # nothing scores above t + 10
    for block_size in (None, 3):
        want = _loss(x, y, 0.5, directions=GTE, block_size=block_size)
        got = _loss(x, y, 0.5, directions=GTE, block_size=block_size, **distinct, **lenient)
        chex.assert_trees_all_close(got, want, **TOL)


def test_dropping_false_negatives_only_lowers_each_row():
    """Masked terms leave the partition function: no row's loss grows, some shrink."""
    x, y, arrays = data(12, 2)
    plain = _loss(x, y, 0.5, directions=GTE, reduction="none")
    masked = _loss(x, y, 0.5, directions=GTE, reduction="none", **_pick(arrays, "doc_ids"))
    assert bool(jnp.all(masked <= plain + 1e-6)) and bool(jnp.any(masked < plain - 1e-3))


def test_bfloat16_rows_and_guide():
    """bf16 rows and guide: a float32 loss and bf16 gradients near the float32 ones."""
    x, y, arrays = data(64, 2, dim=16, guide_dim=8)
    kw = options("gist_relative", arrays)
    narrow = {**kw, "guide": tuple(g.astype(jnp.bfloat16) for g in kw["guide"])}
    loss = lambda x, y, **kw: _loss(x, y, 0.5, block_size=16, **kw)
    (value, grads) = jax.jit(jax.value_and_grad(lambda x, y: loss(x, y, **narrow), (0, 1)))(
        x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)
    )
    assert value.dtype == jnp.float32 and all(g.dtype == jnp.bfloat16 for g in grads)
    # The same rounded inputs in float32 (the guide too: its masks must agree).
    wide = {**kw, "guide": tuple(g.astype(jnp.float32) for g in narrow["guide"])}
    up = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)
    want = jax.value_and_grad(lambda x, y: loss(x, y, **wide), (0, 1))(up(x), up(y))
    chex.assert_trees_all_close(
        jax.tree.map(lambda v: v.astype(jnp.float32), (value, grads)), want, rtol=2e-2, atol=2e-2
    )


# text_ids


def test_text_ids_ignore_padding_and_tell_texts_apart():
    tokens = jnp.array([[3, 4, 5, 0, 0], [0, 0, 3, 4, 5], [3, 4, 5, 6, 0], [5, 4, 3, 0, 0],
                        [3, 4, 0, 0, 0], [3, 4, 5, 0, 7]])  # fmt: skip
    mask = jnp.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0],
                      [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])  # fmt: skip
    ids = np.asarray(jax.jit(text_ids)(tokens, mask))
    assert ids.shape == (6, 2) and ids.dtype == np.uint32
    same = lambda a, b: bool((ids[a] == ids[b]).all())
    assert same(0, 1) and same(0, 5)  # padding on either side; a masked-out token
    assert not any(same(0, j) for j in (2, 3, 4))  # longer, reversed, shorter
    assert len({tuple(r) for r in ids[[0, 2, 3, 4]]}) == 4


def test_text_ids_of_many_random_texts_are_distinct():
    tokens = jax.random.randint(jax.random.key(0), (20_000, 12), 0, 30_000)
    ids = np.asarray(text_ids(tokens))
    assert len({(a, b) for a, b in ids}) == 20_000
    assert len(set(ids[:, 0])) > 19_900  # each word alone is a good 32-bit hash too


def test_text_ids_errors():
    with pytest.raises(TypeError, match="input_ids must be an integer"):
        text_ids(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids"):
        text_ids(jnp.ones((2, 3), jnp.int32), jnp.ones((2, 4)))


# Errors, named after the argument.

ERRORS = [
    ({"directions": "query_to_doc"}, TypeError, "directions must be a tuple"),
    ({"directions": ("query_to_doc", "doc_to_docs")}, ValueError, "directions must be distinct"),
    ({"directions": ("query_to_doc", "query_to_doc")}, ValueError, "directions must be distinct"),
    ({"directions": ("doc_to_query",)}, ValueError, "must include 'query_to_doc'"),
    ({"partition_mode": "separate"}, ValueError, "partition_mode must be one of"),
    ({"directions": GTE, "partition_mode": "per_direction"}, ValueError,
     r"per_direction.*\['doc_to_doc', 'query_to_query'\]"),
    ({"query_ids": jnp.arange(3)}, ValueError, r"query_ids must hold one id per row of x: .*3,"),
    ({"doc_ids": jnp.arange(4)}, ValueError, r"doc_ids must hold one id per row of y: shape \(8,"),
    ({"doc_ids": jnp.ones(8)}, TypeError, "doc_ids must be an integer array.*float32"),
    ({"query_ids": jnp.ones((4, 2, 1), jnp.int32)}, ValueError, "query_ids must hold one id"),
    ({"query_ids": [1, 2, 3, 4]}, TypeError, "query_ids must be an integer array"),
    ({"guide": jnp.ones((4, 3))}, TypeError, "guide must be a pair"),
    ({"guide": (jnp.ones((4, 3)), jnp.ones((4, 3)))}, ValueError,
     r"guide\[1\] must be the guide's representations of the rows of y, \[8, guide_dim\]"),
    ({"guide": (jnp.ones((5, 3)), jnp.ones((8, 3)))}, ValueError, r"guide\[0\] .* rows of x"),
    ({"guide": (jnp.ones((4, 3)), jnp.ones((8, 2)))}, ValueError, "must have one dim"),
    ({"guide": (jnp.ones((4, 3), jnp.int32), jnp.ones((8, 3)))}, TypeError,
     r"guide\[0\] must be a float array"),
    ({"margin": 0.1}, ValueError, "margin and margin_strategy filter negatives by a guide"),
    ({"margin_strategy": "relative"}, ValueError, "pass guide="),
    ({"margin_strategy": "percent"}, ValueError, "margin_strategy must be one of"),
    ({"guide": (jnp.ones((4, 3)), jnp.ones((8, 3))), "margin": jnp.ones(2)}, TypeError,
     "margin must be a real scalar"),
    ({"hardness_mode": "hard"}, ValueError, "hardness_mode must be None or one of"),
    ({"hardness_strength": 5.0}, ValueError, "pass hardness_mode= too"),
    ({"hardness_mode": "all_negatives", "hardness_strength": -1.0}, ValueError,
     "hardness_strength must be >= 0"),
    ({"hardness_mode": "all_negatives", "hardness_strength": jnp.ones(2)}, TypeError,
     "hardness_strength must be a real scalar"),
    # Concrete arrays are checked as the floats are (issue 47).
    ({"hardness_strength": jnp.asarray(5.0)}, ValueError, "pass hardness_mode= too"),
    ({"hardness_mode": "all_negatives", "hardness_strength": jnp.asarray(-1.0)}, ValueError,
     "hardness_strength must be >= 0"),
    ({"hardness_mode": "all_negatives", "hardness_strength": jnp.asarray(True)}, TypeError,
     "hardness_strength must be a real scalar, got one of dtype bool"),
    ({"margin": jnp.asarray(0.2)}, ValueError, "margin and margin_strategy filter negatives"),
    ({"temperature": jnp.ones(3)}, TypeError, "temperature must be a real scalar"),
]  # fmt: skip


@pytest.mark.parametrize(("kw", "error", "match"), ERRORS)
def test_errors_name_the_argument(kw, error, match):
    with pytest.raises(error, match=match):
        contrastive_loss(jnp.ones((4, 3)), jnp.ones((8, 3)), **kw)


@pytest.mark.parametrize(("name", "kw", "match"), [
    ("hardness_strength", {}, "hardness_strength is traced and hardness_mode is None"),
    ("margin", {}, "margin is traced, and without a guide it must be 0"),
])  # fmt: skip
def test_traced_options_whose_value_decides_their_meaning_raise(name, kw, match):
    """A traced value cannot be checked: where it decides whether the option is used,
    the loss raises instead of ignoring it."""
    loss = lambda v: contrastive_loss(jnp.ones((4, 3)), jnp.ones((8, 3)), **{name: v}, **kw)
    with pytest.raises(TypeError, match=match):
        jax.jit(loss)(0.5)


# Memory: lowered and compiled from shapes only, never run.

BIG, DIM, BLOCK = 65_536, 128, 1024


def _temp_bytes(dtype, k: int, kw_shapes: dict, **static) -> int:
    x = jax.ShapeDtypeStruct((BIG, DIM), dtype)
    y = jax.ShapeDtypeStruct((BIG * k, DIM), dtype)
    loss = lambda x, y, arrays: contrastive_loss(x, y, temperature=0.05, block_size=BLOCK,
                                                 **static, **arrays)  # fmt: skip
    compiled = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(x, y, kw_shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(("dtype", "k"), [(jnp.float32, 1), (jnp.bfloat16, 3)])
def test_every_option_adds_at_most_a_fifth_of_the_plain_blockwise_memory(dtype, k):
    """65,536 queries, every option at once: within 20 % of plain, nothing rows x rows.
    (bfloat16 with hard negatives once copied the documents' buffer at every block.)"""
    ids = lambda rows: jax.ShapeDtypeStruct((rows, 2), jnp.uint32)
    guide = lambda rows: jax.ShapeDtypeStruct((rows, 64), dtype)
    arrays = {"query_ids": ids(BIG), "doc_ids": ids(BIG * k), "guide": (guide(BIG), guide(BIG * k))}
    plain = _temp_bytes(dtype, k, {})
    every = _temp_bytes(dtype, k, arrays, directions=GTE, margin=0.1)
    assert every <= 1.2 * plain, (every / 2**20, plain / 2**20)
    assert every < BIG * BIG // 64  # not even a 64th of one rows x rows float32 matrix


def test_a_forward_only_chunked_guide_keeps_no_activations():
    """The guide of GISTEmbed, encoded by ``chunked_encoder`` with frozen parameters
    inside a jitted gradient step: its wide hidden layer is held for one chunk only,
    and nothing of it for a backward."""
    rows, width, chunk = 4096, 2048, 256
    w1 = jax.ShapeDtypeStruct((DIM, width), jnp.float32)
    w2 = jax.ShapeDtypeStruct((width, 64), jnp.float32)
    guide = lambda p, x, key: jnp.tanh(x @ p[0]) @ p[1]
    chunked = gc_jax.chunked_encoder(guide, chunk)
    emb = jax.ShapeDtypeStruct((rows, DIM), jnp.float32)

    def step(encode_guide):
        def loss(x, y, guide_params):
            frozen = jax.lax.stop_gradient(guide_params)
            reps = (encode_guide(frozen, x, None), encode_guide(frozen, y, None))
            return contrastive_loss(x, y, guide=reps, block_size=256)

        f = jax.jit(jax.value_and_grad(loss, (0, 1)))
        return f.lower(emb, emb, (w1, w2)).compile().memory_analysis().temp_size_in_bytes

    hidden = rows * width * 4  # one side's hidden layer, whole
    chunked_bytes, whole_bytes = step(chunked), step(guide)
    assert whole_bytes >= hidden  # the check sees a whole-batch forward
    assert chunked_bytes < hidden / 4, (chunked_bytes / 2**20, whole_bytes / 2**20)


def test_per_row_options_travel_typed_and_keep_the_bank_count():
    """The options' per-row arrays (``_options.PerRow``) round-trip through the options,
    and mapping them (a gather, a reshard) leaves the bank's count, a scalar, alone."""
    from gc_jax.losses import _options

    x, y = jnp.ones((4, 3)), jnp.ones((8, 3))
    bank = gc_jax.losses.init_bank(2, x, y)._replace(count=jnp.asarray(1))
    ids = jnp.arange(4)[:, None]
    options = _options.Options(query_ids=ids, bank=bank)
    rows = options.per_row()
    assert rows.query_ids is ids and rows.bank is bank and rows.doc_ids is None
    assert options.with_rows(rows) == options
    mapped = options.map_arrays(lambda v: jnp.concatenate([v, v]))
    assert mapped.query_ids.shape == (8, 1) and mapped.bank.queries.shape[0] == 8
    assert mapped.bank.count is bank.count
