"""Token-budget chunks (gc_jax.TokenBudget): exact against the full padded batch.

The encoder is a tiny masked transformer (one attention layer, mean or first-token
pooling), whose outputs do not depend on trailing padding, so trimming chunks to their
bucket changes nothing but float rounding.
"""

from __future__ import annotations

import contextlib
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax._chunks import budget as token_budget
from gc_jax._chunks import spans as bucket_spans
from gc_jax.losses import contrastive_loss

VOCAB, WIDTH, PADDED = 11, 8, 16
BUCKETS = (4, 8, 16)
TOL = {"rtol": 2e-5, "atol": 2e-6}


def make_tower(seed):
    k = jax.random.split(jax.random.key(seed), 6)
    n = lambda i, *s: jax.random.normal(k[i], s) / np.sqrt(s[0])
    return {"emb": n(0, VOCAB, WIDTH), "pos": n(1, PADDED, WIDTH), "qkv": n(2, WIDTH, 3 * WIDTH),
            "mlp": n(3, WIDTH, WIDTH), "out": n(4, WIDTH, WIDTH)}  # fmt: skip


def make_params():
    return {"q": make_tower(0), "d": make_tower(1), "log_temp": jnp.array(-1.0)}


def transformer(pooling, dropout=0.0, one_hot=False):
    """``encode(tower, batch, key)``: one masked attention layer, then pooling.

    ``one_hot``: the embedding lookup as a one-hot product, which traces under
    explicit mesh axes (an indexed lookup needs its ``out_sharding`` said there).
    """

    def encode(p, batch, key):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        emb = jax.nn.one_hot(ids, VOCAB) @ p["emb"] if one_hot else p["emb"][ids]
        x = emb + p["pos"][: ids.shape[1]]
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(WIDTH)
        scores = jnp.where(mask[:, None, :] > 0, scores, -1e9)
        x = x + jax.nn.softmax(scores, axis=-1) @ v
        x = x + jnp.tanh(x @ p["mlp"])
        if key is not None and dropout:
            x = x * jax.random.bernoulli(key, 1 - dropout, x.shape) / (1 - dropout)
        if pooling == "first":
            pooled = x[:, 0]
        else:
            m = mask[..., None].astype(x.dtype)
            pooled = (x * m).sum(1) / jnp.maximum(m.sum(1), 1.0)
        return pooled @ p["out"]

    return encode


def towers(tied, dropout=0.0, one_hot=False):
    q_enc, d_enc = transformer("mean", dropout, one_hot), transformer("first", dropout, one_hot)
    if tied:
        return lambda p, x, key: q_enc(p["q"], x, key)
    return [lambda p, x, key: q_enc(p["q"], x, key), lambda p, x, key: d_enc(p["d"], x, key)]


def loss_fn(params, q, d, axis_name=None):
    return contrastive_loss(q, d, temperature=jnp.exp(params["log_temp"]), axis_name=axis_name)


def text_batch(rows, lengths_kind, seed, padded=PADDED):
    """Token ids and a prefix mask; ``lengths_kind`` picks the length distribution."""
    rng = np.random.default_rng(seed)
    lengths = {
        "uniform": rng.integers(1, padded + 1, rows),
        "short": rng.integers(1, 4, rows),
        "long": rng.integers(padded - 2, padded + 1, rows),
        "bimodal": np.where(rng.random(rows) < 0.7, rng.integers(1, 5, rows), padded),
        "lognormal": np.clip(np.round(rng.lognormal(np.log(padded / 5), 0.8, rows)), 1, padded),
    }[lengths_kind]
    return batch_of_lengths(lengths, seed, padded)


