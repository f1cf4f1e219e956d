"""maxsim_loss (ColBERT late interaction): exact against its definition, on one device.

Dense and blockwise forms against a naive reference (jax.value_and_grad of the formula
written out), masks, ties, precision, errors and memory. Across devices and inside the
gradient cache (token budgets included): tests/test_maxsim_sharded.py.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gc_jax.losses import maxsim_loss

TOL = {"rtol": 2e-5, "atol": 2e-6}
BLOCK_TOL = {"rtol": 1e-4, "atol": 1e-5}  # blockwise sums in another order


def data(n: int, k: int = 1, tokens=(4, 5), dim: int = 6, seed: int = 0):
    """Queries ``[n, T, dim]``, documents ``[n * k, S, dim]`` and random token masks.

    Query 1 and document 2 have no token at all (a query scores 0; a document -1e9).
    """
    kq, kd, kmq, kmd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (n, tokens[0], dim))
    d = jax.random.normal(kd, (n * k, tokens[1], dim))
    q_mask = jax.random.bernoulli(kmq, 0.7, q.shape[:2]).at[:, 0].set(True).at[1].set(False)
    d_mask = jax.random.bernoulli(kmd, 0.7, d.shape[:2]).at[:, 0].set(True).at[2].set(False)
    return q, d, q_mask, d_mask


def ref_scores(q, d, q_mask, d_mask):
    """The definition: ``s[i, j] = sum_t q_mask * max_{u: d_mask} q[i, t] . d[j, u]``."""
    sims = jnp.einsum("itc,juc->ijtu", q, d)
    best = jnp.where(d_mask[None, :, None, :], sims, -jnp.inf).max(-1)
    filled = d_mask.any(-1)[None, :]
    best = jnp.where(filled[..., None], best, 0.0)
    scores = jnp.where(q_mask[:, None, :], best, 0.0).sum(-1)
    return jnp.where(filled, scores, -1e9)  # a document with no token: out of the softmax


def ref_maxsim(q, d, q_mask, d_mask, temperature, reduction="mean"):
    k = d.shape[0] // q.shape[0]
    logp = jax.nn.log_softmax(ref_scores(q, d, q_mask, d_mask) / temperature, axis=1)
    per_row = -logp[jnp.arange(q.shape[0]), jnp.arange(q.shape[0]) * k]
    return {"mean": jnp.mean, "sum": jnp.sum, "none": lambda v: v}[reduction](per_row)


def value_and_grads(loss, q, d, q_mask, d_mask, temperature, **kw):
    """Value and gradients w.r.t. q, d and the temperature, under jit."""
    f = lambda q, d, t: loss(q, d, q_mask=q_mask, d_mask=d_mask, temperature=t, **kw)
    if kw.get("reduction") == "none":
        weights = jnp.linspace(-1.0, 2.0, q.shape[0])  # a cotangent per row
        g = f
        f = lambda q, d, t: jnp.sum(weights * g(q, d, t))
    return jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, d, jnp.float32(temperature))


def reference(q, d, q_mask, d_mask, temperature, **kw):
    ref = lambda q, d, *, q_mask, d_mask, temperature, reduction="mean", **_: ref_maxsim(
        q, d, q_mask, d_mask, temperature, reduction
    )
    return value_and_grads(ref, q, d, q_mask, d_mask, temperature, **kw)


FORMS = [  # (k, block_size, reduction)
    (1, None, "mean"),
    (3, None, "sum"),
    (1, None, "none"),
    (1, 1, "mean"),
    (1, 3, "sum"),  # 7 rows: the last block overlaps the one before
    (3, 4, "mean"),  # 7 queries, 21 documents
    (2, 5, "none"),
    (2, 64, "mean"),  # one block larger than the batch
]


@pytest.mark.parametrize(("k", "block_size", "reduction"), FORMS)
def test_matches_reference(k, block_size, reduction):
    q, d, q_mask, d_mask = data(7, k)
    kw = {"block_size": block_size, "reduction": reduction}
    got = value_and_grads(maxsim_loss, q, d, q_mask, d_mask, 0.7, **kw)
    want = reference(q, d, q_mask, d_mask, 0.7, reduction=reduction)
    chex.assert_trees_all_close(got, want, **(TOL if block_size is None else BLOCK_TOL))


def test_per_row_losses_match_reference():
    q, d, q_mask, d_mask = data(6, 2)
    want = ref_maxsim(q, d, q_mask, d_mask, 0.5, "none")
    for block_size in (None, 4):
        got = maxsim_loss(
            q, d, q_mask=q_mask, d_mask=d_mask, temperature=0.5, reduction="none",
            block_size=block_size,
        )  # fmt: skip
        assert got.shape == (6,)
        chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_values_match_float64_numpy():
    """The loss written in numpy float64, loops and all."""
    q, d, q_mask, d_mask = (np.asarray(v) for v in data(5, 2))
    qd, dd = q.astype(np.float64), d.astype(np.float64)
    s = np.zeros((5, 10))
    for i in range(5):
        for j in range(10):
            for t in np.flatnonzero(q_mask[i]):
                u = np.flatnonzero(d_mask[j])
                s[i, j] += (dd[j, u] @ qd[i, t]).max() if len(u) else 0.0
    s[:, ~d_mask.any(1)] = -1e9  # a document with no token (here a hard negative)
    z = s / 0.3
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    want = np.mean(lse - z[np.arange(5), 2 * np.arange(5)])
    for block_size in (None, 3):
        got = maxsim_loss(
            q, d, q_mask=q_mask, d_mask=d_mask, temperature=0.3, block_size=block_size
        )
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_blockwise_matches_dense_in_float64():
    """In float64 rounding vanishes: the blockwise math is the dense math."""
    with jax.enable_x64(True):
        q, d, q_mask, d_mask = data(9, 2)
        q, d = q.astype(jnp.float64), d.astype(jnp.float64)
        got = value_and_grads(maxsim_loss, q, d, q_mask, d_mask, 0.4, block_size=4)
        want = value_and_grads(maxsim_loss, q, d, q_mask, d_mask, 0.4)
        assert got[0].dtype == jnp.float64
        chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)


# Masks and ties.


def test_masks_default_to_every_token_and_take_integers():
    q, d, q_mask, d_mask = data(5, 2)
    every = maxsim_loss(q, d, temperature=0.5, block_size=3)
    ones = maxsim_loss(
        q, d, q_mask=jnp.ones(q.shape[:2], bool), d_mask=jnp.ones(d.shape[:2], int), temperature=0.5
    )
    chex.assert_trees_all_close(every, ones, **BLOCK_TOL)
    ints = maxsim_loss(q, d, q_mask=q_mask.astype(jnp.int32), d_mask=d_mask.astype(jnp.uint8))
    chex.assert_trees_all_close(ints, maxsim_loss(q, d, q_mask=q_mask, d_mask=d_mask), **TOL)


@pytest.mark.parametrize("block_size", [None, 3])
def test_masked_tokens_change_nothing_and_get_no_gradient(block_size):
    """Whatever a masked token holds (here huge values), the loss ignores it."""
    q, d, q_mask, d_mask = data(6, 2)
    loss = functools.partial(maxsim_loss, q_mask=q_mask, d_mask=d_mask, block_size=block_size)
    noisy_q = jnp.where(q_mask[..., None], q, 1e4)
    noisy_d = jnp.where(d_mask[..., None], d, -1e4)
    got = jax.jit(jax.value_and_grad(loss, (0, 1)))(noisy_q, noisy_d)
    want = jax.jit(jax.value_and_grad(loss, (0, 1)))(q, d)
    chex.assert_trees_all_close(got, want, **TOL)
    dq, dd = got[1]
    assert not jnp.any(jnp.where(q_mask[..., None], 0.0, dq))
    assert not jnp.any(jnp.where(d_mask[..., None], 0.0, dd))
    assert bool(jnp.isfinite(got[0]))


def test_tied_maxima_share_the_gradient_as_jnp_max_does():
    """Documents with repeated tokens: a query token's gradient is split between them."""
    q, d, _, _ = data(5, 1, tokens=(3, 2))
    d = jnp.concatenate([d, d[:, :1]], axis=1)  # token 0 again: every maximum there ties
    got = value_and_grads(maxsim_loss, q, d, None, None, 0.5, block_size=2)
    ones = lambda v: jnp.ones(v.shape[:2], bool)
    want = reference(q, d, ones(q), ones(d), 0.5)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_large_logits_are_stable():
    """Logits in the hundreds: the online log-sum-exp neither overflows nor loses them."""
    q, d, q_mask, d_mask = data(7, 1)
    got = value_and_grads(maxsim_loss, q, d, q_mask, d_mask, 0.01, block_size=3)
    with jax.enable_x64(True):
        q64, d64 = q.astype(jnp.float64), d.astype(jnp.float64)
        want = reference(q64, d64, q_mask, d_mask, np.float64(0.01))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))
    chex.assert_trees_all_close(got, jax.tree.map(np.float32, want), rtol=1e-3, atol=1e-3)


