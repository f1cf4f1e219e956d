"""Do contrastive_loss's options give sentence-transformers 6.2's values and gradients?

On the same float64 embeddings: ``gc_jax.losses.contrastive_loss`` with
``directions=``/``partition_mode=`` against sentence-transformers'
``MultipleNegativesRankingLoss`` (``compute_loss_from_embeddings``, dot-product
similarity, ``scale = 1 / temperature``), and with ``guide=`` against its
``GISTEmbedLoss`` (``CachedGISTEmbedLoss.calculate_loss``, which takes embeddings;
cosine similarity for the model and the guide, so the JAX side normalises its rows
inside the differentiated function). Loss values and the gradients of every input
(anchors, positives, each column of hard negatives) are compared; sentence-transformers
lays a batch out by columns (all positives, then each negative column), gc_jax by
query (its ``k`` documents in a row), which the script converts.

MaxSim (late interaction): ``gc_jax.losses.maxsim_loss`` (dense and blockwise) against
``MultiVectorMultipleNegativesRankingLoss`` (fed by a stand-in model that returns the
given token vectors and masks) and ``CachedMultiVectorMultipleNegativesRankingLoss``
(its ``calculate_loss`` on mini-batches of 5 rows), ``scale = 1 / temperature``, on unit
float64 token vectors with token masks: pairs, hard negatives, a document with no
unmasked token (-1e9 on both sides) and padded query tokens. sentence-transformers casts
each query token's best match to float32 before summing them (its scores are float32
whatever the input), so each loss also runs with that one cast removed from its own
scoring source ("/float64"): the definitions compared in float64.

Sparse encoders and regularisers: ``splade_pool`` (both pooling strategies, both
activations, a token mask) against ``SpladePooling``; ``flops_regularizer`` (with and
without ``threshold``) against ``FlopsLoss``; ``spread_out_regularizer(variant="gor")``
with its weights against ``GlobalOrthogonalRegularizationLoss`` (cosine and dot-product
similarity); ``embedding_distillation`` against ``EmbedDistillLoss`` (``mse``, ``l2``,
``cosine``, and ``cosine`` with an all-zero student row): the value and the gradient of
the rows (the logits for pooling). GOR on 12 rows of 8 (its Gram form) and on 6 (its
sum over the pairs).

Run it where both torch and sentence-transformers 6.2 are installed (NumPy between
the two sides; JAX with float64)::

    python -m benchmarks.peer_sentence_transformers \
        --json benchmarks/results/peer_sentence_transformers.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import jax
import numpy as np

from benchmarks import common

GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
HARD = {"hardness_mode": "hard_negatives", "hardness_strength": 5.0}
IN_BATCH = {"hardness_mode": "in_batch_negatives", "hardness_strength": 9.0}
ALL_GTE = {"directions": GTE, "hardness_mode": "all_negatives", "hardness_strength": 2.0}
IN_BATCH_SYM = {
    **IN_BATCH,
    "directions": ("query_to_doc", "doc_to_query"),
    "partition_mode": "per_direction",
}
# name: (k, gc_jax options, sentence-transformers loss and options)
CASES = {
    "InfoNCE": (1, {}, ("mnrl", {})),
    "InfoNCE, 2 hard negatives": (3, {}, ("mnrl", {})),
    "symmetric (per_direction)": (
        3,
        {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
        (
            "mnrl",
            {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
        ),
    ),
    "GTE, pairs": (1, {"directions": GTE}, ("mnrl", {"directions": GTE})),
    "GTE, 2 hard negatives": (3, {"directions": GTE}, ("mnrl", {"directions": GTE})),
    "query_to_query, doc_to_doc": (
        3,
        {"directions": ("query_to_doc", "query_to_query", "doc_to_doc")},
        ("mnrl", {"directions": ("query_to_doc", "query_to_query", "doc_to_doc")}),
    ),
    # hardness_mode: a bias on chosen negatives' logits (Lan et al. 2025; EmbeddingGemma).
    "hardness, hard negatives 5": (3, HARD, ("mnrl", HARD)),
    "hardness, in-batch 9, pairs": (1, IN_BATCH, ("mnrl", IN_BATCH)),
    "hardness, all negatives 2, GTE": (3, ALL_GTE, ("mnrl", ALL_GTE)),
    "hardness, in-batch 9, per_direction": (3, IN_BATCH_SYM, ("mnrl", IN_BATCH_SYM)),
    # GISTEmbedLoss: gc_jax's gist_loss takes its arguments as they are.
    "GIST, pairs, absolute 0.1": (1, {"margin": 0.1}, ("gist", {"margin": 0.1})),
    "GIST, pairs, relative 0.3": (
        1,
        {"margin_strategy": "relative", "margin": 0.3},
        ("gist", {"margin_strategy": "relative", "margin": 0.3}),
    ),
    "GIST, triplets, anchors only": (
        2,
        {"margin": 0.05, "contrast_positives": False},
        ("gist", {"margin": 0.05, "contrast_positives": False}),
    ),
    "GIST, triplets, anchors and positives": (
        2,
        {"margin": 0.05},
        ("gist", {"margin": 0.05}),
    ),
    "GIST, 3 hard negatives, positives only": (
        4,
        {"margin": 0.1, "contrast_anchors": False},
        ("gist", {"margin": 0.1, "contrast_anchors": False}),
    ),
    "GIST, triplets, relative 0.2": (
        2,
        {"margin_strategy": "relative", "margin": 0.2},
        ("gist", {"margin_strategy": "relative", "margin": 0.2}),
    ),
    # GTE's directions filtered by the guide (contrastive_loss): close to GIST, not equal.
    "GTE directions + guide vs GIST, triplets": (
        2,
        {"directions": ("query_to_doc", "query_to_query", "doc_to_doc"), "margin": 0.05},
        ("gist", {"margin": 0.05}),
    ),
}
DIFFERS = {"GTE directions + guide vs GIST, triplets"}  # self pairs; doc_to_doc's negatives


PARTS = ("losses", "maxsim", "regularizers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=24, help="queries")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument(
        "--block-sizes",
        type=int,
        nargs="*",
        default=[5],
        help="gc_jax's blockwise forms compared too (besides the dense one)",
    )
    p.add_argument(
        "--maxsim-temperature",
        type=float,
        default=0.2,
        help="the MaxSim cases' temperature (sentence-transformers' scale = 1 / temperature)",
    )
    p.add_argument(
        "--parts",
        nargs="*",
        choices=PARTS,
        default=list(PARTS),
        help="which comparisons to run (default: all)",
    )
    p.add_argument("--json", type=str, default=None)
    return p.parse_args(argv)


def batch(n: int, k: int, dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Queries, their k documents (by query), and a guide's rows that agree with positives."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, dim))
    docs = rng.normal(size=(n, k, dim))
    docs[:, 0] = q + 0.8 * rng.normal(size=(n, dim))  # positives near their query
    docs[:, 1:] = q[:, None] + 1.6 * docs[:, 1:]  # hard negatives nearer than the others
    gq = q[:, : dim // 2] + 0.5 * rng.normal(size=(n, dim // 2))
    gdocs = docs[..., : dim // 2] + 0.5 * rng.normal(size=(n, k, dim // 2))
    return {"q": q, "docs": docs, "gq": gq, "gdocs": gdocs}


def st_side(data: dict, case: tuple, temperature: float) -> tuple[float, list[np.ndarray]]:
    """sentence-transformers' loss and gradients: [anchors, positives, negatives...]."""
    import torch  # only here: the script imports without it
    from sentence_transformers import util
    from sentence_transformers.sentence_transformer import losses

    kind, opts = case
    k = data["docs"].shape[1]
    leaf = lambda a: torch.tensor(a, dtype=torch.float64, requires_grad=True)
    reps = [leaf(data["q"])] + [leaf(data["docs"][:, c]) for c in range(k)]
    if kind == "mnrl":
        loss_fn = losses.MultipleNegativesRankingLoss(
            None, scale=1 / temperature, similarity_fct=util.dot_score, **opts
        )
        loss = loss_fn.compute_loss_from_embeddings(reps, None)
    else:
        loss_fn = losses.CachedGISTEmbedLoss.__new__(losses.CachedGISTEmbedLoss)
        torch.nn.Module.__init__(loss_fn)
        loss_fn.temperature, loss_fn.similarity_fct = temperature, torch.nn.CosineSimilarity(-1)
        loss_fn.margin_strategy = opts.get("margin_strategy", "absolute")
        loss_fn.margin = opts["margin"]
        loss_fn.contrast_anchors = opts.get("contrast_anchors", True)
        loss_fn.contrast_positives = opts.get("contrast_positives", True)
        loss_fn.gather_across_devices, loss_fn.show_progress_bar = False, False
        loss_fn.mini_batch_size = len(data["q"])
        loss_fn.cross_entropy_loss = torch.nn.CrossEntropyLoss()
        guided = [torch.tensor(data["gq"])] + [torch.tensor(data["gdocs"][:, c]) for c in range(k)]
        loss = loss_fn.calculate_loss([[r] for r in reps], [[g] for g in guided])
    loss.backward()
    return loss.detach().item(), [r.grad.numpy() for r in reps]