def batch_of_lengths(lengths, seed, padded=PADDED):
    rng = np.random.default_rng(seed)
    mask = (np.arange(padded)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    ids = rng.integers(1, VOCAB, mask.shape) * mask
    return {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.asarray(mask)}


def full_batch_fn(loss, encoders, num_inputs=2):
    """Jitted ``jax.value_and_grad`` of the loss over the whole padded batch."""
    encs = encoders if isinstance(encoders, list) else [encoders] * num_inputs
    total = lambda p, *xs: loss(p, *[e(p, x, None) for e, x in zip(encs, xs, strict=True)])
    return jax.jit(jax.value_and_grad(total))


def full_batch(loss, encoders, params, *inputs):
    return full_batch_fn(loss, encoders, len(inputs))(params, *inputs)


BUDGET = gc_jax.TokenBudget(tokens=48, buckets=BUCKETS)  # chunks of 12x4, 6x8, 3x16


@pytest.mark.parametrize(("tied", "k"), [(True, 1), (False, 1), (False, 2)])
def test_matches_full_batch(tied, k):
    """One compiled step for every length distribution: the lengths are traced data."""
    params, encoders = make_params(), towers(tied)
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, BUDGET))
    want_fn = full_batch_fn(loss_fn, encoders)
    for seed, kind in enumerate(["uniform", "short", "long", "bimodal"]):
        q, d = text_batch(20, kind, 2 * seed), text_batch(20 * k, kind, 2 * seed + 1)
        chex.assert_trees_all_close(grad_fn(params, q, d), want_fn(params, q, d), **TOL)
    assert grad_fn._cache_size() == 1


def test_per_input_budgets_and_row_chunks_mixed():
    params, encoders = make_params(), towers(False)
    q, d = text_batch(20, "uniform", 2, padded=8), text_batch(20, "bimodal", 3)
    chunk = (3, gc_jax.TokenBudget(tokens=32, buckets=(2, 8, 16, 32)))
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, chunk))
    chex.assert_trees_all_close(
        grad_fn(params, q, d), full_batch(loss_fn, encoders, params, q, d), **TOL
    )


def test_left_padding_is_exact():
    params, encoders = make_params(), towers(False)
    q, d = text_batch(12, "uniform", 4), text_batch(12, "short", 5)
    d = jax.tree.map(lambda x: x[:, ::-1], d)  # padding first: nothing can be trimmed
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, BUDGET))
    chex.assert_trees_all_close(
        grad_fn(params, q, d), full_batch(loss_fn, encoders, params, q, d), **TOL
    )


def test_chunked_encoder_and_train_step():
    params, (q_enc, d_enc) = make_params(), towers(False)
    q, d = text_batch(20, "bimodal", 6), text_batch(20, "uniform", 7)
    enc_q, enc_d = (gc_jax.chunked_encoder(e, BUDGET) for e in (q_enc, d_enc))
    loss = lambda p: loss_fn(p, enc_q(p, q), enc_d(p, d))
    want = full_batch(loss_fn, [q_enc, d_enc], params, q, d)
    chex.assert_trees_all_close(jax.jit(jax.value_and_grad(loss))(params), want, **TOL)
    opt = optax.sgd(0.1)
    step = jax.jit(gc_jax.make_train_step(loss_fn, [q_enc, d_enc], BUDGET, optimizer=opt))
    (new, _), metrics = step((params, opt.init(params)), q, d)
    chex.assert_trees_all_close(metrics["loss"], want[0], **TOL)
    want_new = jax.tree.map(lambda p, g: p - 0.1 * g, params, want[1])
    chex.assert_trees_all_close(new, want_new, **TOL)


def test_input_gradients_of_trimmed_leaves():
    """Differentiated per-token float leaves get their gradient, zero on trimmed padding."""
    tower = make_tower(0)

    def encode(p, batch, key):
        x = batch["embeddings"] + p["pos"][: batch["embeddings"].shape[1]]
        m = batch["attention_mask"][..., None].astype(x.dtype)
        return jnp.tanh((x * m).sum(1) @ p["out"])

    b = text_batch(14, "bimodal", 8)
    emb, mask = tower["emb"][b["input_ids"]], b["attention_mask"]
    f = lambda enc: (
        lambda p, e: jnp.sum(enc(p, {"embeddings": e, "attention_mask": mask}, None) ** 2)
    )
    got = jax.jit(jax.grad(f(gc_jax.chunked_encoder(encode, BUDGET)), (0, 1)))(tower, emb)
    want = jax.jit(jax.grad(f(encode), (0, 1)))(tower, emb)
    chex.assert_trees_all_close(got, want, **TOL)


