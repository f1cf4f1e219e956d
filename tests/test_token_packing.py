"""Packed chunks (gc_jax.TokenPacking): exact against the full padded batch.

The encoder is a tiny masked transformer that reads the packing keys through
``gc_jax.packing`` (attention within each row, positions within each row, pooling per
row), so packing rows next to each other changes nothing but float rounding.
"""

from __future__ import annotations

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gc_jax
from gc_jax import packing
from gc_jax._chunks import lines as token_packing
from gc_jax._chunks import plan as _plan
from gc_jax.losses import contrastive_loss

VOCAB, WIDTH, PADDED, LANGS = 11, 8, 16, 3
TOL = {"rtol": 2e-5, "atol": 2e-6}
PACKING = gc_jax.TokenPacking(tokens=64, segments=4)  # chunks of 4 lines x 16 tokens
BUCKETED = gc_jax.TokenPacking(tokens=64, segments=4, buckets=(4, 8, 16))  # 3 line lengths


def make_tower(seed):
    k = jax.random.split(jax.random.key(seed), 6)
    n = lambda i, *s: jax.random.normal(k[i], s) / np.sqrt(s[0])
    return {"emb": n(0, VOCAB, WIDTH), "pos": n(1, PADDED, WIDTH), "qkv": n(2, WIDTH, 3 * WIDTH),
            "mlp": n(3, WIDTH, WIDTH), "lang": n(4, LANGS, WIDTH)}  # fmt: skip


def make_params():
    return {"q": make_tower(0), "d": make_tower(1), "log_temp": jnp.array(-1.0)}


def transformer(pooling, dropout=0.0, one_hot=False, packed=True, normalise=True):
    """``encode(tower, batch, key)``: one masked attention layer, then pooling; a per-row
    ``"lang"`` id (where the batch has one) is added after pooling.

    ``packed=False``: an encoder that ignores the packing keys (attends across the rows
    of a line, counts positions from the line's start).
    """

    def encode(p, batch, key):
        ids = batch["input_ids"]
        emb = jax.nn.one_hot(ids, VOCAB) @ p["emb"] if one_hot else p["emb"][ids]
        if packed:
            pos, mask = packing.positions(batch), packing.attention_mask(batch)[:, 0]
        else:
            pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
            keep = batch["attention_mask"][:, None, :] > 0
            mask = jnp.broadcast_to(keep, (*ids.shape, ids.shape[1]))
        position = jax.nn.one_hot(pos, PADDED) @ p["pos"]
        x = emb + position
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(WIDTH)
        scores = jnp.where(mask, scores, -1e9)
        x = x + jax.nn.softmax(scores, axis=-1) @ v
        x = x + jnp.tanh(x @ p["mlp"])
        if key is not None and dropout:
            x = x * jax.random.bernoulli(key, 1 - dropout, x.shape) / (1 - dropout)
        pool = packing.first_token if pooling == "first" else packing.mean_pool
        pooled = pool(x, batch)
        if normalise:  # the gradient of the norm is NaN at zero: no output may be zero
            pooled = pooled / jnp.linalg.norm(pooled, axis=-1, keepdims=True)
        if not packed and packing.is_packed(batch):
            pooled = jnp.repeat(pooled[:: batch["segment_starts"].shape[1]],
                                batch["segment_starts"].shape[1], axis=0)  # fmt: skip
        if "lang" in batch:
            pooled = pooled + jax.nn.one_hot(batch["lang"], LANGS) @ p["lang"]
        return pooled

    return encode


def towers(dropout=0.0, one_hot=False, packed=True, normalise=True):
    q_enc = transformer("mean", dropout, one_hot, packed, normalise)
    d_enc = transformer("first", dropout, one_hot, packed, normalise)
    return [lambda p, x, key: q_enc(p["q"], x, key), lambda p, x, key: d_enc(p["d"], x, key)]


def loss_fn(params, q, d, axis_name=None):
    return contrastive_loss(q, d, temperature=jnp.exp(params["log_temp"]), axis_name=axis_name)


def text_batch(rows, kind, seed, padded=PADDED, lang=False):
    """Token ids and a prefix mask; ``kind`` picks the length distribution."""
    rng = np.random.default_rng(seed)
    lengths = {
        "uniform": rng.integers(1, padded + 1, rows),
        "short": rng.integers(1, 4, rows),
        "long": rng.integers(padded - 2, padded + 1, rows),
        "lognormal": np.clip(np.round(rng.lognormal(np.log(padded / 5), 0.8, rows)), 1, padded),
        "with_empty": np.where(rng.random(rows) < 0.2, 0, rng.integers(1, padded + 1, rows)),
    }[kind]
    mask = (np.arange(padded)[None, :] < lengths[:, None]).astype(np.int32)
    ids = rng.integers(1, VOCAB, mask.shape) * mask
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.asarray(mask)}
    if lang:
        batch["lang"] = jnp.asarray(rng.integers(0, LANGS, rows), jnp.int32)
    return batch


