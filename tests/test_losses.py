"""Tests of gc_jax.losses on one device: references, blockwise vs dense, precision, memory.

Across devices (pmap, shard_map, sharded jit): tests/test_losses_sharded.py.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gc_jax.losses import clip_loss, contrastive_loss, sigmoid_loss

TOL = {"rtol": 2e-5, "atol": 2e-6}
# Blockwise sums in another order; scalar gradients sum O(rows^2) terms that cancel.
BLOCK_TOL = {"rtol": 2e-4, "atol": 2e-5}


def _data(n: int, m: int, dim: int = 5, seed: int = 0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, dim)), jax.random.normal(ky, (m, dim))


def _reduce(per_row, reduction):
    return {"mean": jnp.mean, "sum": jnp.sum, "none": lambda v: v}[reduction](per_row)


# Naive references: the definitions, written out with full logit matrices.


def ref_contrastive(x, y, temperature, reduction="mean"):
    k = y.shape[0] // x.shape[0]
    logp = jax.nn.log_softmax(x @ y.T / temperature, axis=1)
    rows = jnp.arange(x.shape[0])
    return _reduce(-logp[rows, rows * k], reduction)


def ref_clip(x, y, logit_scale, reduction="mean"):
    logits = jnp.exp(logit_scale) * x @ y.T
    diag = jnp.arange(x.shape[0])
    x_to_y = jax.nn.log_softmax(logits, axis=1)[diag, diag]
    y_to_x = jax.nn.log_softmax(logits, axis=0)[diag, diag]
    return _reduce(-(x_to_y + y_to_x) / 2, reduction)


def ref_sigmoid(x, y, logit_scale, logit_bias, reduction="mean"):
    logits = jnp.exp(logit_scale) * x @ y.T + logit_bias
    labels = 2 * jnp.eye(x.shape[0]) - 1
    return _reduce(-jax.nn.log_sigmoid(labels * logits).sum(axis=1), reduction)


# (loss, reference, k, scalar args): each case's learnable scalars come last.
CASES = {
    "contrastive": (
        lambda x, y, t, **kw: contrastive_loss(x, y, temperature=t, **kw),
        ref_contrastive,
        1,
        (0.3,),
    ),
    "contrastive_hard_negatives": (
        lambda x, y, t, **kw: contrastive_loss(x, y, temperature=t, **kw),
        ref_contrastive,
        3,
        (0.7,),
    ),
    "clip": (clip_loss, ref_clip, 1, (np.log(5.0),)),
    "sigmoid": (sigmoid_loss, ref_sigmoid, 1, (np.log(3.0), -2.0)),
}


def _value_and_grads(fn, x, y, scalars, **kw):
    """Value and gradient w.r.t. x, y and every scalar, under jit."""
    argnums = tuple(range(2 + len(scalars)))
    f = jax.jit(jax.value_and_grad(lambda *a: fn(*a, **kw), argnums=argnums))
    return f(x, y, *(jnp.asarray(s, jnp.result_type(s, x)) for s in scalars))


def _all_reductions(fn, x, y, scalars):
    """Value and gradients for "mean" and "sum", and the "none" per-row losses, in one jit."""
    argnums = tuple(range(2 + len(scalars)))

    def run(*args):
        grads = {
            r: jax.value_and_grad(functools.partial(fn, reduction=r), argnums)(*args)
            for r in ("mean", "sum")
        }
        return grads, fn(*args, reduction="none")

    return jax.jit(run)(x, y, *(jnp.float32(s) for s in scalars))


@pytest.mark.parametrize("case", list(CASES))
def test_dense_matches_reference(case):
    loss, ref, k, scalars = CASES[case]
    x, y = _data(6, 6 * k)
    got = _all_reductions(loss, x, y, scalars)
    assert got[1].shape == (6,)
    chex.assert_trees_all_close(got, _all_reductions(ref, x, y, scalars), **TOL)


def test_dense_values_match_float64_numpy():
    x, y = _data(4, 8)
    xd, yd = np.asarray(x, np.float64), np.asarray(y, np.float64)

    def log_softmax(z, axis):
        z = z - z.max(axis=axis, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))

    i = np.arange(4)
    logits = 4.0 * xd @ yd[:4].T
    want = (
        -log_softmax(xd @ yd.T / 0.5, 1)[i, 2 * i].mean(),
        -(log_softmax(logits, 1)[i, i] + log_softmax(logits, 0)[i, i]).mean() / 2,
        np.log1p(np.exp(-(2 * np.eye(4) - 1) * (logits - 1.0))).sum() / 4,
    )
    got = jax.jit(
        lambda x, y: (
            contrastive_loss(x, y, temperature=0.5),
            clip_loss(x, y[:4], np.log(4.0)),
            sigmoid_loss(x, y[:4], np.log(4.0), -1.0),
        )
    )(x, y)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# Block sizes dividing 12 rows (1, 4), not dividing (5), and larger than the rows (100).
BLOCKWISE = [("contrastive_hard_negatives", b) for b in (1, 4, 5, 100)] + [
    ("contrastive", 5),
    ("clip", 5),
    ("sigmoid", 5),
    ("sigmoid", 100),
]


@functools.cache
def _dense(case):
    loss, _, k, scalars = CASES[case]
    x, y = _data(12, 12 * k)
    return x, y, _value_and_grads(loss, x, y, scalars)


@pytest.mark.parametrize(("case", "block_size"), BLOCKWISE)
def test_blockwise_matches_dense(case, block_size):
    loss, _, _, scalars = CASES[case]
    x, y, want = _dense(case)
    got = _value_and_grads(loss, x, y, scalars, block_size=block_size)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


@pytest.mark.parametrize("case", ["contrastive_hard_negatives", "sigmoid"])
def test_blockwise_matches_dense_in_float64(case):
    """In float64 rounding vanishes: the blockwise math is the dense math."""
    loss, _, k, scalars = CASES[case]
    with jax.enable_x64(True):
        x, y = (v.astype(jnp.float64) for v in _data(11, 11 * k))
        scalars = tuple(np.float64(s) for s in scalars)
        got = _value_and_grads(loss, x, y, scalars, block_size=4)
        want = _value_and_grads(loss, x, y, scalars)
        assert got[0].dtype == jnp.float64
        chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["contrastive_hard_negatives", "sigmoid"])
def test_blockwise_per_row_vjp_matches_dense(case):
    """reduction="none" with an arbitrary cotangent per row."""
    loss, _, k, scalars = CASES[case]
    x, y = _data(10, 10 * k)
    weights = jnp.linspace(-1.0, 2.0, 10)

    def weighted(*args, **kw):
        return jnp.sum(weights * loss(*args, reduction="none", **kw))

    got = _value_and_grads(weighted, x, y, scalars, block_size=4)
    want = _value_and_grads(weighted, x, y, scalars)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_blockwise_is_stable_for_large_logits():
    """Logits in the hundreds: the online LSE neither overflows nor loses the answer."""
    x, y = _data(9, 9)
    loss = CASES["contrastive"][0]
    got = _value_and_grads(loss, x, y, (0.01,), block_size=4)
    with jax.enable_x64(True):
        x64, y64 = x.astype(jnp.float64), y.astype(jnp.float64)
        want = _value_and_grads(ref_contrastive, x64, y64, (np.float64(0.01),))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))
    chex.assert_trees_all_close(got, jax.tree.map(np.float32, want), rtol=1e-3, atol=1e-3)


# Narrow inputs (bfloat16, float16): accumulated in float32, gradients in their dtype.

NARROW = {  # every loss at temperature 0.05; the scalars as users pass them (Python floats)
    "contrastive": (CASES["contrastive"][0], (0.05,)),
    "clip": (clip_loss, (float(np.log(20.0)),)),
    "sigmoid": (sigmoid_loss, (float(np.log(20.0)), -10.0)),
}


def _unit_pairs(n: int, dim: int):
    """Unit rows ``x`` and noisy unit partners ``y``: losses far from 0 at temperature 0.05."""
    x, noise = _data(n, n, dim)
    unit = lambda v: v / jnp.linalg.norm(v, axis=1, keepdims=True)
    return unit(x), unit(x + 1.5 * noise)


def _narrow_vs_float32(x, y):
    """Per loss: value and gradients of the narrow rows, dense and blockwise (padded
    blocks of 100 rows), and of the same values upcast to float32."""

    def value_and_grads(loss, scalars, x, y, **kw):
        argnums = tuple(range(2 + len(scalars)))
        return jax.value_and_grad(functools.partial(loss, **kw), argnums)(x, y, *scalars)

    out = {}
    for name, (loss, scalars) in NARROW.items():
        run = functools.partial(value_and_grads, loss, scalars)
        out[name] = {
            "dense": run(x, y),
            "blockwise": run(x, y, block_size=100),
            "f32": run(x.astype(jnp.float32), y.astype(jnp.float32)),
        }
    return out


def _assert_close_in_norm(got, want, rtol: float):
    """Every leaf within ``rtol`` of ``want``'s, relative to the norm of ``want``'s."""
    leaves = zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want), strict=True)
    for (path, g), w in leaves:
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.1e}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_narrow_inputs_match_float32(dtype):
    """256 rows at temperature 0.05: within 1e-2 of float32 on the same (rounded) values.

    Computed in the inputs' dtype, bfloat16 losses would be off by several percent.
    """
    x, y = (v.astype(dtype) for v in _unit_pairs(256, 64))
    got = jax.jit(_narrow_vs_float32)(x, y)
    for name, results in got.items():
        wide = results.pop("f32")
        for value, (dx, dy, *ds) in results.values():
            assert value.dtype == jnp.float32
            assert (dx.dtype, dy.dtype) == (dtype, dtype)
            assert all(d.dtype == jnp.float32 for d in ds), name
        chex.assert_trees_all_close(results["dense"][0], wide[0], rtol=1e-2)
        _assert_close_in_norm(results, {k: wide for k in results}, rtol=1e-2)


# Validation.


@pytest.mark.parametrize(
    ("x_shape", "y_shape", "match"),
    [
        ((4, 3), (4, 5), "same embedding dim"),
        ((4, 3), (6, 3), "multiple of len"),
        ((4,), (4, 3), "2-D"),
    ],
)
def test_contrastive_rejects_bad_shapes(x_shape, y_shape, match):
    with pytest.raises(ValueError, match=match):
        contrastive_loss(jnp.ones(x_shape), jnp.ones(y_shape))


def test_clip_and_sigmoid_reject_unpaired_rows():
    x, y = jnp.ones((4, 3)), jnp.ones((8, 3))
    with pytest.raises(ValueError, match="same number of rows"):
        clip_loss(x, y, 0.0)
    with pytest.raises(ValueError, match="same number of rows"):
        sigmoid_loss(x, y, 0.0, 0.0)


@pytest.mark.parametrize("case", list(CASES))
def test_rejects_bad_reduction(case):
    loss, _, _, scalars = CASES[case]
    with pytest.raises(ValueError, match=r"reduction must be one of .*got 'avg'"):
        loss(jnp.ones((2, 3)), jnp.ones((2, 3)), *scalars, reduction="avg")


@pytest.mark.parametrize(
    ("block_size", "error", "match"),
    [
        (0, ValueError, "block_size must be a positive int, got 0"),
        (-4, ValueError, "block_size must be a positive int, got -4"),
        (2.0, TypeError, r"block_size must be a positive int, got 2.0 \(float\)"),
        (True, TypeError, r"block_size must be a positive int, got True \(bool\)"),
        ("8", TypeError, r"block_size must be a positive int, got '8' \(str\)"),
    ],
)
@pytest.mark.parametrize("case", list(CASES))
def test_rejects_bad_block_size(case, block_size, error, match):
    loss, _, _, scalars = CASES[case]
    with pytest.raises(error, match=match):
        loss(jnp.ones((2, 3)), jnp.ones((2, 3)), *scalars, block_size=block_size)


# Memory: lowered and compiled from shapes only, never run.

BIG, DIM = 65_536, 128
MiB = 2**20
MEMORY = {  # loss, number of scalar arguments
    "contrastive": (contrastive_loss, 0),
    "clip": (clip_loss, 1),
    "sigmoid": (sigmoid_loss, 2),
}


@functools.cache
def _temp_bytes(case: str, dtype=jnp.float32, block_size: int | None = 1024) -> int:
    """Temporary memory of the loss's value and gradient at 65,536 rows."""
    loss, num_scalars = MEMORY[case]
    emb = jax.ShapeDtypeStruct((BIG, DIM), dtype)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    grad = jax.value_and_grad(
        functools.partial(loss, block_size=block_size), argnums=tuple(range(2 + num_scalars))
    )
    compiled = jax.jit(grad).lower(emb, emb, *[scalar] * num_scalars).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("case", list(MEMORY))
def test_blockwise_memory_at_65536_rows(case):
    blockwise, dense = _temp_bytes(case), _temp_bytes(case, block_size=None)
    assert blockwise <= 256 * MiB, f"blockwise temp memory {blockwise / MiB:.0f} MiB"
    assert dense >= BIG * BIG * 4, f"dense temp memory {dense / MiB:.0f} MiB"  # the logits


@pytest.mark.parametrize("case", list(MEMORY))
def test_blockwise_bfloat16_memory_holds_no_float32_copy(case):
    """No float32 copy of a [rows, dim] input: less than one would take, and no more than
    with float32 inputs. CLIP sums two directions' gradients for each side, and their
    bfloat16 parts (one side's worth of float32 bytes) may be live together."""
    narrow, wide = _temp_bytes(case, jnp.bfloat16), _temp_bytes(case)
    one_side_in_float32 = BIG * DIM * 4
    bound = one_side_in_float32 * (2 if case == "clip" else 1)
    assert narrow < bound, f"bfloat16 temp memory {narrow / MiB:.1f} MiB"
    assert narrow <= wide, f"bfloat16 {narrow / MiB:.1f} MiB, float32 {wide / MiB:.1f} MiB"
