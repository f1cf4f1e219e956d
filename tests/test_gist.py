"""gist_loss: sentence-transformers 6.2's GISTEmbedLoss, block for block.

The reference below is its definition written out naively (no code shared with the
library): per query one softmax over the anchor-positive and anchor-negative scores,
the anchor-anchor scores and the positive-positive scores (positives only), each pair
the guide scores above the query's threshold set to ``-inf`` except the positive pair,
self pairs left to that threshold. Values and gradients in float32 against it, dense,
blockwise, and across 8 devices (gather and ring).
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
from test_losses import BLOCK_TOL, TOL
from test_losses_options import data

from gc_jax.losses import contrastive_loss, gist_loss


def reference(x, y, temp, guide, *, k, margin_strategy="absolute", margin=0.0,
              contrast_anchors=True, contrast_positives=True):  # fmt: skip
    """GISTEmbedLoss' loss: a concatenation of score blocks, masked entry by entry."""
    n = x.shape[0]
    gx, gy = (np.asarray(g, np.float64) for g in guide)
    gp = gy[::k]
    t = np.sum(gx * gp, axis=1)
    bar = t - margin if margin_strategy == "absolute" else t - np.abs(t) * margin
    p = y[::k]
    blocks = [(x @ y.T, gx @ gy.T, True)]
    if contrast_anchors:
        blocks.append((x @ x.T, gx @ gx.T, False))
    if contrast_positives:
        blocks.append((p @ p.T, gp @ gp.T, False))
    logits = []
    for scores, guided, has_positive in blocks:
        drop = np.zeros(guided.shape, bool)
        for i in range(n):
            for j in range(guided.shape[1]):
                positive = has_positive and j == i * k
                drop[i, j] = guided[i, j] > bar[i] and not positive
        logits.append(jnp.where(drop, -jnp.inf, scores / temp))
    logits = jnp.concatenate(logits, axis=1)
    target = logits[jnp.arange(n), jnp.arange(n) * k]
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - target)


CASES = {
    "pairs": (1, {}),
    "pairs, relative 0.3": (1, {"margin_strategy": "relative", "margin": 0.3}),
    "2 hard negatives, absolute 0.1": (3, {"margin": 0.1}),
    "hard negatives, no anchors": (2, {"contrast_anchors": False}),
    "hard negatives, no positives": (2, {"contrast_positives": False, "margin": 0.05}),
}


@functools.cache
def _case(name):
    k, kw = CASES[name]
    x, y, arrays = data(8, k, seed=5)
    guide = arrays["guide"]
    ref = lambda x, y, t: reference(x, y, t, guide, k=k, **kw)
    want = jax.jit(jax.value_and_grad(ref, (0, 1, 2)))(x, y, jnp.float32(0.6))
    return x, y, guide, kw, want


@pytest.mark.parametrize("block_size", [None, 3])
@pytest.mark.parametrize("name", CASES)
def test_matches_sentence_transformers_definition(name, block_size):
    x, y, guide, kw, want = _case(name)
    loss = lambda x, y, t: gist_loss(x, y, guide, temperature=t, block_size=block_size, **kw)
    got = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(x, y, jnp.float32(0.6))
    chex.assert_trees_all_close(got, want, **(TOL if block_size is None else BLOCK_TOL))


def test_self_pairs_are_left_to_the_guide():
    """A guide rating each anchor like its positive keeps the self pairs (ST: 3.30, not 0.49)."""
    x, y, arrays = data(6, 1, seed=2)
    gx = arrays["guide"][0]
    guide = (gx, gx)  # t_i = g(a_i, a_i) = g(p_i, p_i) = 1: not above the threshold
    got = gist_loss(x, y, guide, temperature=0.6)
    chex.assert_trees_all_close(got, reference(x, y, 0.6, guide, k=1), **TOL)
    gte = ("query_to_doc", "query_to_query", "doc_to_doc")
    other = contrastive_loss(x, y, temperature=0.6, directions=gte, guide=guide)
    assert not np.allclose(got, other)  # GTE's directions drop the self pairs: not GIST


@pytest.mark.parametrize(("method", "block_size"), [("gather", None), ("ring", None), ("ring", 2)])
def test_across_8_devices(method, block_size):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    x, y, arrays = data(16, 2, seed=7)
    guide = arrays["guide"]
    kw = {"margin": 0.1}
    want = jax.value_and_grad(lambda x, y: reference(x, y, 0.6, guide, k=2, **kw), (0, 1))(x, y)
    mesh = jax.make_mesh((8,), ("d",))

    def per_device(x, y, gx, gy):
        return gist_loss(x, y, (gx, gy), temperature=0.6, axis_name="d", method=method,
                         block_size=block_size, **kw)  # fmt: skip

    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"),) * 4, out_specs=P())
    rows = NamedSharding(mesh, P("d"))
    args = jax.device_put((x, y, *guide), rows)
    got = jax.jit(jax.value_and_grad(f, (0, 1)))(*args)
    chex.assert_trees_all_close(got, want, **BLOCK_TOL)


def test_without_a_guide_it_says_what_to_use():
    x, y, _ = data(4, 1)
    with pytest.raises(ValueError, match=r"guide=.*contrastive_loss"):
        gist_loss(x, y, None)