def full_batch(loss, encoders, params, *inputs):
    """``jax.value_and_grad`` of the loss over the whole padded batch, unpacked."""
    total = lambda p, *xs: loss(p, *[e(p, x, None) for e, x in zip(encoders, xs, strict=True)])
    return jax.jit(jax.value_and_grad(total))(params, *inputs)


def lengths_of(batch):
    return np.asarray(batch["attention_mask"]).sum(1)


@pytest.mark.parametrize(
    ("kind", "chunking"),
    [("uniform", PACKING), ("short", PACKING), ("long", PACKING), ("lognormal", PACKING),
     ("uniform", BUCKETED)],
)  # fmt: skip
def test_matches_full_batch(kind, chunking):
    params, encoders = make_params(), towers()
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, chunking))
    q, d = text_batch(20, kind, 1, lang=True), text_batch(20, kind, 2)
    chex.assert_trees_all_close(grad_fn(params, q, d), full_batch(loss_fn, encoders, params, q, d),
                                **TOL)  # fmt: skip


def test_one_compiled_step_for_every_length_distribution():
    params, encoders = make_params(), towers()
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, PACKING))
    for seed, kind in enumerate(["short", "long", "lognormal"]):
        q, d = text_batch(24, kind, 2 * seed), text_batch(24, "uniform", 2 * seed + 1)
        chex.assert_trees_all_close(grad_fn(params, q, d),
                                    full_batch(loss_fn, encoders, params, q, d), **TOL)  # fmt: skip
    assert grad_fn._cache_size() == 1


def test_empty_rows_take_a_line_of_their_own():
    """A row without tokens is packed alone in a line of ``L`` tokens, as the unpacked
    batch encodes it: finite, and its output is whatever the encoder makes of no
    tokens (here zero: not normalised)."""
    params, encoders = make_params(), towers(normalise=False)
    q, d = text_batch(24, "with_empty", 20), text_batch(24, "uniform", 21)
    assert (lengths_of(q) == 0).any()
    got = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, PACKING))(params, q, d)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(got))
    reps = gc_jax.chunked_encoder(encoders[0], PACKING)(params, q)
    empty = lengths_of(q) == 0
    np.testing.assert_array_equal(reps[empty], 0.0)
    chex.assert_trees_all_close(reps[~empty], encoders[0](params, q, None)[~empty], **TOL)
    lines = token_packing.pack_lines(lengths_of(q), PADDED, PACKING.segments)
    assert sum(len(line) == 1 for line in lines) >= empty.sum()  # each alone in a line


@pytest.mark.parametrize("chunking", [PACKING, BUCKETED, gc_jax.TokenBudget(64, (4, 8, 16))])
def test_first_token_of_an_all_padding_row_is_exact(chunking):
    """Issue 34 (1): a row without tokens attends to no key, so its first token's output
    is a mean over all its ``L`` padding positions; it used to take one position of a
    shared line (or of its shortest bucket) and mix in other rows' tokens (a loss of
    27.64 for 27.81, gradients 25 % off). Exact now, packed (a bucketed packing gives
    it a line of the longest length) and under a budget."""
    params, encoders = make_params(), towers()  # documents: first-token pooling
    q, d = text_batch(24, "uniform", 20), text_batch(24, "with_empty", 21, lang=True)
    assert (lengths_of(d) == 0).sum() >= 3
    want = full_batch(loss_fn, encoders, params, q, d)
    got = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, chunking))(params, q, d)
    chex.assert_trees_all_close(got, want, **TOL)
    reps = jax.jit(gc_jax.chunked_encoder(encoders[1], chunking))(params, d)
    chex.assert_trees_all_close(reps, encoders[1](params, d, None), **TOL)
    counts = chunking.chunk_counts(lengths_of(d), PADDED)  # NumPy agrees with the step
    plan = _plan.make(d, chunking, name="d", one_device=True).plan
    assert int(np.sum(plan.trips)) == sum(counts.values())


