"""The reference for ``contrastive_loss``'s options: the definitions, written out naively.

sentence-transformers 6.2's ``MultipleNegativesRankingLoss`` (``directions``,
``partition_mode``) and ``GISTEmbedLoss`` (``margin_strategy``, ``margin``), and the
false-negative ids as ``gc_jax.losses.contrastive_loss`` documents them: full logit
matrices, one per direction, and masks decided pair by pair in Python loops (no code
shared with the library). ``y`` holds ``k`` documents per query, its positive first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def _equal(ids, a, b) -> bool:
    return ids is not None and bool(np.all(ids[a] == ids[b]))


def keep_masks(n, k, directions, query_ids, doc_ids, guide, margin_strategy, margin):
    """Per direction, the pairs kept: ``[n, columns]`` booleans."""
    qid = None if query_ids is None else np.asarray(query_ids).reshape(n, -1)
    did = None if doc_ids is None else np.asarray(doc_ids).reshape(n * k, -1)

    def same_example(i, e):  # queries i and e: a duplicate query or the same positive
        return _equal(qid, i, e) or (did is not None and _equal(did, i * k, e * k))

    def false_doc(i, j):  # document j: the positive of i again, or a duplicate's positive
        return _equal(did, j, i * k) or (j % k == 0 and _equal(qid, j // k, i))

    if guide is not None:
        gx, gy = (np.asarray(g, np.float64) for g in guide)
        gp = gy[::k]
        t = np.sum(gx * gp, axis=1)
        bar = t - margin if margin_strategy == "absolute" else t - np.abs(t) * margin
        scores = {"query_to_doc": gx @ gy.T, "query_to_query": gx @ gx.T,
                  "doc_to_query": gp @ gx.T, "doc_to_doc": gp @ gy.T}  # fmt: skip
    keep = {}
    for d in directions:
        cols = n * k if d.endswith("_doc") else n
        kept = np.ones((n, cols), bool)
        for i in range(n):
            for j in range(cols):
                if (d == "query_to_query" and j == i) or (d == "doc_to_doc" and j // k == i):
                    kept[i, j] = False  # not in the direction at all
                    continue
                positive = (d == "query_to_doc" and j == i * k) or (d == "doc_to_query" and j == i)
                if d in ("query_to_doc", "doc_to_doc"):
                    drop = false_doc(i, j)
                else:
                    drop = same_example(i, j)
                if guide is not None:
                    drop = drop or scores[d][i, j] > bar[i]
                kept[i, j] = positive or not drop
        keep[d] = kept
    return keep


def contrastive(
    x,
    y,
    temperature,
    directions=("query_to_doc",),
    partition_mode="joint",
    query_ids=None,
    doc_ids=None,
    guide=None,
    margin_strategy="absolute",
    margin=0.0,
    reduction="mean",
    hardness_mode=None,
    hardness_strength=0.0,
):
    """The loss, differentiable in ``x``, ``y`` and ``temperature``.

    ``hardness_mode``: sentence-transformers' penalty, ``alpha * stop_gradient(x_i . y_j)``
    added to the chosen negatives' ``query_to_doc`` logits after the temperature.
    """
    n, k = x.shape[0], y.shape[0] // x.shape[0]
    keep = keep_masks(n, k, directions, query_ids, doc_ids, guide, margin_strategy, margin)
    p = y[::k]
    scores = {"query_to_doc": x @ y.T, "query_to_query": x @ x.T,
              "doc_to_query": p @ x.T, "doc_to_doc": p @ y.T}  # fmt: skip
    logits = {d: scores[d] / temperature for d in directions}
    if hardness_mode is not None:
        chosen = np.zeros((n, n * k), bool)
        for i in range(n):
            for j in range(n * k):
                own, positive = j // k == i, j == i * k
                chosen[i, j] = {"hard_negatives": own and not positive,
                                "in_batch_negatives": not own,
                                "all_negatives": not positive}[hardness_mode]  # fmt: skip
        penalty = hardness_strength * jax.lax.stop_gradient(scores["query_to_doc"])
        logits["query_to_doc"] = logits["query_to_doc"] + jnp.where(chosen, penalty, 0)
    logits = {d: jnp.where(keep[d], logits[d], -jnp.inf) for d in directions}
    positive = jnp.sum(x * p, axis=1) / temperature
    if partition_mode == "joint":
        log_z = jax.nn.logsumexp(jnp.concatenate([logits[d] for d in directions], 1), axis=1)
    else:
        log_z = sum(jax.nn.logsumexp(logits[d], axis=1) for d in directions) / len(directions)
    per_query = log_z - positive
    return {"mean": jnp.mean, "sum": jnp.sum, "none": lambda v: v}[reduction](per_query)


def dropped(n, k, **options) -> tuple[int, int]:
    """How many pairs the options' ids and guide drop, of how many in the directions."""
    directions = options.get("directions", ("query_to_doc",))
    masks = keep_masks(
        n, k, directions, options.get("query_ids"), options.get("doc_ids"),
        options.get("guide"), options.get("margin_strategy", "absolute"),
        options.get("margin", 0.0),
    )  # fmt: skip
    plain = keep_masks(n, k, directions, None, None, None, "absolute", 0.0)
    total = sum(np.sum(plain[d]) for d in directions)
    return int(sum(np.sum(plain[d] & ~masks[d]) for d in directions)), int(total)
