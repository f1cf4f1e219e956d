"""``gc_jax.packing.attention``: each row attends to its own kept tokens only, exact
against dense masked scores (float64) and, through ``cached_value_and_grad`` with a
``TokenPacking``, against the full padded batch unpacked."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gc_jax
from gc_jax import packing
from gc_jax.losses import contrastive_loss

HEADS, DIM = 2, 4


def packed_chunk(rows_per_line, length, hole=False):
    """A packed chunk whose lines hold rows of the given lengths (a line ``[]``: an
    empty row's line); ``hole``: the first row's second token is masked."""
    lines = len(rows_per_line)
    segment = np.zeros((lines, length), np.int32)
    mask = np.zeros((lines, length), np.int32)
    for line, rows in enumerate(rows_per_line):
        start = 0
        for k, n in enumerate(rows):
            segment[line, start : start + n], mask[line, start : start + n] = k + 1, 1
            start += n
    if hole:
        mask[0, 1] = 0
    most = max(1, *map(len, rows_per_line))
    return {"attention_mask": jnp.asarray(mask), "segment_ids": jnp.asarray(segment),
            "segment_starts": jnp.zeros((lines, most), jnp.int32)}  # fmt: skip


def dense_reference(q, k, v, chunk):
    """Scores masked by ``packing.attention_mask``, filled with the dtype's minimum."""
    keep = packing.attention_mask(chunk)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("lqhd,lkhd->lhqk", q, k, precision=hi) / np.sqrt(q.shape[-1])
    scores = jnp.where(keep, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("lhqk,lkhd->lqhd", jax.nn.softmax(scores, -1), v, precision=hi)


def in_rows(chunk):
    """Where a query belongs to a row (or is an unpacked row's token)."""
    if packing.is_packed(chunk):
        return (chunk["segment_ids"] > 0)[..., None, None]
    return jnp.ones((*chunk["attention_mask"].shape, 1, 1), bool)


CHUNKS = {
    "rows of a few lengths, a hole, an empty row": lambda: packed_chunk(
        [[10, 5, 20], [64], [3, 3, 1], []], 64, hole=True),
    "many short rows (few blocks)": lambda: packed_chunk([[8] * 8] * 6, 64),
    "unpacked, an empty row": lambda: {"attention_mask": jnp.asarray(
        np.arange(64)[None] < np.array([[30], [0], [64]]), jnp.int32)},
}  # fmt: skip


# "blocked" with blocks of 8 here and in the packed step below, of 4 in the docstring.
@pytest.mark.parametrize("implementation,block", [("xla", 8), ("blocked", 8), (None, 32)])
@pytest.mark.parametrize("name", CHUNKS)
def test_matches_dense_masked_scores(name, implementation, block):
    with jax.enable_x64():
        chunk = CHUNKS[name]()
        lines, length = chunk["attention_mask"].shape
        q, k, v = jax.random.normal(jax.random.key(0), (3, lines, length, HEADS, DIM), jnp.float64)
        kept = in_rows(chunk)
        attend = lambda f: lambda q, k, v: jnp.where(kept, f(q, k, v), 0)
        ours = attend(lambda q, k, v: packing.attention(
            q, k, v, chunk, implementation=implementation, block_size=block))  # fmt: skip
        ref = attend(lambda q, k, v: dense_reference(q, k, v, chunk))
        squares = lambda f: jax.jit(jax.value_and_grad(
            lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))  # fmt: skip
        chex.assert_trees_all_close(jax.jit(ours)(q, k, v), ref(q, k, v), atol=1e-6)
        chex.assert_trees_all_close(squares(ours)(q, k, v), squares(ref)(q, k, v), atol=1e-6)
        assert bool(jnp.all(jnp.isfinite(packing.attention(q, k, v, chunk))))


def test_blocked_skips_blocks_across_rows():
    """With many short rows the blocks pairing a row with itself are an eighth of the
    chunk's: the branch for an eighth runs, at a fraction of the dense FLOPs."""
    chunk = packed_chunk([[8] * 8] * 6, 64)
    ids = packing.segment_ids(chunk)
    x = jax.ShapeDtypeStruct((6, 64, HEADS, DIM), jnp.float32)
    pairs = packing._pairs(*ids, 8)  # [lines, query block, key block]
    chex.assert_trees_all_equal(pairs, jnp.eye(8, dtype=bool)[None].repeat(6, 0))
    caps = packing._caps(pairs.size)
    cap = caps[int(np.searchsorted(caps, int(jnp.sum(pairs))))]
    assert cap == pairs.size // 8
    sparse = lambda q, k, v: packing._block_pairs(q, k, v, *ids, pairs, block=8, cap=cap)
    flops = lambda f: jax.jit(f).lower(x, x, x).cost_analysis()["flops"]
    assert flops(sparse) < 0.3 * flops(lambda q, k, v: packing._dense(q, k, v, *ids))
    q, k, v = jax.random.normal(jax.random.key(0), (3, 6, 64, HEADS, DIM))
    chex.assert_trees_all_close(sparse(q, k, v), packing.attention(
        q, k, v, chunk, implementation="xla"), atol=1e-6)  # fmt: skip


def encoder(implementation):
    """One attention layer through ``packing.attention``, positions within each row,
    mean pooling per row."""

    def encode(p, batch, key):
        ids = batch["input_ids"]
        x = p["emb"][ids] + p["pos"][packing.positions(batch)]
        q, k, v = (jnp.einsum("btd,dhe->bthe", x, p[n]) for n in ("q", "k", "v"))
        a = packing.attention(q, k, v, batch, implementation=implementation, block_size=8)
        x = x + jnp.tanh(a.reshape(x.shape))
        return packing.mean_pool(x, batch)

    return encode


def test_packed_step_matches_the_full_batch_unpacked():
    keys = jax.random.split(jax.random.key(1), 5)
    width, padded, rows = HEADS * DIM, 32, 24
    params = {"emb": jax.random.normal(keys[0], (13, width)),
              "pos": jax.random.normal(keys[1], (padded, width)),
              **{n: jax.random.normal(keys[i], (width, HEADS, DIM)) / 3
                 for i, n in enumerate("qkv", 2)}}  # fmt: skip

    def batch(seed):
        rng = np.random.default_rng(seed)
        length = np.clip(np.round(rng.lognormal(np.log(6), 0.8, rows)), 1, padded)
        mask = (np.arange(padded)[None] < length[:, None]).astype(np.int32)
        return {"input_ids": jnp.asarray(rng.integers(1, 13, mask.shape) * mask, jnp.int32),
                "attention_mask": jnp.asarray(mask)}  # fmt: skip

    loss = lambda p, q, d: contrastive_loss(q, d, temperature=0.1)
    q, d = batch(0), batch(1)
    full = lambda p: loss(p, *(encoder("xla")(p, x, None) for x in (q, d)))
    expected = jax.jit(jax.value_and_grad(full))(params)
    packed = gc_jax.TokenPacking(tokens=4 * padded, segments=8)
    bucketed = gc_jax.TokenPacking(4 * padded, 8, buckets=(4, 8, 32))  # at most a block: dense
    for implementation, chunking in [("blocked", packed), (None, packed), ("blocked", bucketed)]:
        grad_fn = gc_jax.cached_value_and_grad(loss, encoder(implementation), chunking)
        chex.assert_trees_all_close(jax.jit(grad_fn)(params, q, d), expected,
                                    rtol=2e-5, atol=2e-6)  # fmt: skip


@pytest.mark.parametrize("kwargs,match", [
    ({"implementation": "flash"}, "implementation: got 'flash'"),
    ({"implementation": "blocked", "block_size": 5}, "block_size: got 5"),
    ({"implementation": "blocked", "block_size": 6}, r"multiples of it \(TokenPacking.*multiple=6"),
])  # fmt: skip
def test_errors_name_the_argument(kwargs, match):
    chunk = packed_chunk([[4, 4]], 16)
    x = jnp.ones((1, 16, HEADS, DIM))
    with pytest.raises(ValueError, match=match):
        packing.attention(x, x, x, chunk, **kwargs)


@pytest.mark.parametrize("bad", [0, 8.0, True])
def test_block_size_must_be_a_positive_int(bad):
    chunk = packed_chunk([[4, 4]], 16)
    x = jnp.ones((1, 16, HEADS, DIM))
    with pytest.raises(TypeError, match=r"attention\(block_size=\.\.\.\) must be a positive int"):
        packing.attention(x, x, x, chunk, implementation="blocked", block_size=bad)


# --- Each packing helper names a chunk or an array that does not fit (issue 47, item 5) ---

PACKED = packed_chunk([[4, 4], [8]], 16)
UNPACKED = {"attention_mask": PACKED["attention_mask"]}
WRONG = {"lines": (3, 16), "length": (2, 8)}  # [lines, L] of arrays from another chunk
FITS = r"the chunk holds 2 lines of 16 tokens .*pass {} computed from this chunk's tokens, \[2, 16"


@pytest.mark.parametrize("chunk", [PACKED, UNPACKED], ids=["packed", "unpacked"])
@pytest.mark.parametrize("wrong", WRONG)
def test_arrays_of_another_chunk_are_named(chunk, wrong):
    x = jnp.ones((*WRONG[wrong], HEADS, DIM))
    with pytest.raises(ValueError, match=r"attention: query has shape .*" + FITS.format("query")):
        packing.attention(x, x, x, chunk)
    with pytest.raises(ValueError, match=r"mean_pool: hidden has shape .*" + FITS.format("hidden")):
        packing.mean_pool(x[..., 0, :], chunk)
    if packing.is_packed(chunk):
        with pytest.raises(ValueError, match=r"first_token: hidden .*" + FITS.format("hidden")):
            packing.first_token(x[..., 0, :], chunk)


X = jnp.ones((2, 16, HEADS, DIM))
CALLS = {
    "attention": lambda chunk: packing.attention(X, X, X, chunk),
    "attention_mask": packing.attention_mask,
    "segment_ids": packing.segment_ids,
    "mean_pool": lambda chunk: packing.mean_pool(X[..., 0, :], chunk),
}


@pytest.mark.parametrize("name", CALLS)
def test_a_chunk_without_its_mask_is_named(name):
    chunk = {"input_ids": PACKED["segment_ids"], "segment_ids": PACKED["segment_ids"]}
    keys = r"\(chunk=\.\.\.\) has no 'attention_mask' key \(its keys: \['input_ids', 'segment_ids'"
    with pytest.raises(ValueError, match=keys + r".*name the key with mask='\.\.\.'"):
        CALLS[name](chunk)
    not_a_dict = r"\(chunk=\.\.\.\) must be the dict batch the encoder receives .*\(2, 16\)"
    with pytest.raises(TypeError, match=not_a_dict):
        CALLS[name](PACKED["attention_mask"])


def test_positions_and_pooling_name_their_missing_key():
    with pytest.raises(
        ValueError, match=r"positions\(chunk=\.\.\.\) has no 'input_ids' key.*key='"
    ):
        packing.positions(UNPACKED)
    no_starts = {k: v for k, v in PACKED.items() if k != "segment_starts"}
    with pytest.raises(ValueError, match=r"mean_pool\(chunk=\.\.\.\) has no 'segment_starts' key"):
        packing.mean_pool(X[..., 0, :], no_starts)
    apart = {**PACKED, "segment_ids": PACKED["segment_ids"][:, :8]}
    shapes = (
        r"chunk\['segment_ids'\] has shape \(2, 8\) and chunk\['attention_mask'\] shape \(2, 16"
    )
    with pytest.raises(ValueError, match=shapes + r".*TokenPacking gives the encoder"):
        packing.attention_mask(apart)


def test_splash_off_tpu_names_the_platform_and_the_fix():
    """Pallas's own error says only "Only interpret mode is supported on CPU backend"."""
    chunk = {"attention_mask": jnp.ones((1, 128), jnp.int32)}
    splash = lambda x: packing.attention(x, x, x, chunk, implementation="splash")
    fix = (r"splash attention is a Pallas TPU kernel, and this program is compiled for cpu; "
           r"write implementation=None .* or implementation='xla'")  # fmt: skip
    for run in (splash, jax.jit(splash), jax.jit(jax.grad(lambda x: jnp.sum(splash(x))))):
        with pytest.raises(ValueError, match=fix):
            run(jnp.ones((1, 128, HEADS, DIM)))