def gc_jax_side(
    data: dict, case: tuple, temperature: float, block_size: int | None
) -> tuple[float, list[np.ndarray]]:
    """gc_jax's loss and gradients, in sentence-transformers' column layout."""
    import jax.numpy as jnp

    from gc_jax.losses import contrastive_loss, gist_loss

    (k, opts, (kind, _)) = case
    n, dim = data["q"].shape
    unit = lambda v: v / jnp.linalg.norm(v, axis=-1, keepdims=True)
    prep = unit if kind == "gist" else (lambda v: v)
    fn = contrastive_loss
    if kind == "gist":
        guide = (unit(jnp.asarray(data["gq"])), unit(jnp.asarray(data["gdocs"]).reshape(n * k, -1)))
        if "directions" in opts:  # GTE's directions with a guide
            opts = {**opts, "guide": guide}
        else:
            fn = lambda q, y, **kw: gist_loss(q, y, guide, **kw)

    def loss(q, y):
        return fn(prep(q), prep(y), temperature=temperature, block_size=block_size, **opts)

    y = jnp.asarray(data["docs"]).reshape(n * k, dim)
    value, (dq, dy) = jax.jit(jax.value_and_grad(loss, (0, 1)))(jnp.asarray(data["q"]), y)
    dy = np.asarray(dy).reshape(n, k, dim)
    return float(value), [np.asarray(dq)] + [dy[:, c] for c in range(k)]