def test_packs_rows_into_few_chunks():
    """Short rows share lines: the chunks the step runs are the NumPy count, and far
    fewer than one line per row."""
    q = text_batch(32, "short", 3)
    counts = PACKING.chunk_counts(lengths_of(q), PADDED)
    (((lines, tokens), chunks),) = counts.items()
    assert (lines, tokens) == (4, PADDED) and chunks == 2  # 32 rows, 4 per line, 4 lines
    plan = token_packing.make_plan(q, PACKING, "q")
    assert int(np.sum(plan.trips)) == chunks
    counts_long = PACKING.chunk_counts(lengths_of(text_batch(32, "long", 4)), PADDED)
    assert counts_long == {(4, PADDED): 8}  # one row per line: as many lines as rows


def test_the_traced_packing_is_the_numpy_one():
    """The packing under jit (one ``lax.scan`` over a bucket's first ``count`` rows) and
    the NumPy one agree, line by line; every row is placed once, the rows past
    ``count`` stay where they are, and no line is over-full."""
    rng = np.random.default_rng(0)
    place = jax.jit(token_packing._place, static_argnums=(1, 2))
    for _ in range(30):
        n, length = int(rng.integers(1, 40)), int(rng.integers(4, 33))
        segments, count = int(rng.integers(2, 6)), int(rng.integers(0, n + 1))
        lengths = rng.integers(0, length + 1, n)
        lines = token_packing.pack_lines(lengths[:count], length, segments)
        head = np.sort(np.where(lengths[:count] > 0, lengths[:count], length))[::-1]
        sizes = np.concatenate([head, rng.integers(1, 3 * length, n - count)]).astype(np.int32)
        placed, first = (np.asarray(a) for a in place(jnp.asarray(sizes), length, segments,
                                                      jnp.int32(count)))  # fmt: skip
        ends = [*first[1 : len(lines)], count]
        assert [list(placed[f:e]) for f, e in zip(first[: len(lines)], ends, strict=True)] == lines
        assert (first[len(lines) :] == n).all() and sorted(placed) == list(range(n))
        assert list(placed[count:]) == list(range(count, n))
        for line in lines:
            assert sizes[line].sum() <= length and len(line) <= segments


@pytest.mark.parametrize("chunking", [PACKING, BUCKETED])
def test_the_chunk_holds_each_row_once(chunking):
    """Every row's tokens appear once, in order, under their segment id, with positions
    counted from the row's start; per-row leaves go to their slot. With buckets, each
    row lies in a line of the shortest bucket that holds it, and the chunks the step
    runs are the NumPy count."""
    q = text_batch(12, "uniform", 5, lang=True)
    plan = token_packing.make_plan(q, chunking, "q")
    counts = chunking.chunk_counts(lengths_of(q), PADDED)
    assert [int(t) for t in plan.trips] == list(counts.values())
    seen = {}
    for (lines, width), (bucket, trips) in zip(counts, enumerate(counts.values()), strict=True):
        for c in range(trips):
            index = token_packing.BucketChunk(bucket, jnp.int32(c))
            chunk = plan.take(q, index)
            assert chunk["input_ids"].shape == (lines, width)
            rows, valid = (np.asarray(a).reshape(-1) for a in plan._slots(plan.where(index)))
            for at in np.flatnonzero(valid):
                line, slot, row = at // chunking.segments, at % chunking.segments, int(rows[at])
                where = np.asarray(chunk["segment_ids"][line]) == slot + 1
                start = int(chunk["segment_starts"][line, slot])
                n = int(lengths_of(q)[row])
                assert where.sum() == n and where[start]
                assert n <= width and (bucket == 0 or n > list(counts)[bucket - 1][1])
                np.testing.assert_array_equal(chunk["input_ids"][line][where],
                                              q["input_ids"][row][:n])  # fmt: skip
                np.testing.assert_array_equal(chunk["position_ids"][line][where], np.arange(n))
                assert int(chunk["lang"][at]) == int(q["lang"][row])
                seen[row] = seen.get(row, 0) + 1
    assert seen == dict.fromkeys(range(12), 1)


def test_chunked_encoder_train_step_and_grad_cache_forms():
    """Queries packed into one line length, documents into three."""
    params, encoders = make_params(), towers()
    q, d = text_batch(20, "lognormal", 6), text_batch(20, "uniform", 7)
    want = full_batch(loss_fn, encoders, params, q, d)
    q_enc = gc_jax.chunked_encoder(encoders[0], PACKING)
    d_enc = gc_jax.chunked_encoder(encoders[1], BUCKETED)
    chunked = jax.jit(jax.value_and_grad(
        lambda p, q, d: loss_fn(p, q_enc(p, q, None), d_enc(p, d, None))
    ))  # fmt: skip
    chex.assert_trees_all_close(chunked(params, q, d), want, **TOL)
    opt = optax.sgd(0.5)
    step = jax.jit(gc_jax.make_train_step(loss_fn, encoders, (PACKING, BUCKETED), optimizer=opt))
    (new, _), metrics = step((params, opt.init(params)), q, d)
    chex.assert_trees_all_close(metrics["loss"], want[0], **TOL)
    want_new = jax.tree.map(lambda p, g: p - 0.5 * g, params, want[1])
    chex.assert_trees_all_close(new, want_new, **TOL)