def cheapest_spans(bucket, shapes):
    """``(tokens, spans)``: each bucket's ``(start, end)`` in the rows sorted by bucket, of
    the plan encoding the fewest tokens among every choice of rounding each bucket's
    rows down (the rest move up) or up (a partial chunk), found by trying them all;
    spans None where two plans tie."""
    counts, plans = np.bincount(bucket, minlength=len(shapes)), []
    for up in itertools.product((False, True), repeat=len(shapes) - 1):
        start, spans, cost = 0, [], 0
        for b, (rows, n) in enumerate(shapes):
            left = int(np.sum(counts[: b + 1])) - start
            taken = left if b == len(shapes) - 1 or up[b] else left // rows * rows
            spans.append((start, start + taken))
            cost += -(-taken // rows) * rows * n
            start += taken
        plans.append((cost, spans))
    plans.sort(key=lambda p: p[0])
    unique = len(plans) == 1 or plans[0][0] < plans[1][0] or plans[0][1] == plans[1][1]
    return plans[0][0], plans[0][1] if unique else None


def reference_with_dropout(loss, encoders, budget, params, *inputs, rng):
    """The full-batch program, with each row encoded at the chunk position and with the key
    gc_jax gives it (the plan redone in numpy), so dropout draws the same masks."""
    encs = encoders if isinstance(encoders, list) else [encoders] * len(inputs)

    def reps(p, e, x, key):
        lengths = np.asarray(x["attention_mask"]).sum(1)
        shapes = budget.chunk_shapes(x["input_ids"].shape[1], len(lengths))
        bucket = np.minimum(np.searchsorted([n for _, n in shapes], lengths), len(shapes) - 1)
        order, out, number = np.argsort(bucket, stable=True), {}, 0
        _, spans = cheapest_spans(bucket, shapes)
        assert spans is not None, "two plans tie: pick another batch"
        for (rows, n), (start, end) in zip(shapes, spans, strict=True):
            for first in range(start, end, rows):  # padding rows: the span's last row again
                take = order[np.minimum(np.arange(first, first + rows), end - 1)]
                chunk = jax.tree.map(lambda v, t=take, n=n: v[t, :n], x)
                r = e(p, chunk, jax.random.fold_in(key, number))
                out.update((row, r[i]) for i, row in enumerate(take[: end - first]))
                number += 1
        return jnp.stack([out[i] for i in range(len(lengths))])

    def total(p):
        keys = [jax.random.fold_in(rng, i) for i in range(len(inputs))]
        return loss(p, *[reps(p, e, x, k) for e, x, k in zip(encs, inputs, keys, strict=True)])

    return jax.jit(jax.value_and_grad(total))(params)


def test_dropout_replayed():
    params, encoders = make_params(), towers(False, dropout=0.3)
    # Batches with one cheapest plan (no tie for the reference to break); the queries'
    # shortest bucket pads its last chunk.
    q, d = text_batch(20, "bimodal", 14), text_batch(20, "uniform", 13)
    rng = jax.random.key(3)
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, BUDGET))
    got = grad_fn(params, q, d, rng=rng)
    want = reference_with_dropout(loss_fn, encoders, BUDGET, params, q, d, rng=rng)
    chex.assert_trees_all_close(got, want, **TOL)
    no_dropout = full_batch(loss_fn, encoders, params, q, d)
    assert not np.allclose(got[0], no_dropout[0])  # the masks did something