def compare(name: str, args: argparse.Namespace, block_size: int | None) -> dict[str, Any]:
    k, opts, st_case = CASES[name]
    data = batch(args.rows, k, args.dim)
    st_value, st_grads = st_side(data, st_case, args.temperature)
    gc_value, gc_grads = gc_jax_side(data, (k, opts, st_case), args.temperature, block_size)
    grad_err = max(
        float(np.linalg.norm(a - b) / np.linalg.norm(b))
        for a, b in zip(gc_grads, st_grads, strict=True)
    )
    return {"case": name, "k": k, "block_size": block_size, "sentence_transformers": st_value,
            "gc_jax": gc_value, "value_rel_err": abs(gc_value - st_value) / abs(st_value),
            "grad_rel_err": grad_err}  # fmt: skip


# MaxSim (late interaction): sentence-transformers' MultiVectorMultipleNegativesRankingLoss and
# its cached variant against maxsim_loss. name: (k, query lengths?, document lengths?, empty doc)
MAXSIM_CASES = {
    "MaxSim, pairs": (1, False, False, None),
    "MaxSim, 2 hard negatives, padded documents": (3, False, True, None),
    "MaxSim, an empty hard negative": (3, False, True, (5, 2)),
    "MaxSim, padded query tokens": (3, True, True, None),
    "MaxSim, an empty positive": (1, True, True, (5, 0)),
}
QUERY_TOKENS, DOC_TOKENS = 6, 8