def test_mixed_with_a_budget_and_row_chunks():
    params, encoders = make_params(), towers()
    q, d = text_batch(20, "short", 8), text_batch(20, "lognormal", 9)
    for chunk in [(PACKING, 3), (gc_jax.TokenBudget(48, (4, 8, 16)), PACKING)]:
        grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, chunk))
        chex.assert_trees_all_close(grad_fn(params, q, d),
                                    full_batch(loss_fn, encoders, params, q, d), **TOL)  # fmt: skip


def test_dropout_replayed_as_the_testing_reference():
    """With a key, each chunk's dropout is replayed in pass 2: the testing reference
    (packed chunks, differentiably) gives the same gradients (the helper passes with a
    key: ``test_the_testing_helper_names_each_broken_packing_rule``)."""
    params, encoders = make_params(), towers(dropout=0.3)
    q, d = text_batch(20, "lognormal", 10), text_batch(20, "uniform", 11)
    rng = jax.random.key(3)
    got = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, PACKING))(params, q, d, rng=rng)
    ref = jax.jit(gc_jax.testing.full_batch_value_and_grad(loss_fn, encoders, PACKING))
    chex.assert_trees_all_close(got, ref(params, q, d, rng=rng), **TOL)
    no_key = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, PACKING))(params, q, d)
    assert not np.allclose(got[0], no_key[0])  # the key did drop something


def breaking(mistake):
    """``encode(tower, batch, key)``, normalised mean pooling, that breaks one packing
    rule: ``"attention"`` across a line's rows, ``"positions"`` counted from the line's
    start (``jnp.arange``), or its own ``"pooling"`` that leaves empty slots zero."""

    def encode(p, batch, key):
        ids = batch["input_ids"]
        pos, mask = packing.positions(batch), packing.attention_mask(batch)[:, 0]
        if mistake == "positions":
            pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        if mistake == "attention":  # the padding mask only: keys of every row of the line
            mask = jnp.broadcast_to(batch["attention_mask"][:, None, :] > 0, mask.shape)
        x = p["emb"][ids] + jax.nn.one_hot(pos, PADDED) @ p["pos"]
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        x = x + jax.nn.softmax(jnp.where(mask, jnp.einsum("bqd,bkd->bqk", q, k), -1e9)) @ v
        if key is not None:
            x = x * jax.random.bernoulli(key, 0.8, x.shape) / 0.8
        pooled = packing.mean_pool(x, batch)
        if mistake == "pooling" and packing.is_packed(batch):  # a mean per segment id
            segments = batch["segment_starts"].shape[1]
            slots = (batch["segment_ids"][..., None] == jnp.arange(1, segments + 1)) * 1.0
            sums = jnp.einsum("lts,ltf->lsf", slots, x)
            pooled = (sums / jnp.maximum(slots.sum(1), 1)[..., None]).reshape(-1, WIDTH)
        return pooled / jnp.linalg.norm(pooled, axis=-1, keepdims=True)

    return lambda p, x, key: encode(p["d"], x, key)


BROKEN = {
    "attention": r"rows .* of inputs\[1\] change when other rows change .* rows depend on "
    r"each other.* attend only to its own row's tokens .*packing\.attention_mask",
    "positions": r"inputs\[1\] than for the batch unpacked in rows .* placed after the start "
    r"of its line.* counts positions from the line's start .*packing\.positions",
    "pooling": r"NaN or infinite values for the empty slots .* inputs\[1\] .* zero vector "
    r"and then normalises it.*packing\.mean_pool",
}