def test_testing_reference_with_a_budget():
    """gc_jax.testing takes a TokenBudget: with rng its reference replays the budget's
    chunks and keys (gc_jax, which test_dropout_replayed checks against the numpy plan,
    matches it), and it catches an encoder whose outputs change when chunks are
    trimmed (without rng too: ``test_maxsim_sharded``'s reference test)."""
    params = make_params()
    q, d = text_batch(12, "bimodal", 11), text_batch(12, "uniform", 12)
    check = gc_jax.testing.assert_matches_full_batch
    check(loss_fn, towers(False, dropout=0.3), BUDGET, params, q, d, rng=jax.random.key(4), **TOL)

    def sees_padding(p, x, key):  # an unmasked mean over every position
        return towers(True)(p, x, key) + p["q"]["emb"][x["input_ids"]].mean((1, 2))[:, None]

    trim_error = "trimmed to their bucket's length than at the padded length"
    with pytest.raises(AssertionError, match=trim_error):  # with rng: compared trimmed
        check(loss_fn, sees_padding, BUDGET, params, q, d, rng=jax.random.key(4), **TOL)


def test_lengths_that_undercount_the_mask_never_trim_a_token():
    """A ``lengths=`` callable that undercounts (``mask.sum(1)`` with holes in the
    mask) is raised to the mask's own lengths: exact, where it was silently not."""
    params, encoders = make_params(), towers(False)
    q, d = text_batch(12, "uniform", 21), text_batch(12, "uniform", 22)
    holes = lambda b: {**b, "attention_mask": b["attention_mask"].at[:, 1].set(0)}
    q, d = holes(q), holes(d)
    counted = gc_jax.TokenBudget(48, BUCKETS, lengths=lambda b: b["attention_mask"].sum(1))
    gc_jax.testing.assert_matches_full_batch(loss_fn, encoders, counted, params, q, d, **TOL)


def test_a_float_leaf_as_wide_as_the_padded_length_warns():
    params, encoders = make_params(), towers(True)
    q = {**text_batch(12, "uniform", 23), "dense": jnp.ones((12, PADDED))}
    enc = lambda p, x, key: encoders(p, x, key) + x["dense"].sum(1, keepdims=True)
    f = gc_jax.cached_value_and_grad(loss_fn, enc, BUDGET)
    with pytest.warns(
        UserWarning, match=r"inputs\[\d\]\['dense'\] is a float \[rows, 16\]"
    ) as seen:
        jax.eval_shape(f, params, q, q)
    named = sorted(str(w.message).split("[")[1][0] for w in seen if "'dense'" in str(w.message))
    assert named == ["0", "1"], named  # both inputs' leaves, each once


def test_shard_map_plans_per_device():
    devices = 8
    mesh = jax.make_mesh((devices,), ("d",))
    params, encoders = make_params(), towers(False)
    q, d = text_batch(devices * 6, "bimodal", 11), text_batch(devices * 12, "uniform", 12)
    loss = lambda p, q, d: loss_fn(p, q, d, axis_name="d")
    grad_fn = gc_jax.cached_value_and_grad(loss, encoders, BUDGET, axis_name="d")
    step = jax.jit(
        jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    )
    put = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("d"))), t)
    got = step(params, put(q), put(d))
    chex.assert_trees_all_close(got, full_batch(loss_fn, encoders, params, q, d), **TOL)


def test_sharded_jit_plans_per_shard():
    # Auto axes: the toy encoder's embedding lookup does not trace under explicit axes.
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    params, encoders = make_params(), towers(True)
    q, d = text_batch(32, "bimodal", 13), text_batch(32, "uniform", 14)
    put = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("d"))), t)
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, BUDGET, batch_axis="d"))
    with jax.set_mesh(mesh):
        got = grad_fn(params, put(q), put(d))
    chex.assert_trees_all_close(got, full_batch(loss_fn, encoders, params, q, d), **TOL)