def maxsim_batch(n: int, dim: int, case: tuple, seed: int = 1) -> dict[str, np.ndarray]:
    """Unit token vectors [n, T, dim] and [n, k, S, dim] (positives near their query's
    tokens, hard negatives nearer than the others) and 0/1 token masks."""
    k, ragged_q, ragged_d, empty = case
    rng = np.random.default_rng(seed)
    unit = lambda v: v / np.linalg.norm(v, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(n, QUERY_TOKENS, dim)))
    docs = rng.normal(size=(n, k, DOC_TOKENS, dim))
    docs[:, 0, :QUERY_TOKENS] = q + 0.7 * docs[:, 0, :QUERY_TOKENS]
    docs[:, 1:, :QUERY_TOKENS] = q[:, None] + 1.5 * docs[:, 1:, :QUERY_TOKENS]
    lengths = lambda size, low, high: rng.integers(low, high + 1, size=size)[..., None]
    q_mask = np.ones((n, QUERY_TOKENS), bool)
    if ragged_q:  # padding at the end of each query, as a tokenizer's
        q_mask = np.arange(QUERY_TOKENS) < lengths(n, 2, QUERY_TOKENS)
    d_mask = np.ones((n, k, DOC_TOKENS), bool)
    if ragged_d:
        d_mask = np.arange(DOC_TOKENS) < lengths((n, k), 3, DOC_TOKENS)
    if empty is not None:
        d_mask[empty] = False  # a document with no unmasked token
    return {"q": q, "docs": unit(docs), "q_mask": q_mask, "d_mask": d_mask}


class _GivenTokens:
    """A stand-in MultiVectorEncoder: column ``c`` of the features gives those token vectors."""

    def __init__(self, tokens: list, masks: list):
        self.tokens, self.masks = tokens, masks

    def __call__(self, features: dict, task: str | None = None) -> dict:
        c = features["column"]
        return {"token_embeddings": self.tokens[c], "attention_mask": self.masks[c]}


def _float64_scores():
    """sentence-transformers' own MaxSim scoring with its one float32 cast removed
    (``.max(dim=-1).values.float()``, ahead of the sum over query tokens)."""
    import inspect
    import textwrap

    from sentence_transformers.util import similarity

    source = textwrap.dedent(inspect.getsource(similarity._maxsim_score_documents))
    assert source.count(".values.float()") == 1, "sentence-transformers' MaxSim changed"
    namespace = dict(vars(similarity))
    exec(source.replace(".values.float()", ".values"), namespace)
    return namespace["_maxsim_score_documents"]


def st_maxsim(data: dict, temperature: float, variant: str) -> tuple[float, list[np.ndarray]]:
    """sentence-transformers' multi-vector MNRL (``variant`` "mnrl" or "cached", with
    "/float64" for its scores in float64): the loss and the gradients of [q, docs]."""
    import contextlib

    import torch
    from sentence_transformers.multi_vector_encoder import losses
    from sentence_transformers.util import similarity

    kind, _, precision = variant.partition("/")
    k = data["docs"].shape[1]
    q = torch.tensor(data["q"], dtype=torch.float64, requires_grad=True)
    docs = torch.tensor(data["docs"], dtype=torch.float64, requires_grad=True)
    tokens = [q] + [docs[:, c] for c in range(k)]
    masks = [torch.tensor(data["q_mask"])] + [torch.tensor(data["d_mask"][:, c]) for c in range(k)]
    patch = contextlib.nullcontext()
    if precision == "float64":
        patch = _patched(similarity, "_maxsim_score_documents", _float64_scores())
    with patch:
        if kind == "mnrl":
            loss_fn = losses.MultiVectorMultipleNegativesRankingLoss(
                _GivenTokens(tokens, masks), scale=1 / temperature
            )
            loss = loss_fn([{"column": c} for c in range(k + 1)])
        else:  # the cached loss's scoring and loss on mini-batches of 5 rows
            loss_fn = losses.CachedMultiVectorMultipleNegativesRankingLoss(
                None, scale=1 / temperature, mini_batch_size=5
            )
            chunk = lambda t: [t[i : i + 5] for i in range(0, len(t), 5)]
            loss = loss_fn.calculate_loss([chunk(t) for t in tokens], [chunk(m) for m in masks])
        loss.backward()
    return loss.detach().item(), [q.grad.numpy(), docs.grad.numpy()]


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def gc_jax_maxsim(
    data: dict, temperature: float, block_size: int | None
) -> tuple[float, list[np.ndarray]]:
    """maxsim_loss's loss and gradients of [q, docs] (documents by query, as there)."""
    import jax.numpy as jnp

    from gc_jax.losses import maxsim_loss

    n, k = data["docs"].shape[:2]
    flat = lambda a: jnp.asarray(a.reshape(n * k, *a.shape[2:]))
    q_mask, d_mask = jnp.asarray(data["q_mask"]), flat(data["d_mask"])

    def loss(q, d):
        return maxsim_loss(
            q, d, q_mask=q_mask, d_mask=d_mask, temperature=temperature, block_size=block_size
        )

    value, (dq, dd) = jax.jit(jax.value_and_grad(loss, (0, 1)))(
        jnp.asarray(data["q"]), flat(data["docs"])
    )
    return float(value), [np.asarray(dq), np.asarray(dd).reshape(data["docs"].shape)]