@pytest.mark.parametrize(
    ("mistake", "rng"), [("attention", None), ("pooling", 3), ("positions", 3)]
)
def test_the_testing_helper_names_each_broken_packing_rule(mistake, rng):
    """Issue 34 (4): an encoder that breaks one packing rule is refused by the checker,
    with or without a key (each rule once: the key changes which reference is built,
    not what the rule's check reads), in an error that names that rule and the helper
    to use; the same encoder with the rule kept passes."""
    params = make_params()
    q, d = text_batch(20, "lognormal", 12), text_batch(20, "short", 13)
    d = {k: v.at[-2:].set(jnp.where(k == "attention_mask", 1, 3)) for k, v in d.items()}
    rng = None if rng is None else jax.random.key(rng)  # two long rows: empty slots
    encoders = [towers()[0], breaking(mistake)]
    check = gc_jax.testing.assert_matches_full_batch
    with pytest.raises(AssertionError, match=BROKEN[mistake]):
        check(loss_fn, encoders, PACKING, params, q, d, rng=rng, **TOL)
    check(loss_fn, [towers()[0], breaking(None)], PACKING, params, q, d, rng=rng, **TOL)


def test_the_broken_packing_rules_are_silent_in_the_step():
    """Why the checker must name them: each broken encoder runs in the step without an
    error, and its loss or gradients are off the full batch's (NaN for the pooling)."""
    params = make_params()
    q, d = text_batch(20, "lognormal", 12), text_batch(20, "short", 13)
    d = {k: v.at[-2:].set(jnp.where(k == "attention_mask", 1, 3)) for k, v in d.items()}
    for mistake in BROKEN:
        encoders = [towers()[0], breaking(mistake)]
        got = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, PACKING))(params, q, d)
        want = full_batch(loss_fn, encoders, params, q, d)
        with pytest.raises(AssertionError):
            chex.assert_trees_all_close(got, want, **TOL)
        assert np.isfinite(want[0])


def test_the_testing_helper_catches_an_encoder_that_ignores_the_packing():
    params, encoders = make_params(), towers(packed=False)
    q, d = text_batch(20, "short", 12), text_batch(20, "short", 13)
    with pytest.raises(AssertionError, match=r"rows depend on each other.*attention_mask"):
        gc_jax.testing.assert_matches_full_batch(loss_fn, encoders, PACKING, params, q, d)


@pytest.mark.parametrize("chunking", [PACKING, BUCKETED])
def test_shard_map_packs_per_device(chunking):
    """Each device packs its own rows. With buckets, some devices have no row of some
    bucket (the lognormal queries' long ones): they encode a made-up line that writes
    nothing, and the step stays exact (no NaN from an empty line), under ``pmap`` too."""
    mesh = jax.make_mesh((8,), ("d",))
    params, encoders = make_params(), towers()
    q, d = text_batch(48, "lognormal", 14), text_batch(48, "uniform", 15)
    per_device = chunking.chunk_counts(lengths_of(q).reshape(8, -1), PADDED)
    if chunking.buckets:
        long_rows = (lengths_of(q).reshape(8, -1) > 8).sum(1)
        assert (long_rows == 0).any() and per_device[(4, PADDED)] > 0
    loss = lambda p, q, d: loss_fn(p, q, d, axis_name="d")
    grad_fn = gc_jax.cached_value_and_grad(loss, encoders, chunking, axis_name="d")
    step = jax.jit(
        jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    )
    put = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("d"))), t)
    got = step(params, put(q), put(d))
    chex.assert_trees_all_close(got, full_batch(loss_fn, encoders, params, q, d), **TOL)
    if chunking.buckets:  # pmap: the same per-device plans
        split = lambda t: jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), t)
        mapped = jax.pmap(grad_fn, axis_name="d", in_axes=(None, 0, 0), devices=jax.devices()[:8])
        got = jax.tree.map(lambda x: x[0], mapped(params, split(q), split(d)))
        chex.assert_trees_all_close(got, full_batch(loss_fn, encoders, params, q, d), **TOL)


@pytest.mark.parametrize(("set_mesh", "chunking"), [(False, PACKING), (True, PACKING),
                                                     (False, BUCKETED)])  # fmt: skip
def test_sharded_jit_over_explicit_axes(set_mesh, chunking):
    """Explicit axes (``jax.make_mesh``'s default), with and without ``jax.set_mesh``:
    each device's rows packed on their own, exact."""
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    params, encoders = make_params(), towers(one_hot=True)
    q, d = text_batch(32, "lognormal", 16, lang=True), text_batch(32, "short", 17)
    put = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("d"))), t)
    want = full_batch(loss_fn, encoders, params, q, d)
    cached = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, chunking))
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        got = cached(params, put(q), put(d))
    chex.assert_trees_all_close(jax.device_get(got), want, **TOL)