@pytest.mark.parametrize("set_mesh", [False, True])
def test_sharded_jit_over_explicit_axes(set_mesh):
    """Explicit axes (``jax.make_mesh``'s default), without ``jax.set_mesh`` (as users
    first write it): every entry point, exact, the batch's shards planned per device;
    with it: the train step."""
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    params, encoders = make_params(), towers(False, one_hot=True)
    q, d = text_batch(16, "bimodal", 15), text_batch(16, "uniform", 16)
    put = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("d"))), t)
    want = full_batch(loss_fn, encoders, params, q, d)
    cached = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, BUDGET))
    q_enc, d_enc = (gc_jax.chunked_encoder(e, BUDGET) for e in encoders)
    chunked = jax.jit(jax.value_and_grad(
        lambda p, q, d: loss_fn(p, q_enc(p, q, None), d_enc(p, d, None))
    ))  # fmt: skip
    opt = optax.sgd(0.5)
    step = jax.jit(gc_jax.make_train_step(loss_fn, encoders, BUDGET, optimizer=opt))
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        got = [] if set_mesh else [cached(params, put(q), put(d)), chunked(params, put(q), put(d))]
        (new, _), metrics = step((params, opt.init(params)), put(q), put(d))
    for value_and_grads in got:
        chex.assert_trees_all_close(jax.device_get(value_and_grads), want, **TOL)
    chex.assert_trees_all_close(jax.device_get(metrics["loss"]), want[0], **TOL)
    want_new = jax.tree.map(lambda p, g: p - 0.5 * g, params, want[1])
    chex.assert_trees_all_close(jax.device_get(new), want_new, **TOL)


def test_one_compiled_shape_per_bucket():
    assert BUDGET.chunk_shapes(PADDED, rows=20) == ((12, 4), (6, 8), (3, 16))
    seen = set()
    q_enc = transformer("mean")

    def encode(p, x, key):
        seen.add(x["input_ids"].shape)
        return q_enc(p["q"], x, key)

    q, d = text_batch(20, "uniform", 15), text_batch(20, "short", 16)
    jax.jit(gc_jax.cached_value_and_grad(loss_fn, encode, BUDGET))(make_params(), q, d)
    assert seen == {(12, 4), (6, 8), (3, 16)}


# ------------------------------------------------------------------- the plan, the buckets


