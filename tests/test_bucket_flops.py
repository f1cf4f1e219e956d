"""``TokenBudget.for_lengths(attention_width=...)``: buckets fitted to the modelled FLOPs.

The model is counted here from the transformer's matmuls (per layer and token ``24 d^2``
dense FLOPs and ``4 d n`` of attention over ``n`` tokens), over the chunks the step's own
plan encodes, and every set of buckets is tried.
"""

from __future__ import annotations

import itertools

import chex
import jax
import numpy as np
import pytest
from test_token_chunks import PADDED, TOL, full_batch, loss_fn, make_params, text_batch, towers

import gc_jax


def sample_of(seed):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(14), 0.8, (4, 32)), 1, 64).astype(int)


def transformer_flops(buckets, sample, width, tokens=256):
    """A transformer layer's forward FLOPs over the chunks the step plans for ``sample``."""
    budget = gc_jax.TokenBudget(tokens, buckets)
    counts = [budget.chunk_counts(x, 64) for x in sample]
    per_token = lambda n: 24 * width**2 + 4 * width * n
    return sum(c * r * n * per_token(n) for b in counts for (r, n), c in b.items())


def fit(sample, width=None, **kwargs):
    return gc_jax.TokenBudget.for_lengths(sample, 256, 64, max_buckets=3, multiple=8,
                                          min_saving=0.0, attention_width=width,
                                          **kwargs).buckets  # fmt: skip


@pytest.mark.parametrize(("seed", "width"), [(0, 1), (0, 3.5), (0, 16), (2, 2)])
def test_fitted_buckets_cost_least_flops(seed, width):
    """Against every set of at most 3 buckets (multiples of 8, and 64): none costs fewer
    modelled FLOPs than the fitted one."""
    sample = sample_of(seed)
    buckets = fit(sample, width)
    subsets = [(*c, 64) for k in range(3) for c in itertools.combinations(range(8, 64, 8), k)]
    best = min(transformer_flops(s, sample, width) for s in subsets)
    assert buckets in subsets
    assert transformer_flops(buckets, sample, width) == pytest.approx(best, rel=1e-12)


def test_attention_moves_the_buckets():
    """Where attention is a large share of the FLOPs, the buckets that encode the fewest
    tokens are not the cheapest: the fitted ones cost fewer FLOPs (and more tokens)."""
    sample = sample_of(0)
    by_tokens, by_flops = fit(sample), fit(sample, 2)
    assert by_tokens != by_flops
    flops = lambda b: transformer_flops(b, sample, 2)
    assert flops(by_flops) < flops(by_tokens)
    counts = lambda b: [gc_jax.TokenBudget(256, b).chunk_counts(x, 64) for x in sample]
    tokens = lambda b: sum(c * r * n for x in counts(b) for (r, n), c in x.items())
    assert tokens(by_tokens) < tokens(by_flops)


def test_default_fits_the_tokens():
    """``attention_width=None`` is the default: the buckets of fewest tokens, as before."""
    sample = sample_of(0)
    default = gc_jax.TokenBudget.for_lengths(sample, 256, 64, max_buckets=3, multiple=8,
                                             min_saving=0.0)  # fmt: skip
    assert default.buckets == fit(sample, None) == (16, 32, 64)


def test_min_tokens_fits_the_chunk_size_too():
    """At 16 rows a batch each bucket fills about one chunk of 256 tokens: with
    ``min_tokens`` the fit tries 256, 128 and 64, fits buckets to each, and keeps the
    size whose buckets cost the fewest modelled FLOPs over the chunks the step plans
    (counted here from the transformer's matmuls); without it, chunks of ``tokens``."""
    sample = np.clip(np.random.default_rng(0).lognormal(np.log(14), 0.8, (4, 16)), 1, 64)
    sample = sample.astype(int)
    kwargs = {"max_buckets": 3, "multiple": 8, "min_saving": 0.0, "attention_width": 2}
    own = {t: gc_jax.TokenBudget.for_lengths(sample, t, 64, **kwargs) for t in (256, 128, 64)}
    flops = {t: transformer_flops(b.buckets, sample, 2, tokens=t) for t, b in own.items()}
    chosen = gc_jax.TokenBudget.for_lengths(sample, 256, 64, min_tokens=64, **kwargs)
    assert chosen == own[min(flops, key=flops.get)]
    assert flops[chosen.tokens] < 0.9 * flops[256]
    assert gc_jax.TokenBudget.for_lengths(sample, 256, 64, min_tokens=None, **kwargs) == own[256]
    assert gc_jax.TokenBudget.for_lengths(sample, 256, 64, min_tokens=256, **kwargs) == own[256]


def test_flops_budget_matches_full_batch():
    """A budget fitted with ``attention_width`` (and one with ``min_tokens``: smaller
    chunks) is an ordinary budget: the step under ``jit`` is exact against the full
    padded batch."""
    q, d = text_batch(16, "lognormal", 51), text_batch(64, "bimodal", 52)
    lengths = lambda x: np.asarray(x["attention_mask"]).sum(1)
    kwargs = {"max_buckets": 3, "multiple": 2, "min_saving": 0.0, "attention_width": 2}
    budgets = tuple(
        gc_jax.TokenBudget.for_lengths(lengths(x), 48, PADDED, min_tokens=m, **kwargs)
        for x, m in ((q, 16), (d, None))
    )
    assert all(len(b.buckets) > 1 for b in budgets)
    assert budgets[0].tokens < 48 and budgets[1].tokens == 48
    params, encoders = make_params(), towers(False)
    cached = jax.jit(gc_jax.cached_value_and_grad(loss_fn, encoders, budgets))
    chex.assert_trees_all_close(cached(params, q, d), full_batch(loss_fn, encoders, params, q, d),
                                **TOL)  # fmt: skip


@pytest.mark.parametrize(
    ("width", "error", "match"),
    [
        (0, ValueError, "positive finite width.*got 0"),
        (-64, ValueError, "positive finite width.*got -64"),
        (float("nan"), ValueError, "positive finite width.*got nan"),
        (float("inf"), ValueError, "positive finite width.*got inf"),
        ("768", TypeError, "encoder's width.*got '768' of type str"),
        (True, TypeError, "encoder's width.*got True of type bool"),
        ([64], TypeError, r"encoder's width.*got \[64\] of type list"),
    ],
)
def test_attention_width_errors(width, error, match):
    with pytest.raises(error, match=r"for_lengths\(attention_width=\.\.\.\) must be.*" + match):
        gc_jax.TokenBudget.for_lengths([3, 9, 40], 256, 64, attention_width=width)