def test_an_encoder_that_returns_one_row_per_line_is_told_what_to_return():
    params = make_params()
    per_line = lambda p, x, key: x["input_ids"].astype(jnp.float32) @ p["q"]["pos"]
    q = text_batch(8, "short", 18)
    grad_fn = gc_jax.cached_value_and_grad(loss_fn, per_line, PACKING)
    with pytest.raises(ValueError, match=r"\(4, 8\) for a chunk of 16 rows.*one row per slot"):
        grad_fn(params, q, q)


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ((jnp.ones((8, 16), jnp.int32),), TypeError, "packs a dict batch"),
        (
            {
                "input_ids": jnp.ones((8, 16), jnp.int32),
                "segment_ids": jnp.ones((8, 16), jnp.int32),
            },
            ValueError,
            "already has",
        ),
        ({"input_ids": jnp.ones((8, 16), jnp.int32)}, ValueError, "attention_mask"),
    ],
)
def test_batch_errors(batch, error, match):
    encode = lambda p, x, key: packing.mean_pool(p["q"]["emb"][x["input_ids"]], x)
    with pytest.raises(error, match=match):
        gc_jax.chunked_encoder(encode, PACKING)(make_params(), batch)


def test_differentiating_the_batch_is_refused():
    encode = lambda p, x, key: packing.mean_pool(x["emb"], x)
    mask = jnp.ones((8, 16), jnp.int32)
    encoded = gc_jax.chunked_encoder(encode, PACKING)
    f = lambda emb: encoded(None, {"emb": emb, "attention_mask": mask}).sum()
    with pytest.raises(ValueError, match="cannot be differentiated"):
        jax.grad(f)(jnp.ones((8, 16, 2)))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"tokens": 0, "segments": 4},
            TypeError,
            r"TokenPacking\(tokens=\.\.\.\) must be a positive int",
        ),
        ({"tokens": 64, "segments": 1}, ValueError, "at least 2"),
        (
            {"tokens": 64, "segments": 2.0},
            TypeError,
            r"TokenPacking\(segments=\.\.\.\) must be a positive int",
        ),
        (
            {"tokens": 64, "segments": 4, "lengths": 3},
            TypeError,
            r"TokenPacking\(lengths=\.\.\.\) must be",
        ),
        ({"tokens": 64, "segments": 4, "buckets": 16}, TypeError, r"buckets=\.\.\.\) must be a"),
        ({"tokens": 64, "segments": 4, "buckets": (8, 4)}, ValueError, "must increase strictly"),
    ],
)
def test_bad_packing(kwargs, error, match):
    with pytest.raises(error, match=match):
        gc_jax.TokenPacking(**kwargs)


def test_tokens_smaller_than_a_line():
    encode = lambda p, x, key: packing.mean_pool(p["q"]["emb"][x["input_ids"]], x)
    with pytest.raises(ValueError, match="smaller than one line"):
        encoded = gc_jax.chunked_encoder(encode, gc_jax.TokenPacking(8, 2))
        encoded(make_params(), text_batch(4, "short", 0))


def test_largest_chunk_size_names_the_packing():
    with pytest.raises(TypeError, match=r"candidates\[0\] is a gc_jax.TokenPacking"):
        gc_jax.largest_chunk_size(lambda c: None, (), [PACKING])


def test_packing_helpers_unpacked_are_the_plain_ones():
    q = text_batch(6, "uniform", 19)
    hidden = jax.random.normal(jax.random.key(0), (6, PADDED, 3))
    m = q["attention_mask"][..., None]
    chex.assert_trees_all_close(packing.mean_pool(hidden, q), (hidden * m).sum(1) / m.sum(1))
    chex.assert_trees_all_close(packing.first_token(hidden, q), hidden[:, 0])
    assert packing.attention_mask(q).shape == (6, 1, 1, PADDED)
    np.testing.assert_array_equal(packing.positions(q)[2], np.arange(PADDED))


def test_a_model_without_the_packing_keys_is_told_what_to_read():
    from flax import nnx

    class Pool(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((VOCAB, 2)))

        def __call__(self, input_ids, attention_mask):
            return self.w[input_ids].sum(1)

    model = Pool()
    encode = gc_jax.nnx_encoder(model)
    with pytest.raises(TypeError, match=r"does not take the keys a gc_jax\.TokenPacking adds"):
        gc_jax.chunked_encoder(encode, PACKING)(
            nnx.state(model, nnx.Param), text_batch(8, "short", 0)
        )