def compare_maxsim(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every MaxSim case: each sentence-transformers form against each gc_jax form."""
    rows = []
    for name, case in MAXSIM_CASES.items():
        data = maxsim_batch(args.rows, args.dim, case)
        gc = {b: gc_jax_maxsim(data, args.maxsim_temperature, b) for b in (None, *args.block_sizes)}
        for variant in ("mnrl", "mnrl/float64", "cached", "cached/float64"):
            st_value, st_grads = st_maxsim(data, args.maxsim_temperature, variant)
            for block_size, (gc_value, gc_grads) in gc.items():
                pairs = list(zip(gc_grads, st_grads, strict=True))
                rows.append({
                    "case": name, "k": case[0], "sentence_transformers_loss": variant,
                    "block_size": block_size, "sentence_transformers": st_value,
                    "gc_jax": gc_value, "value_abs_err": abs(gc_value - st_value),
                    "value_rel_err": abs(gc_value - st_value) / abs(st_value),
                    "grad_abs_err": max(float(np.abs(a - b).max()) for a, b in pairs),
                    "grad_rel_err": max(
                        float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in pairs
                    ),
                })  # fmt: skip
    return rows


def print_maxsim(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The MaxSim table, and the worst errors per sentence-transformers form."""
    print(f"\nMaxSim: {args.rows} queries of {QUERY_TOKENS} tokens, documents of {DOC_TOKENS} "
          f"tokens, {args.dim}-d unit float64 token vectors, temperature "
          f"{args.maxsim_temperature} (scale {1 / args.maxsim_temperature:g})\n")  # fmt: skip
    print("| case | k | sentence-transformers loss | gc_jax form | sentence-transformers | "
          "gc_jax | value abs. / rel. err | grads max abs. / rel. err |")  # fmt: skip
    print("|---|---:|---|---|---:|---:|---:|---:|")
    rows = compare_maxsim(args)
    for r in rows:
        form = "dense" if r["block_size"] is None else f"block_size={r['block_size']}"
        print(f"| {r['case']} | {r['k']} | {r['sentence_transformers_loss']} | {form} | "
              f"{r['sentence_transformers']:.12f} | {r['gc_jax']:.12f} | "
              f"{r['value_abs_err']:.1e} / {r['value_rel_err']:.1e} | "
              f"{r['grad_abs_err']:.1e} / {r['grad_rel_err']:.1e} |")  # fmt: skip
    for variant in ("mnrl", "mnrl/float64", "cached", "cached/float64"):
        of = [r for r in rows if r["sentence_transformers_loss"] == variant]
        print(f"worst against {variant}: value rel. {max(r['value_rel_err'] for r in of):.1e}, "
              f"grads rel. {max(r['grad_rel_err'] for r in of):.1e}, "
              f"grads abs. {max(r['grad_abs_err'] for r in of):.1e}")  # fmt: skip
    return rows


# The sparse encoders' and regularisers' options: (sentence-transformers class and
# options, gc_jax call). Each side maps the same float64 array(s) to a scalar.
POOLINGS = [(p, a) for p in ("max", "sum") for a in ("relu", "log1p_relu")]
POOLING_CASES = {
    f"SpladePooling({p!r}, {a!r})": ("pool", {"pooling_strategy": p, "activation_function": a})
    for p, a in POOLINGS
}
REGULARIZER_CASES = {
    **POOLING_CASES,
    "FlopsLoss()": ("flops", {"threshold": None}),
    "FlopsLoss(threshold=5)": ("flops", {"threshold": 5}),
    "GOR, cos_sim": ("gor", {"similarity": "cos_sim"}),
    "GOR, cos_sim, mean_weight=0": ("gor", {"similarity": "cos_sim", "mean_weight": 0.0}),
    "GOR, dot, 6 rows (N <= d: from the pairs)": ("gor", {"similarity": "dot", "rows": 6}),
    "GOR, dot, weights 0.5 and None": (
        "gor",
        {"similarity": "dot", "mean_weight": 0.5, "second_moment_weight": None},
    ),
    "EmbedDistillLoss('mse')": ("distill", {"metric": "mse"}),
    "EmbedDistillLoss('l2')": ("distill", {"metric": "l2"}),
    "EmbedDistillLoss('cosine')": ("distill", {"metric": "cosine"}),
    "EmbedDistillLoss('cosine'), a zero student row": (
        "distill",
        {"metric": "cosine", "zero_row": True},
    ),
}


def regularizer_data(kind: str, seed: int = 2) -> dict[str, np.ndarray]:
    """Logits and a token mask (pooling), relu'd rows (FLOPS: 3 to 8 non-zeros of 8),
    rows with a common direction (GOR), a student and its teacher (distillation)."""
    rng = np.random.default_rng(seed)
    if kind == "pool":
        mask = rng.random((6, 5)) < 0.7
        mask[2] = False  # a row with no tokens
        return {"x": 2 * rng.normal(size=(6, 5, 12)), "mask": mask,
                "weights": rng.random((6, 12))}  # fmt: skip
    x = rng.normal(size=(12, 8)) + 0.8
    t = x + 0.5 * rng.normal(size=x.shape)
    if kind == "flops":
        x = np.maximum(x, 0)
    return {"x": x, "t": t}


def st_regularizer(kind: str, opts: dict, data: dict) -> tuple[float, np.ndarray]:
    """sentence-transformers' value and gradient (of ``x``), in float64 on the CPU."""
    import torch
    from sentence_transformers import util
    from sentence_transformers.sentence_transformer.losses import (
        EmbedDistillLoss,
        GlobalOrthogonalRegularizationLoss,
    )
    from sentence_transformers.sparse_encoder.losses import FlopsLoss
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    x = torch.tensor(_rows_of(kind, opts, data), dtype=torch.float64, requires_grad=True)
    if kind == "pool":
        pool = SpladePooling(**opts)  # training mode: the out-of-place log1p
        features = {"token_embeddings": x, "attention_mask": torch.tensor(data["mask"])}
        loss = torch.sum(torch.tensor(data["weights"]) * pool(features)["sentence_embedding"])
    elif kind == "flops":
        loss = FlopsLoss(None, threshold=opts["threshold"]).compute_loss_from_embeddings(x)
    elif kind == "gor":
        sim = util.cos_sim if opts["similarity"] == "cos_sim" else util.dot_score
        weights = {k: opts[k] for k in ("mean_weight", "second_moment_weight") if k in opts}
        gor = GlobalOrthogonalRegularizationLoss(None, similarity_fct=sim, **weights)
        loss = sum(gor.compute_loss_from_embeddings([x]).values())
    else:
        distill = EmbedDistillLoss(None, distance_metric=opts["metric"])
        loss = distill.compute_loss_from_embeddings([x], [torch.tensor(data["t"])])
    loss.backward()
    return loss.item(), x.grad.numpy()


def _rows_of(kind: str, opts: dict, data: dict) -> np.ndarray:
    """The differentiated rows: ``data["x"]`` (its first ``rows``), its row 1 zeroed for
    ``zero_row``."""
    x = data["x"][: opts.get("rows")].copy()
    if opts.get("zero_row"):
        x[1] = 0.0
    return x


def gc_jax_regularizer(kind: str, opts: dict, data: dict) -> tuple[float, np.ndarray]:
    """gc_jax's value and gradient (of ``x``), float64."""
    import jax.numpy as jnp

    from gc_jax.losses import (
        embedding_distillation,
        flops_regularizer,
        splade_pool,
        spread_out_regularizer,
    )

    def loss(x):
        if kind == "pool":
            pooled = splade_pool(x, jnp.asarray(data["mask"]), dtype=None, **opts)
            return jnp.sum(jnp.asarray(data["weights"]) * pooled)
        if kind == "flops":
            return flops_regularizer(x, threshold=opts["threshold"])
        if kind == "gor":
            if opts["similarity"] == "cos_sim":
                x = x / jnp.linalg.norm(x, axis=1, keepdims=True)
            weights = {k: opts[k] for k in ("mean_weight", "second_moment_weight") if k in opts}
            return spread_out_regularizer(x, variant="gor", **weights)
        return embedding_distillation(x, jnp.asarray(data["t"]), metric=opts["metric"])

    value, grad = jax.jit(jax.value_and_grad(loss))(jnp.asarray(_rows_of(kind, opts, data)))
    return float(value), np.asarray(grad)


def print_regularizers() -> list[dict[str, Any]]:
    """The sparse and regulariser cases: value and gradient against sentence-transformers."""
    print("\nSparse encoders and regularisers: SpladePooling on [6, 5, 12] logits with a "
          "token mask (a weighted sum of the pooled weights), the others on [12, 8] "
          "float64 rows\n")  # fmt: skip
    print("| case | sentence-transformers | gc_jax | value abs. err | "
          "grad max abs. err | grad rel. err |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for name, (kind, opts) in REGULARIZER_CASES.items():
        data = regularizer_data(kind)
        st_value, st_grad = st_regularizer(kind, opts, data)
        gc_value, gc_grad = gc_jax_regularizer(kind, opts, data)
        err = gc_grad - st_grad
        row = {"case": name, "sentence_transformers": st_value, "gc_jax": gc_value,
               "value_abs_err": abs(gc_value - st_value),
               "grad_abs_err": float(np.abs(err).max()),
               "grad_rel_err": float(np.linalg.norm(err) / np.linalg.norm(st_grad))}  # fmt: skip
        rows.append(row)
        print(f"| {name} | {st_value:.12f} | {gc_value:.12f} | {row['value_abs_err']:.1e} | "
              f"{row['grad_abs_err']:.1e} | {row['grad_rel_err']:.1e} |", flush=True)  # fmt: skip
    return rows


def print_losses(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The contrastive losses' table (MNRL and GIST), and the worst error."""
    print(f"{args.rows} queries, {args.dim}-d float64 rows, temperature {args.temperature}\n")
    print("| case | k | gc_jax form | sentence-transformers | gc_jax | value rel. err | "
          "grads rel. err |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|")
    rows = []
    for name in CASES:
        for block_size in (None, *args.block_sizes):
            row = compare(name, args, block_size)
            rows.append(row)
            mark = " (differs by definition)" if name in DIFFERS else ""
            form = "dense" if block_size is None else f"block_size={block_size}"
            print(f"| {name}{mark} | {row['k']} | {form} | {row['sentence_transformers']:.12f} | "
                  f"{row['gc_jax']:.12f} | {row['value_rel_err']:.1e} | "
                  f"{row['grad_rel_err']:.1e} |", flush=True)  # fmt: skip
    agree = [r for r in rows if r["case"] not in DIFFERS]
    worst = max(max(r["value_rel_err"], r["grad_rel_err"]) for r in agree)
    print(f"\nworst relative error where the definitions agree: {worst:.1e}")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    import sentence_transformers

    print(f"machine: {common.machine()}; sentence-transformers {sentence_transformers.__version__}")
    rows = print_losses(args) if "losses" in args.parts else []
    maxsim_rows = print_maxsim(args) if "maxsim" in args.parts else []
    regularizer_rows = print_regularizers() if "regularizers" in args.parts else []
    if args.json:
        result = {"command": common.command("peer_sentence_transformers", sys.argv[1:]),
                  "machine": common.machine(), "args": vars(args), "cases": rows,
                  "maxsim_cases": maxsim_rows, "regularizer_cases": regularizer_rows,
                  "sentence_transformers": sentence_transformers.__version__}  # fmt: skip
        common.write_json(common.ROOT / args.json, result)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