def test_spans_encode_the_fewest_tokens():
    """The plan's dynamic program (NumPy; jax.numpy under jit) against trying every choice
    of rounding down or up: as few tokens; the spans tile the sorted rows, every row
    fits its bucket, and a bucket's chunks hold its span."""
    rng = np.random.default_rng(0)
    spans = jax.jit(bucket_spans.spans, static_argnums=(1, 2, 3))
    for case in range(300):
        lengths = tuple(int(n) for n in np.sort(rng.choice(np.arange(1, 65), rng.integers(1, 6),
                                                           replace=False)))  # fmt: skip
        n_rows, tokens = int(rng.integers(1, 50)), int(rng.integers(lengths[-1], 300))
        rows = tuple(min(tokens // n, n_rows) for n in lengths)
        bucket = bucket_spans.bucket_of(rng.integers(1, lengths[-1] + 1, (3, n_rows)), lengths, np)
        starts, ends, chunks = bucket_spans.spans(bucket, rows, lengths, np)
        if case < 12:
            traced = spans(jnp.asarray(bucket), rows, lengths, jnp)
            chex.assert_trees_all_equal(
                tuple(np.asarray(t) for t in traced), (starts, ends, chunks)
            )
        for s in range(3):
            assert starts[s, 0] == 0 and ends[s, -1] == n_rows
            np.testing.assert_array_equal(ends[s, :-1], starts[s, 1:])
            for b in range(len(rows)):
                assert np.all(np.sort(bucket[s])[starts[s, b] : ends[s, b]] <= b)
            np.testing.assert_array_equal(chunks[s], -(-(ends[s] - starts[s]) // np.array(rows)))
            tokens_encoded = chunks[s] @ np.multiply(rows, lengths)
            assert (
                tokens_encoded
                == cheapest_spans(bucket[s], list(zip(rows, lengths, strict=True)))[0]
            )


def test_the_compiled_plan_does_not_grow_with_the_buckets():
    """The dynamic program's loops over the buckets are rolled under JAX: one loop
    body whatever their number (compile time stays flat), and the same plan as NumPy."""

    def plan_ops(buckets):
        rows = tuple(64 // n for n in buckets)
        f = lambda b: bucket_spans.spans(b, rows, buckets, jnp)
        bucket = np.random.default_rng(0).integers(0, len(buckets), (2, 40))
        got = jax.jit(f)(jnp.asarray(bucket))
        for g, want in zip(got, bucket_spans.spans(bucket, rows, buckets, np), strict=True):
            np.testing.assert_array_equal(g, want)
        return jax.jit(f).lower(jnp.asarray(bucket)).as_text().count("\n")

    assert plan_ops((4, 8, 16)) == plan_ops((2, 4, 8, 16, 32, 64))


def test_chunk_counts_are_the_plan_the_step_makes():
    """``TokenBudget.chunk_counts`` (NumPy) gives the traced plan's chunks per shape, for
    one device and per device (the most any device needs)."""

    def planned(batch):  # the traced plan of one device's rows
        plan = token_budget.make_plan(batch, budget, "batch")
        shapes = zip(plan.rows, plan.lengths, strict=True)
        return dict(zip(shapes, map(int, plan.trips), strict=True))

    budget = gc_jax.TokenBudget(48, BUCKETS)
    for kind, seed in [("bimodal", 31), ("uniform", 32), ("short", 33)]:
        batch = text_batch(24, kind, seed)
        mask = np.asarray(batch["attention_mask"])
        lengths = np.where(mask.any(1), PADDED - np.argmax(mask[:, ::-1] > 0, axis=1), 0)
        assert budget.chunk_counts(lengths, PADDED) == planned(batch), kind
        shards = [jax.tree.map(lambda x, i=i: x[i * 6 : (i + 1) * 6], batch) for i in range(4)]
        per_device = [planned(b) for b in shards]
        want = {shape: max(p[shape] for p in per_device) for shape in per_device[0]}
        assert budget.chunk_counts(lengths.reshape(4, 6), PADDED) == want, kind
    with pytest.raises(
        ValueError, match=r"TokenBudget\.chunk_counts\(lengths=\.\.\.\) has lengths from 0 to 17"
    ):
        budget.chunk_counts([0, 17], PADDED)
    with pytest.raises(ValueError, match="must be integer row lengths"):
        budget.chunk_counts([1.5], PADDED)


def test_a_shorter_bucket_pads_its_last_chunk_when_that_is_cheaper():
    """11 short rows: one chunk of 12 x 4 tokens (a padding row) costs 48 tokens; moved up
    they would cost 6 x 8 plus two more chunks of 3 x 16. Exact, the padding row dropped."""
    params, encoders = make_params(), towers(False)
    q = batch_of_lengths([2] * 11 + [16] * 9, 41)
    d = text_batch(20, "lognormal", 42)
    plan = token_budget.make_plan(q, BUDGET, "q")
    assert np.asarray(plan.trips).tolist() == [1, 0, 3]
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, BUDGET))
    chex.assert_trees_all_close(
        grad_fn(params, q, d), full_batch(loss_fn, encoders, params, q, d), **TOL
    )


def fitted_budget(batches, max_buckets=3):
    sample = np.stack([np.asarray(b["attention_mask"]).sum(1) for b in batches])
    return gc_jax.TokenBudget.for_lengths(sample, 48, PADDED, max_buckets=max_buckets,
                                          multiple=2, min_saving=0.0)  # fmt: skip


def test_fitted_budget_on_eight_devices():
    """Budgets from ``for_lengths`` on long-tailed lengths, each device's rows planned on
    their own (spans, partial chunks and padding rows differ between devices): exact
    under sharded ``jit`` over explicit axes without ``jax.set_mesh``, and ``shard_map``."""
    mesh = jax.make_mesh((8,), ("d",))
    params, encoders = make_params(), towers(False, one_hot=True)
    q, d = text_batch(64, "lognormal", 43), text_batch(64, "bimodal", 44)
    budgets = (fitted_budget([q]), fitted_budget([d]))
    assert budgets[0].buckets != (PADDED,) and budgets[1].buckets != (PADDED,)
    want = full_batch(loss_fn, encoders, params, q, d)
    put = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("d"))), t)
    cached = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, budgets))
    chex.assert_trees_all_close(jax.device_get(cached(params, put(q), put(d))), want, **TOL)
    loss = lambda p, q, d: loss_fn(p, q, d, axis_name="d")
    grad_fn = gc_jax.cached_value_and_grad(loss, encoders, budgets, axis_name="d")
    step = jax.jit(
        jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    )
    chex.assert_trees_all_close(jax.device_get(step(params, put(q), put(d))), want, **TOL)


