"""gc_jax.pooling: each pooling against a per-row Python loop over the real tokens, on
left- and right-padded rows, and the errors naming what to pass."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gc_jax import pooling

ROWS, TOKENS, WIDTH = 4, 6, 3


def batch():
    hidden = jax.random.normal(jax.random.key(0), (ROWS, TOKENS, WIDTH))
    lengths = [6, 3, 1, 4]
    right = np.array([[t < n for t in range(TOKENS)] for n in lengths], np.int32)
    return hidden, jnp.asarray(right), jnp.asarray(right[:, ::-1])  # right, left padding


def loop_reference(hidden, mask, how):
    rows = []
    for h, m in zip(np.asarray(hidden), np.asarray(mask), strict=True):
        real = h[m.astype(bool)]
        rows.append({"mean": real.mean(0), "first": real[0], "last": real[-1]}[how])
    return np.stack(rows)


@pytest.mark.parametrize("how", ["mean", "first", "last"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_pool_takes_each_rows_real_tokens(how, side):
    hidden, right, left = batch()
    mask = right if side == "right" else left
    got = jax.jit(pooling.pool, static_argnums=2)(hidden, mask, how)
    chex.assert_trees_all_close(got, loop_reference(hidden, mask, how), rtol=1e-6, atol=1e-6)


def test_pool_ignores_what_padding_holds_and_accepts_a_bool_mask():
    hidden, right, _ = batch()
    noisy = jnp.where(right[..., None].astype(bool), hidden, 1e6)
    for how in ("mean", "first", "last"):
        chex.assert_trees_all_close(
            pooling.pool(noisy, right.astype(bool), how), pooling.pool(hidden, right, how)
        )


def test_mean_keeps_a_bfloat16_dtype_and_an_empty_row_gives_zeros():
    hidden, right, _ = batch()
    out = pooling.pool(hidden.astype(jnp.bfloat16), right.at[0].set(0), "mean")
    assert out.dtype == jnp.bfloat16
    assert not out[0].any()


def test_embed_is_pool_head_and_l2_norm():
    hidden, right, _ = batch()
    head = jax.random.normal(jax.random.key(1), (WIDTH, 2))
    got = pooling.embed(hidden, right, how="last", head=head)
    x = loop_reference(hidden, right, "last") @ np.asarray(head)
    chex.assert_trees_all_close(got, x / np.linalg.norm(x, axis=1, keepdims=True), rtol=1e-5)
    raw = pooling.embed(hidden, right, normalize=False)
    chex.assert_trees_all_close(raw, pooling.pool(hidden, right))


def test_errors_name_the_argument():
    hidden, right, _ = batch()
    with pytest.raises(ValueError, match=r"how must be one of .*got 'max'"):
        pooling.pool(hidden, right, "max")
    with pytest.raises(ValueError, match=r"mask \(rows, tokens\).*mask \(4,\)"):
        pooling.pool(hidden, right[:, 0])
    with pytest.raises(ValueError, match=r"hidden must be \(rows, tokens, width\)"):
        pooling.embed(hidden[0], right)