def test_grad_cache_class_with_a_packing():
    """``GradCache`` with NNX modules that read the packing keys (``model(**chunk)``)."""
    from flax import nnx

    class Tower(nnx.Module):
        def __init__(self, seed):
            self.emb = nnx.Embed(VOCAB, WIDTH, rngs=nnx.Rngs(seed))
            self.out = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(seed + 1))

        def __call__(self, input_ids, attention_mask, **packed):
            chunk = {"input_ids": input_ids, "attention_mask": attention_mask, **packed}
            x = self.emb(input_ids)
            scores = jnp.einsum("bqd,bkd->bqk", x, x)
            x = jax.nn.softmax(jnp.where(packing.attention_mask(chunk)[:, 0], scores, -1e9)) @ x
            return packing.mean_pool(jnp.tanh(self.out(x)), chunk)

    mq, md = Tower(0), Tower(2)
    q, d = text_batch(20, "lognormal", 22), text_batch(20, "short", 23)
    loss, grads = gc_jax.compat.GradCache([mq, md], PACKING, contrastive_loss)(q, d)
    state = lambda m: nnx.state(m, nnx.Param)

    def full(pq, pd):
        rq, rd = (nnx.merge(nnx.graphdef(m), p) for m, p in ((mq, pq), (md, pd)))
        return contrastive_loss(rq(**q), rd(**d))

    want = jax.jit(jax.value_and_grad(full, argnums=(0, 1)))(state(mq), state(md))
    chex.assert_trees_all_close((loss, grads), want, **TOL)


def test_left_padding_and_a_lengths_callable_are_exact():
    """A left-padded mask packs each row up to its last token (the leading padding
    stays masked); a ``lengths=`` callable that undercounts never cuts a masked-in token."""
    params, encoders = make_params(), towers()
    q, d = text_batch(16, "short", 24), text_batch(16, "uniform", 25)
    q = {k: v[:, ::-1] for k, v in q.items()}  # left padding
    want = full_batch(loss_fn, encoders, params, q, d)
    undercount = lambda b: b["input_ids"][:, 0]
    for chunking in [PACKING, gc_jax.TokenPacking(64, 4, undercount, buckets=(4, 8, 16))]:
        got = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, chunking))(params, q, d)
        chex.assert_trees_all_close(got, want, **TOL)


def test_for_lengths_picks_segments_that_never_limit_a_line():
    rng = np.random.default_rng(5)
    sample = np.clip(np.round(rng.lognormal(np.log(3), 0.8, (4, 64))), 1, PADDED).astype(int)
    packing_ = gc_jax.TokenPacking.for_lengths(sample, 64, PADDED)
    assert packing_.segments == max(
        len(line) for row in sample for line in token_packing.pack_lines(row, PADDED, PADDED)
    )
    for row in sample:  # the lines of a packing without a limit
        lines = token_packing.pack_lines(row, PADDED, PADDED)
        assert token_packing.pack_lines(row, PADDED, packing_.segments) == lines
    with pytest.raises(ValueError, match=r"TokenPacking\.for_lengths\(sample=\.\.\.\) has lengths"):
        gc_jax.TokenPacking.for_lengths([[PADDED + 1]], 64, PADDED)
    with pytest.raises(ValueError, match="smaller than one line"):
        gc_jax.TokenPacking.for_lengths(sample, 8, PADDED)


def test_buckets_name_a_batch_longer_than_every_line():
    encode = lambda p, x, key: packing.mean_pool(p["q"]["emb"][x["input_ids"]], x)
    too_short = gc_jax.TokenPacking(64, 4, buckets=(4, 8))
    with pytest.raises(ValueError, match=r"padded to 16 tokens.*Add 16 to buckets"):
        gc_jax.chunked_encoder(encode, too_short)(make_params(), text_batch(4, "short", 0))


def test_buckets_refuse_outputs_that_depend_on_the_line_length():
    per_token = lambda p, x, key: jnp.zeros((x["segment_starts"].size, x["input_ids"].shape[1]))
    q = text_batch(16, "uniform", 26)
    said = r"\(64, 4\) \(float32\) for lines of 4 tokens but \(32, 8\).*one representation"
    with pytest.raises(ValueError, match=said):
        gc_jax.chunked_encoder(per_token, BUCKETED)(make_params(), q)


def test_the_testing_helper_checks_a_bucketed_packing():
    """The helper's reference replays every bucket's chunks with their dropout keys."""
    params, encoders = make_params(), towers(dropout=0.25)
    q, d = text_batch(12, "lognormal", 27), text_batch(12, "uniform", 28)
    two = gc_jax.TokenPacking(tokens=64, segments=4, buckets=(8, 16))
    gc_jax.testing.assert_matches_full_batch(loss_fn, encoders, two, params, q, d,
                                             rng=jax.random.key(1))  # fmt: skip


