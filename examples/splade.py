"""Train a tiny SPLADE sparse retriever with gradient caching: exact FLOPS regularisation.

A SPLADE encoder maps a text to a vocabulary-sized vector of non-negative weights: a
masked-LM head's logits, ``max`` over the tokens of ``log(1 + relu(logits))``
(``gc_jax.losses.splade_pool``). It is trained with InfoNCE on the dot products of
these vectors plus the FLOPS regulariser of the queries and of the documents, whose
weights rise quadratically over the first steps (``gc_jax.losses.quadratic_warmup``).
The FLOPS term squares each vocabulary entry's mean over the *batch*, so it is a
function of the whole batch: with ``gc_jax.make_train_step`` it is exact over the
global batch while only ``--chunk`` rows are encoded at a time (sentence-transformers'
cached losses cannot do this for ``SpladeLoss``).

The model is tiny (an embedding table tied to the masked-LM head, one token-mixing
layer) and the data synthetic: each document is ``--doc-tokens`` random tokens, its
query ``--query-tokens`` of them. The representations are cached in bfloat16
(``splade_pool``'s default). It prints, every few steps, the loss, the regulariser's
weight, the mean number of non-zero vocabulary entries per query and per document,
and R@1 on held-out pairs; the non-zeros fall as the FLOPS weight rises.

Usage::

    python examples/splade.py                    # 200 steps of 64 pairs, a minute on a CPU
    python examples/splade.py --steps 50 --batch 128 --chunk 16
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gc_jax
from gc_jax.losses import contrastive_loss, quadratic_warmup, sparse_regularizer, splade_pool


class Config(NamedTuple):
    vocab: int = 512
    hidden: int = 32
    query_tokens: int = 4
    doc_tokens: int = 12
    query_weight: float = 3e-2  # SPLADE's lambda_q and lambda_d, scaled to this toy
    doc_weight: float = 1e-2
    warmup_steps: int = 100


def init(config: Config, key: jax.Array) -> dict[str, jax.Array]:
    k1, k2, k3 = jax.random.split(key, 3)
    h = config.hidden
    return {
        "embed": jax.random.normal(k1, (config.vocab, h)) / np.sqrt(h),  # tied to the head
        "mix": jax.random.normal(k2, (h, h)) / np.sqrt(h),
        "out": jax.random.normal(k3, (h, h)) / np.sqrt(h),
        "bias": jnp.zeros(config.vocab),
    }


def mlm_logits(params: dict, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """A tiny masked-LM: token embeddings, one mixing layer with the text's mean, tied head."""
    e = params["embed"][ids]  # [rows, tokens, hidden]
    m = mask[..., None].astype(e.dtype)
    context = jnp.sum(e * m, axis=1, keepdims=True) / jnp.maximum(
        jnp.sum(m, axis=1, keepdims=True), 1
    )
    h = jnp.tanh(e + jnp.tanh(context @ params["mix"]) @ params["out"])
    return h @ params["embed"].T + params["bias"]  # [rows, tokens, vocab]


def encode(params: dict, batch: dict, key: Any) -> jax.Array:
    """``encode(params, chunk, key)``: the chunk's SPLADE vectors, bfloat16."""
    return splade_pool(mlm_logits(params, batch["ids"], batch["mask"]), batch["mask"])


def loss_fn(params: dict, queries: jax.Array, docs: jax.Array, *, step: jax.Array, config: Config):
    """InfoNCE on sparse dot products + both sides' FLOPS, warmed up quadratically."""
    regularizer = sparse_regularizer(
        queries,
        docs,
        query_weight=quadratic_warmup(config.query_weight, config.warmup_steps),
        doc_weight=quadratic_warmup(config.doc_weight, config.warmup_steps),
        step=step,
    )
    return contrastive_loss(queries, docs) + regularizer  # SPLADE: raw dot products


def make_pairs(config: Config, n: int, seed: int) -> tuple[dict, dict]:
    """``n`` synthetic (query, document) pairs; the query is some of its document's tokens."""
    rng = np.random.default_rng(seed)
    docs = rng.integers(1, config.vocab, (n, config.doc_tokens))
    picks = np.argsort(rng.random((n, config.doc_tokens)), axis=1)[:, : config.query_tokens]
    queries = np.take_along_axis(docs, picks, axis=1)
    as_batch = lambda ids: {"ids": jnp.asarray(ids, jnp.int32), "mask": jnp.ones(ids.shape, bool)}
    return as_batch(queries), as_batch(docs)


def recall_at_1(params: dict, queries: dict, docs: dict) -> float:
    q, d = encode(params, queries, None), encode(params, docs, None)
    scores = jnp.matmul(q, d.T, preferred_element_type=jnp.float32)
    return float(jnp.mean(jnp.argmax(scores, axis=1) == jnp.arange(len(scores))))


def nonzeros(reps: jax.Array) -> float:
    """Mean number of non-zero vocabulary entries per row."""
    return float(jnp.mean(jnp.sum(reps > 0, axis=1)))


def make_step(config: Config, chunk: int, optimizer: optax.GradientTransformation):
    loss = functools.partial(loss_fn, config=config)
    return jax.jit(gc_jax.make_train_step(loss, encode, chunk, optimizer=optimizer))


def train(config: Config, steps: int, batch: int, chunk: int, *, lr: float = 3e-3, seed: int = 0,
          log_every: int = 25, log=print) -> tuple[dict, list[dict]]:  # fmt: skip
    """Trains from scratch; returns the parameters and the logged history."""
    optimizer = optax.adamw(lr)
    params = init(config, jax.random.key(seed))
    state = (params, optimizer.init(params))
    step_fn = make_step(config, chunk, optimizer)
    held_q, held_d = make_pairs(config, 256, seed=seed + 10_000)
    history = []
    for t in range(steps):
        queries, docs = make_pairs(config, batch, seed=seed + t)
        state, metrics = step_fn(state, queries, docs, step=jnp.int32(t))
        if t % log_every == 0 or t == steps - 1:
            p = state[0]
            row = {
                "step": t,
                "loss": float(metrics["loss"]),
                "weight_d": float(quadratic_warmup(config.doc_weight, config.warmup_steps)(t)),
                "nonzeros_q": nonzeros(encode(p, held_q, None)),
                "nonzeros_d": nonzeros(encode(p, held_d, None)),
                "recall_at_1": recall_at_1(p, held_q, held_d),
            }
            history.append(row)
            log(
                f"step {t:4d}  loss {row['loss']:.3f}  lambda_d {row['weight_d']:.1e}  "
                f"non-zeros q {row['nonzeros_q']:.0f} d {row['nonzeros_d']:.0f}  "
                f"R@1 {row['recall_at_1']:.3f}"
            )
    return state[0], history


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64, help="pairs per step (the global batch)")
    p.add_argument("--chunk", type=int, default=16, help="rows encoded at once")
    p.add_argument("--vocab", type=int, default=Config().vocab)
    p.add_argument("--warmup-steps", type=int, default=Config().warmup_steps)
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    config = Config(vocab=args.vocab, warmup_steps=args.warmup_steps)
    _, history = train(config, args.steps, args.batch, args.chunk, log_every=args.log_every)
    return history


if __name__ == "__main__":
    main()