def test_for_lengths_finds_the_cheapest_buckets():
    """Against every set of buckets (multiples of 16 below 64, at most 2, and 64): the
    fitted budget encodes as few tokens, counted by trying every plan."""
    sample = np.clip(np.random.default_rng(5).lognormal(np.log(14), 0.8, (4, 32)), 1, 64)
    sample = sample.astype(int)
    budget = gc_jax.TokenBudget.for_lengths(sample, 256, 64, max_buckets=3, multiple=16,
                                            min_saving=0.0)  # fmt: skip

    def tokens(buckets):
        shapes = gc_jax.TokenBudget(256, buckets).chunk_shapes(64, sample.shape[1])
        bucket_of = lambda x: np.minimum(np.searchsorted(buckets, x), len(buckets) - 1)
        return sum(cheapest_spans(bucket_of(x), shapes)[0] for x in sample)

    subsets = [c for k in range(3) for c in itertools.combinations((16, 32, 48), k)]
    assert budget.buckets[-1] == 64 and len(budget.buckets) <= 3
    assert all(b % 16 == 0 for b in budget.buckets)
    assert tokens(budget.buckets) == min(tokens((*c, 64)) for c in subsets)
    assert tokens(budget.buckets) < tokens((64,))


def test_for_lengths_adds_only_buckets_that_save():
    full = np.full((2, 16), 64)  # every row fills the padded length
    assert gc_jax.TokenBudget.for_lengths(full, 256, 64).buckets == (64,)
    short = np.full((2, 16), 10)
    assert gc_jax.TokenBudget.for_lengths(short, 256, 64, multiple=8).buckets == (16, 64)
    assert gc_jax.TokenBudget.for_lengths(short, 256, 64, max_buckets=1).buckets == (64,)
    fitted = gc_jax.TokenBudget.for_lengths(short, 256, 64, lengths="mask")
    assert fitted.lengths == "mask" and fitted.tokens == 256


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sample": np.ones((2, 3), np.float32)}, ValueError, "integer row lengths.*float32"),
        ({"sample": np.ones((2, 3, 4), int)}, ValueError, r"shape \(2, 3, 4\)"),
        ({"sample": np.array([3, 70])}, ValueError, r"from 3 to 70, outside \[0, padded_length=64"),
        (
            {"padded_length": "64"},
            TypeError,
            r"for_lengths\(padded_length=\.\.\.\) must be a positive int",
        ),
        ({"max_buckets": 0}, TypeError, r"\(max_buckets=\.\.\.\) must be a positive int"),
        ({"multiple": 0}, TypeError, r"\(multiple=\.\.\.\) must be a positive int"),
        ({"min_saving": 1.0}, ValueError, r"\(min_saving=\.\.\.\) must be a share in \[0, 1\)"),
        ({"tokens": 32}, ValueError, r"tokens=32\) is smaller than one row.*at least 64"),
    ],
)
def test_for_lengths_errors(kwargs, error, match):
    args = {"sample": np.array([3, 9, 40]), "tokens": 256, "padded_length": 64, **kwargs}
    with pytest.raises(error, match=match):
        gc_jax.TokenBudget.for_lengths(**args)