# Narrow inputs: accumulated in float32, gradients in the inputs' dtype.


@pytest.mark.parametrize("block_size", [None, 16])
def test_bfloat16_tokens_match_float32(block_size):
    """64 queries of unit token vectors at temperature 0.05, within 1e-2 of float32."""
    q, d, q_mask, d_mask = data(64, 2, tokens=(8, 12), dim=32, seed=3)
    unit = lambda v: (v / jnp.linalg.norm(v, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    q, d = unit(q), unit(d)
    got = value_and_grads(maxsim_loss, q, d, q_mask, d_mask, 0.05, block_size=block_size)
    wide = lambda v: v.astype(jnp.float32)
    want = value_and_grads(maxsim_loss, wide(q), wide(d), q_mask, d_mask, 0.05)
    value, (dq, dd, dt) = got
    assert (value.dtype, dq.dtype, dd.dtype, dt.dtype) == (
        jnp.float32, jnp.bfloat16, jnp.bfloat16, jnp.float32,
    )  # fmt: skip
    chex.assert_trees_all_close(value, want[0], rtol=1e-3)
    for g, w in zip(got[1], want[1], strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= 1e-2 * np.linalg.norm(w)


# Validation: errors name the argument.

Q, D = jnp.ones((4, 3, 8)), jnp.ones((8, 5, 8))
BAD = [  # (q, d, keywords, error, message)
    (jnp.ones((4, 8)), D, {}, ValueError, r"q must be a 3-D \[rows, tokens, dim\]"),
    (Q, jnp.ones((8, 2, 5, 8)), {}, ValueError, r"d must be a 3-D"),
    (Q, jnp.ones((8, 5, 7)), {}, ValueError, r"same token dim"),
    (Q, jnp.ones((6, 5, 8)), {}, ValueError, r"len\(d\) must be a multiple of len\(q\)"),
    (Q.astype(jnp.int32), D, {}, TypeError, r"q must hold floats"),
    (Q, D, {"q_mask": jnp.ones((4, 5))}, ValueError, r"q_mask must be .* shape \(4, 3\)"),
    (Q, D, {"d_mask": jnp.ones((4, 5), bool)}, ValueError, r"d_mask must be .* shape \(8, 5\)"),
    (Q, D, {"d_mask": jnp.ones((8, 5, 1))}, ValueError, r"d_mask must be .*got shape"),
    (Q, D, {"q_mask": jnp.ones((4, 3))}, TypeError, r"q_mask must be bool or integer"),
    (Q, D, {"q_mask": [[1, 1, 1]] * 4}, ValueError, r"q_mask must be"),
    (Q, D, {"reduction": "avg"}, ValueError, r"reduction must be one of"),
    (Q, D, {"block_size": 0}, ValueError, r"block_size must be a positive int"),
    (Q, D, {"method": "scatter"}, ValueError, r"method must be one of"),
]


@pytest.mark.parametrize(("q", "d", "kw", "error", "match"), BAD)
def test_rejects_bad_arguments(q, d, kw, error, match):
    with pytest.raises(error, match=match):
        maxsim_loss(q, d, **kw)


# Memory: lowered and compiled from shapes only, never run.

MiB = 2**20


def temp_bytes(rows, tokens, dim, block_size, dtype=jnp.float32) -> int:
    """Temporary memory of the value and gradient (w.r.t. both sides), blockwise."""
    emb = jax.ShapeDtypeStruct((rows, tokens, dim), dtype)
    mask = jax.ShapeDtypeStruct((rows, tokens), jnp.bool_)
    loss = lambda q, d, qm, dm: maxsim_loss(
        q, d, q_mask=qm, d_mask=dm, temperature=0.05, block_size=block_size
    )
    compiled = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(emb, emb, mask, mask).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_at_16384_rows_of_32_tokens():
    """B = 16,384, T = 32, d = 128: within 2 GiB (the issue's bound), and less than the
    [B, B] float32 scores alone (1 GiB), let alone the dense [B, B, T, T] similarities."""
    rows = 16_384
    got = temp_bytes(rows, 32, 128, block_size=128)
    assert got <= 2 * 1024 * MiB, f"temp memory {got / MiB:.0f} MiB"
    assert got < rows * rows * 4, f"temp memory {got / MiB:.0f} MiB"


def test_blockwise_bfloat16_memory_holds_no_float32_copy():
    """bfloat16 tokens: no float32 copy of a [B, T, d] side (256 MiB at B = 16,384)."""
    narrow = temp_bytes(16_384, 32, 128, block_size=64, dtype=jnp.bfloat16)
    assert narrow < 16_384 * 32 * 128 * 4, f"temp memory {narrow / MiB:.0f} MiB"