def test_for_lengths_fits_line_lengths_to_the_modelled_flops():
    """With ``attention_width``, the line lengths cost fewer modelled FLOPs on the sample
    than one line length (and than the fit's every start), the cost modelled is that of
    the chunks the step encodes, ``segments`` still never limits a line, and a wide
    encoder (attention cheap) keeps one line length."""
    rng = np.random.default_rng(6)
    sample = np.clip(np.round(rng.lognormal(np.log(20), 0.9, (4, 512))), 1, 128).astype(int)
    fitted = gc_jax.TokenPacking.for_lengths(sample, 1024, 128, attention_width=8)
    assert fitted.buckets is not None and fitted.buckets[-1] == 128
    cost = token_packing._lines_cost(sample, 1024, 128, 8)
    assert cost(fitted.buckets) < 0.95 * cost((128,))
    from gc_jax._chunks import spans  # the model counts the chunks the step encodes

    def step_cost(row):
        counts = fitted.chunk_counts(row, 128)
        shapes = list(counts)
        flops = spans.chunk_costs(*zip(*shapes, strict=True), attention_width=8)
        return sum(counts[s] * f for s, f in zip(shapes, flops, strict=True))

    np.testing.assert_allclose(cost(fitted.buckets), np.mean([step_cost(r) for r in sample]))
    for row in sample:
        lines = token_packing.lines_by_bucket(row, fitted.buckets)
        assert max(len(line) for bucket in lines for line in bucket) <= fitted.segments
    assert gc_jax.TokenPacking.for_lengths(sample, 1024, 128, attention_width=1e6).buckets is None
    assert gc_jax.TokenPacking.for_lengths(sample, 1024, 128).buckets is None
    with pytest.raises(ValueError, match=r"for_lengths\(attention_width=\.\.\.\) must be a pos"):
        gc_jax.TokenPacking.for_lengths(sample, 1024, 128, attention_width=-1.0)


def test_for_lengths_fits_the_chunk_size_with_min_tokens():
    """At 12 rows a batch a chunk of 8 lines is mostly empty lines: with ``min_tokens``
    the fit keeps the chunk size (of 128, 64, 32 tokens) whose chunks cost least, one
    line length or fitted ones; the step with lines of a few lengths in chunks of one
    line each is exact against the full padded batch."""
    q, d = text_batch(12, "lognormal", 30, lang=True), text_batch(12, "lognormal", 31)
    sample = np.stack([lengths_of(q), lengths_of(d)])
    cost = lambda t: token_packing._lines_cost(sample, t, PADDED, None)((PADDED,))
    fitted = gc_jax.TokenPacking.for_lengths(sample, 128, PADDED, min_tokens=32, min_saving=0)
    assert fitted.tokens == min((128, 64, 32), key=cost) and cost(fitted.tokens) < cost(128)
    assert gc_jax.TokenPacking.for_lengths(sample, 128, PADDED).tokens == 128
    lines = gc_jax.TokenPacking.for_lengths(sample, 128, PADDED, attention_width=1, min_tokens=16)
    assert lines.tokens == PADDED and lines.buckets is not None
    params, encoders = make_params(), towers()
    grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, lines))
    chex.assert_trees_all_close(grad_fn(params, q, d), full_batch(loss_fn, encoders, params, q, d),
                                **TOL)  # fmt: skip


@pytest.mark.parametrize("buckets", [None, (32, 64, 128)])
def test_the_lines_a_packing_shows_are_the_ones_it_counts(buckets):
    """``TokenPacking.lines``: every row in one line, a line within its length and its
    ``segments``, and as many lines as ``chunk_counts`` counts chunks for."""
    lengths = np.random.default_rng(0).integers(0, 129, 90)
    packing_ = gc_jax.TokenPacking(tokens=512, segments=4, buckets=buckets)
    found = packing_.lines(lengths, 128)
    placed = sorted(r for lines in found.values() for line in lines for r in line)
    assert placed == list(range(len(lengths)))
    for width, lines in found.items():
        for line in lines:
            assert len(line) <= packing_.segments
            assert sum(int(lengths[r]) or width for r in line) <= width, (width, line)
    counts = packing_.chunk_counts(lengths, 128)
    want = {n: -(-len(found[n]) // (512 // n)) for n in found}
    assert {n: counts[(512 // n, n)] for n in found} == want
    with pytest.raises(ValueError, match=r"TokenPacking.lines\(lengths=...\) takes \[rows\]"):
        packing_.lines(lengths[None], 128)
