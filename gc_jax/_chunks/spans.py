"""The bucket planner: each bucket's span of the sorted rows, the plan of fewest tokens.

Rows are sorted by bucket (the shortest bucket that holds them). Every chunk of
bucket ``b`` holds ``rows[b]`` rows of ``lengths[b]`` tokens, whether its rows are
real or padding, so a plan costs the tokens of the chunks it runs. Bucket ``b``
takes the rows left over from the buckets before it and its own, and either

* *rounds down*: encodes only as many full chunks as those rows fill, the rest
  (fewer than a chunk) moving up to bucket ``b + 1``, whose chunks are longer; or
* *rounds up*: encodes them all, its last chunk filled up with padding rows.

The longest bucket always rounds up. Which is cheaper depends on the buckets after
``b``; :func:`spans` picks, for each shard's traced lengths, the choice at every
bucket that encodes the fewest tokens (a dynamic program over the last bucket that
rounded up: ``O(buckets)`` vector operations). The same code runs on NumPy arrays,
for :func:`propose_buckets`; under JAX its loops over the buckets are rolled
(``fori_loop``), so the compiled plan does not grow with them (unrolled, its compile
time grew with the buckets: docs/benchmarks/token_budgets.md, "Token budgets and
packing on long-tailed lengths"). :func:`propose_buckets` scores the plan of each set
of buckets it tries by its tokens, or by its modelled FLOPs, attention included
(:func:`chunk_costs`); the plan itself always encodes the fewest tokens for the
buckets it is given.

This module is the ``TokenBudget``'s planner (:mod:`gc_jax._chunks.budget`: its plan
under ``jit``, its ``chunk_counts`` and ``for_lengths`` with NumPy); it knows rows,
buckets and lengths, not the budget nor the batch.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def bucket_of(length: Any, bucket_lengths: tuple[int, ...], xp: Any) -> Any:
    """Each row's bucket: the first that holds its tokens (the longest for any longer).

    A row without tokens goes to the longest bucket, encoded whole as the full batch
    encodes it: its tokens attend to no key, so e.g. its first token's output is a
    mean over all its padding positions, which a shorter bucket would change."""
    shorter = xp.sum(length[..., None] > xp.asarray(bucket_lengths), axis=-1)
    last = len(bucket_lengths) - 1
    return xp.where(length > 0, xp.minimum(shorter, last), last)


def _ceil_div(a: Any, b: int) -> Any:
    return -(-a // b)


def spans(bucket: Any, rows: tuple[int, ...], lengths: tuple[int, ...], xp: Any):
    """Each bucket's span of every shard's rows sorted by bucket, the cheapest plan.

    Args:
      bucket: ``int[S, n]``, each row's bucket, per shard.
      rows: rows of each bucket's chunks.
      lengths: tokens of each bucket's chunks.
      xp: ``jax.numpy`` (traced) or ``numpy``.

    Returns:
      ``(starts, ends, chunks)``, each ``int[S, buckets]``: bucket ``b`` encodes the
      sorted rows ``starts[:, b]:ends[:, b]`` in ``chunks[:, b]`` chunks.
    """
    k_all = len(rows)
    fits = xp.sum(bucket[..., None] <= xp.arange(k_all), axis=1)  # [S, K]: rows <= bucket b
    size = xp.asarray(rows)
    cost_of = xp.asarray([float(r * n) for r, n in zip(rows, lengths, strict=True)])
    ids, cols = xp.arange(k_all), xp.arange(k_all + 1)
    column_of = lambda a, j: xp.sum(xp.where(ids == j, a, 0), axis=1)  # no gather: any sharding
    zeros = xp.concatenate([fits, fits[:, :1]], axis=1) * 0  # [S, K + 1], typed like the shards

    # Column j of (start, cost, best): the plan whose last bucket to round up was j - 1
    # (j = 0: none yet), continued by rounding down. start: its first row not yet
    # encoded; cost: tokens of its chunks so far; best[j]: the cheapest plan up to that
    # round-up. Columns past b + 1 are not used yet.
    def choose(b, state):
        start, cost, best, previous = state
        fit = column_of(fits, b)[:, None]
        n, tokens = size[b], cost_of[b]
        active, new = cols <= b, cols == b + 1
        left = fit - start
        up = xp.where(active, best + cost + _ceil_div(left, n) * tokens, xp.inf)
        previous = xp.where(ids == b, xp.argmin(up, axis=1)[:, None], previous)
        best = xp.where(new, xp.min(up, axis=1, keepdims=True), best)
        down = left // n
        cost = xp.where(active, cost + down * tokens, xp.where(new, 0.0, cost))
        start = xp.where(active, start + down * n, xp.where(new, fit, start))
        return start, cost, best, previous

    state = (zeros, zeros * 0.0, zeros * 0.0, fits * 0)
    previous = _loop(k_all, choose, state, xp)[3]
    up = _round_ups(previous, xp)

    def place(b, state):
        start, starts, ends, chunks = state
        left = column_of(fits, b) - start
        taken = xp.where(column_of(up, b) > 0, left, left // size[b] * size[b])
        at = ids == b
        starts = xp.where(at, start[:, None], starts)
        ends = xp.where(at, (start + taken)[:, None], ends)
        chunks = xp.where(at, _ceil_div(taken, size[b])[:, None], chunks)
        return start + taken, starts, ends, chunks

    return _loop(k_all, place, (fits[:, 0] * 0, fits * 0, fits * 0, fits * 0), xp)[1:]


def _loop(n: int, body: Any, state: Any, xp: Any) -> Any:
    """``state = body(b, state)`` for ``b < n``: a Python loop on NumPy, and one rolled
    loop under JAX, so that the compiled plan does not grow with the buckets."""
    if xp is np:
        for b in range(n):
            state = body(b, state)
        return state
    return jax.lax.fori_loop(0, n, body, state)


def _round_ups(previous: Any, xp: Any) -> Any:
    """``int[S, K]``, 1 at the buckets that round up, read back from the last one."""
    k_all = previous.shape[1]
    ids = xp.arange(k_all)
    up = (previous * 0 + ids == k_all - 1) * 1  # [S, K], typed like the shards

    def back(_, state):
        up, column = state
        b = column - 1  # the bucket that rounded up before (-1: none)
        up = xp.maximum(up, (ids[None, :] == b[:, None]) * 1)
        before = xp.sum(xp.where(ids == xp.maximum(b, 0)[:, None], previous, 0), axis=1)
        return up, xp.where(b >= 0, before, 0)

    return _loop(k_all - 1, back, (up, previous[:, -1]), xp)[0]


def chunk_costs(rows: tuple[int, ...], lengths: tuple[int, ...],
                attention_width: float | None = None) -> np.ndarray:  # fmt: skip
    """The modelled cost of one chunk of each bucket, ``float[buckets]``.

    Without ``attention_width``: its tokens, ``r * n`` for ``r`` rows of ``n`` tokens.
    With it (``d``): its encoder FLOPs in units of ``24 d^2`` a token, ``r * n * (1 +
    n / (6 d))``. Per layer and token a transformer's forward takes about ``24 d^2``
    FLOPs in its dense matmuls (Q, K, V and output projections ``8 d^2``, a feed-forward
    of width ``4 d`` ``16 d^2``) and ``4 d n`` in its attention (the scores ``2 d n``,
    the weighted values ``2 d n``); the backward pass and the layers scale both alike.
    """
    r, n = np.asarray(rows, np.float64), np.asarray(lengths, np.float64)
    return r * n if attention_width is None else r * n * (1 + n / (6 * attention_width))


def encoded_cost(lengths: np.ndarray, tokens: int, buckets: tuple[int, ...],
                 attention_width: float | None = None) -> np.ndarray:  # fmt: skip
    """The modelled cost (:func:`chunk_costs`) of the chunks the step plans for each
    batch of ``lengths`` (``[batches, rows]``): tokens without ``attention_width``."""
    rows = tuple(min(tokens // n, lengths.shape[1]) for n in buckets)
    _, _, chunks = spans(bucket_of(lengths, buckets, np), rows, buckets, np)
    return chunks @ chunk_costs(rows, buckets, attention_width)


def budget_cost(lengths: np.ndarray, tokens: int, attention_width: float | None = None):
    """``cost(buckets)``: the mean modelled cost (:func:`encoded_cost`) of a budget's
    plan over the batches of ``lengths``, as :func:`propose_buckets` scores it."""
    return lambda buckets: float(encoded_cost(lengths, tokens, buckets, attention_width).mean())


def propose_buckets(lengths: np.ndarray, padded_length: int, max_buckets: int, multiple: int,
                    min_saving: float, cost, starts: tuple = ()) -> tuple[int, ...]:  # fmt: skip
    """Buckets (multiples of ``multiple``, and ``padded_length``) of least ``cost`` (a
    function of the buckets, e.g. :func:`budget_cost`) over the batches of ``lengths``.

    Buckets are added one at a time (the one that saves most) while one saves at
    least ``min_saving`` of the cost; then, from that set, from as many buckets at
    equally spaced quantiles of the lengths, from as many halvings of ``padded_length``
    (``L / 2``, ``L / 4``, ...) and from ``starts`` (e.g. the buckets fitted to the
    tokens), each bucket is moved in turn to its best place while that helps, and the
    cheapest result is kept.
    """
    candidates = list(range(multiple, padded_length, multiple))
    chosen, current = (padded_length,), cost((padded_length,))
    while len(chosen) < max_buckets:
        scored = [(cost(t), t) for t in _with_each(chosen, candidates)]
        if not scored or min(scored)[0] > current * (1 - min_saving):
            break
        current, chosen = min(scored)
    count = len(chosen) - 1
    quantiles = np.quantile(lengths, np.arange(1, count + 1) / (count + 1))
    halves = [padded_length >> (count - i) for i in range(count)]  # L/2^count, ..., L/2
    starts = [chosen, *starts]
    for guess in (quantiles, halves):
        near = {min(max(multiple, -(-int(n) // multiple) * multiple), padded_length) for n in guess}
        starts.append((*sorted(near - {padded_length}), padded_length))
    return min(_refined(start, candidates, cost) for start in starts)[1]


def fit_chunk_tokens(tokens: int, min_tokens: int | None, padded_length: int,
                     min_saving: float, fit) -> Any:  # fmt: skip
    """The fit of the chunk size whose plan is cheapest: ``fit(t) -> (cost, config)`` at
    ``tokens`` and at its halvings ``tokens // 2``, ``tokens // 4``, ... down to
    ``min_tokens`` (none where it is None) and at least ``padded_length`` (one row or
    line), a smaller size kept only where it costs ``min_saving`` less than the best so
    far. Smaller chunks leave less of each bucket's last chunk empty, which pays where
    a bucket fills about one chunk (small batches per device).

    Examples:
      >>> fit = lambda t: (1000 + t / 4, t)  # a partial chunk's waste grows with t
      >>> fit_chunk_tokens(4096, 1024, 512, 0.01, fit)
      1024
      >>> fit_chunk_tokens(4096, None, 512, 0.01, fit)  # no smaller chunk allowed
      4096
    """
    best_cost, best = fit(tokens)
    size = tokens // 2
    while min_tokens is not None and size >= max(min_tokens, padded_length):
        cost, found = fit(size)
        if cost < best_cost * (1 - min_saving):
            best_cost, best = cost, found
        size //= 2
    return best


def _with_each(buckets: tuple[int, ...], candidates: list[int]) -> list[tuple[int, ...]]:
    return [tuple(sorted({*buckets, n})) for n in candidates if n not in buckets]


def _refined(buckets: tuple[int, ...], candidates: list[int], cost) -> tuple[float, tuple]:
    """``(cost, buckets)`` after moving each bucket but the last to its best place, in
    turn, while that lowers the cost."""
    current = cost(buckets)
    for _ in range(4):
        moved = False
        for i in range(len(buckets) - 1):
            trials = _with_each(buckets[:i] + buckets[i + 1 :], candidates)
            best_cost, best = min((cost(t), t) for t in trials)
            if best_cost < current:
                current, buckets, moved = best_cost, best, True
        if not moved:
            break
    return current, buckets