# ---------------------------------------------------------------------------- errors


def test_budget_smaller_than_a_row_of_the_longest_bucket():
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, towers(True), gc_jax.TokenBudget(8, BUCKETS))
    with pytest.raises(ValueError, match=r"tokens=8\) is smaller than one row.*at least 16"):
        jax.jit(grad_fn)(make_params(), text_batch(4, "short", 0), text_batch(4, "short", 1))


def test_padded_length_longer_than_the_largest_bucket():
    budget = gc_jax.TokenBudget(64, (4, 8))
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, towers(True), budget)
    with pytest.raises(ValueError, match=r"padded to 16 tokens but the largest bucket.*Add 16"):
        jax.jit(grad_fn)(make_params(), text_batch(4, "short", 0), text_batch(4, "short", 1))


def test_missing_mask_names_the_keys():
    grad_fn = gc_jax.cached_value_and_grad(
        loss_fn, towers(True), gc_jax.TokenBudget(64, (8, 16), lengths="mask")
    )
    with pytest.raises(
        ValueError, match=r"inputs\[0\]\['mask'\].*keys \['attention_mask', 'input_ids'\]"
    ):
        jax.jit(grad_fn)(make_params(), text_batch(4, "short", 0), text_batch(4, "short", 1))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"tokens": 0, "buckets": (4,)},
            TypeError,
            r"TokenBudget\(tokens=\.\.\.\) must be a positive int",
        ),
        ({"tokens": 64, "buckets": ()}, TypeError, "non-empty tuple"),
        ({"tokens": 64, "buckets": (8, 4)}, ValueError, r"increase strictly.*\(4, 8\)"),
        ({"tokens": 64, "buckets": (4,), "lengths": 3}, TypeError, "key of the attention mask"),
    ],
)
def test_bad_budget(kwargs, error, match):
    with pytest.raises(error, match=match):
        gc_jax.TokenBudget(**kwargs)


def test_lengths_callable():
    params, encoders = make_params(), towers(True)
    q, d = text_batch(10, "bimodal", 17), text_batch(10, "uniform", 18)
    budget = gc_jax.TokenBudget(48, BUCKETS, lengths=lambda b: b["attention_mask"].sum(1))
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, budget))
    chex.assert_trees_all_close(
        grad_fn(params, q, d), full_batch(loss_fn, encoders, params, q, d), **TOL
    )
    bad = gc_jax.TokenBudget(48, BUCKETS, lengths=lambda b: b["attention_mask"])
    with pytest.raises(ValueError, match=r"one integer length per row \(shape \(10,\)\)"):
        jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, bad))(params, q, d)


def test_second_derivatives_through_a_budget_name_the_limit():
    """A Hessian through ``chunked_encoder(enc, TokenBudget)`` is a named ValueError
    (JAX cannot reverse-differentiate the budget's data-dependent loops); the first
    derivative stays exact (``test_chunked_encoder_and_train_step``)."""
    params, (q_enc, d_enc) = make_params(), towers(False)
    q, d = text_batch(12, "bimodal", 31), text_batch(12, "uniform", 32)
    enc_q, enc_d = (gc_jax.chunked_encoder(e, BUDGET) for e in (q_enc, d_enc))
    grad = jax.grad(lambda p: loss_fn(p, enc_q(p, q), enc_d(p, d)))
    second = lambda t: grad({**params, "log_temp": t})["q"]["out"].sum()
    with pytest.raises(ValueError, match=r"differentiated twice.*integer chunk_size"):
        jax.grad(second)(params["log_temp"])
