"""Held-out retrieval metrics: every query against every held-out document."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

Batch = Mapping[str, np.ndarray]


def embed(
    embed_batch: Callable[[Any, dict[str, jax.Array]], jax.Array],
    params: Any,
    inputs: Batch,
    batch_size: int,
    progress: str | None = None,
) -> np.ndarray:
    """Embeds every row of ``inputs`` in batches of a fixed size (the last one padded).

    ``embed_batch(params, batch)`` should be jitted; a fixed batch shape compiles it once.
    Padding rows are all-zero (attention mask 0) and are dropped from the result.
    ``progress``: if given, a progress bar with this description.
    """
    rows = len(next(iter(inputs.values())))
    outputs = []
    starts = range(0, rows, batch_size)
    if progress is not None:
        starts = tqdm(starts, desc=progress, unit="batch", file=sys.stdout)
    for start in starts:
        batch = {k: v[start : start + batch_size] for k, v in inputs.items()}
        real = len(next(iter(batch.values())))
        if real < batch_size:
            batch = {
                k: np.pad(v, [(0, batch_size - real)] + [(0, 0)] * (v.ndim - 1))
                for k, v in batch.items()
            }
        outputs.append(np.asarray(embed_batch(params, batch))[:real])
    return np.concatenate(outputs)


def ranks_of_positives(queries: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """1-based rank of document ``i`` for query ``i`` among all documents (by dot product).

    Ties are ranked pessimistically (a document scoring equal to the positive ranks
    above it), so a constant encoder gets the worst rank, not the best.
    """
    scores = queries.astype(np.float64) @ documents.astype(np.float64).T
    positive = np.diag(scores)[:, None]
    others = scores >= positive
    np.fill_diagonal(others, False)
    return 1 + others.sum(axis=1)


def retrieval_metrics(queries: np.ndarray, documents: np.ndarray) -> dict[str, float]:
    """Recall@1, Recall@10 and mean reciprocal rank of the paired documents."""
    ranks = ranks_of_positives(queries, documents)
    return {
        "recall@1": float(np.mean(ranks <= 1)),
        "recall@10": float(np.mean(ranks <= 10)),
        "mrr": float(np.mean(1.0 / ranks)),
    }


def in_batch_loss(
    queries: np.ndarray,
    documents: np.ndarray,
    temperature: float,
    batch_size: int,
    seed: int = 0,
) -> float:
    """The training loss on held-out pairs: InfoNCE of each query against its batch's documents.

    The rows are shuffled once (``seed``: the same batches at every evaluation) and cut
    into batches of ``batch_size`` (the last incomplete one dropped; one batch of every
    row if there are fewer), so that, like a training batch, a batch mixes functions
    of many files (consecutive held-out rows come from the same file: much harder
    negatives) and holds as many negatives as a training step.
    """
    batch_size = min(batch_size, len(queries))
    order = np.random.default_rng(seed).permutation(len(queries))
    losses = []
    for start in range(0, len(queries) - batch_size + 1, batch_size):
        rows = order[start : start + batch_size]
        q, d = queries[rows].astype(np.float64), documents[rows].astype(np.float64)
        logits = q @ d.T / temperature
        top = logits.max(axis=1, keepdims=True)
        log_norm = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        losses.append(np.mean(log_norm - np.diag(logits)))
    return float(np.mean(losses))
