"""Small batches with a representation bank (ContAccum, MoCo): R@1 with and without.

A dual encoder trained with InfoNCE on small batches sees few negatives per step.
``gc_jax.losses.Bank`` keeps the last ``--bank`` steps' query and document
representations and adds them to the loss as negatives without gradient
(``contrastive_loss(..., bank=)``); the step stays gradient-cached and exact over its
own batch. The bank lives in the train state: the loss reads it as a keyword and
returns the updated bank as its aux (``make_train_step(has_aux=True)``).

The model is tiny (token embeddings, mean-pooled, one tanh layer, unit-normalised)
and the data synthetic: each document is ``--doc-tokens`` random tokens of a
vocabulary of ``--vocab``, its query ``--query-tokens`` of them. It trains the same
model from the same seeds with no bank and with a bank of ``--bank`` steps, and
prints R@1 over a held-out corpus of ``--corpus`` documents for each.

Usage::

    python examples/bank.py                       # 300 steps of 16 pairs, bank of 4 steps
    python examples/bank.py --batch 8 --bank 16 --seeds 5
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import gc_jax
from gc_jax.losses import Bank, contrastive_loss, init_bank, update_bank


class Config(NamedTuple):
    vocab: int = 2048
    hidden: int = 64
    dim: int = 32
    query_tokens: int = 3
    doc_tokens: int = 12
    temperature: float = 0.05


class BankState(TrainState):
    bank: Bank | None  # None: trained without a bank


def init(config: Config, key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "embed": jax.random.normal(k1, (config.vocab, config.hidden)),
        "out": jax.random.normal(k2, (config.hidden, config.dim)) / np.sqrt(config.hidden),
    }


def encode(params: dict, ids: jax.Array, key: Any) -> jax.Array:
    """``encode(params, chunk, key)``: unit vectors of the chunk's texts."""
    h = jnp.tanh(params["embed"][ids].mean(axis=1)) @ params["out"]
    return h / jnp.linalg.norm(h, axis=-1, keepdims=True)


def make_step(config: Config, chunk: int):
    """The jitted step; the bank (if the state has one) read by the loss and written back."""

    def loss_fn(params, q, d, *, bank):
        loss = contrastive_loss(q, d, temperature=config.temperature, bank=bank)
        return loss, None if bank is None else update_bank(bank, q, d)

    step = gc_jax.make_train_step(loss_fn, encode, chunk, has_aux=True)

    @jax.jit
    def train_step(state: BankState, q: jax.Array, d: jax.Array):
        state, metrics = step(state, q, d, bank=state.bank)
        bank = metrics.pop("aux")
        if bank is not None:  # a skipped (non-finite) step writes nothing either
            keep = lambda new, old: jnp.where(metrics["is_finite"], new, old)
            state = state.replace(bank=jax.tree.map(keep, bank, state.bank))
        return state, metrics

    return train_step


def make_pairs(config: Config, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` synthetic (query, document) pairs; the query is some of its document's tokens."""
    rng = np.random.default_rng(seed)
    docs = rng.integers(0, config.vocab, (n, config.doc_tokens))
    picks = np.argsort(rng.random((n, config.doc_tokens)), axis=1)[:, : config.query_tokens]
    return np.take_along_axis(docs, picks, axis=1).astype(np.int32), docs.astype(np.int32)


def recall_at_1(params: dict, queries: np.ndarray, docs: np.ndarray) -> float:
    scores = encode(params, queries, None) @ encode(params, docs, None).T
    return float(jnp.mean(jnp.argmax(scores, axis=1) == jnp.arange(len(scores))))


def train(config: Config, steps: int, batch: int, chunk: int, bank_steps: int, *,
          lr: float = 1e-2, seed: int = 0, corpus: int = 1024) -> dict:  # fmt: skip
    """Trains from scratch; returns the final loss, R@1 and the bank's count."""
    params = init(config, jax.random.key(seed))
    bank = None
    if bank_steps:
        q0, d0 = (jax.ShapeDtypeStruct((batch, config.dim), jnp.float32),) * 2
        bank = init_bank(bank_steps, q0, d0)
    state = BankState.create(apply_fn=None, params=params, tx=optax.adam(lr), bank=bank)
    step = make_step(config, chunk)
    for t in range(steps):
        state, metrics = step(state, *make_pairs(config, batch, seed=seed * 100_003 + t))
    held = make_pairs(config, corpus, seed=seed + 10**9)
    return {
        "loss": float(metrics["loss"]),
        "recall_at_1": recall_at_1(state.params, *held),
        "bank_count": 0 if bank is None else int(state.bank.count),
    }


def main(argv: Sequence[str] | None = None) -> dict[int, list[float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="pairs per step")
    p.add_argument("--chunk", type=int, default=8, help="rows encoded at once")
    p.add_argument("--bank", type=int, default=4, help="steps the bank holds")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--corpus", type=int, default=1024, help="held-out pairs for R@1")
    args = p.parse_args(argv)
    recalls: dict[int, list[float]] = {}
    for bank_steps in (0, args.bank):
        for seed in range(args.seeds):
            out = train(Config(), args.steps, args.batch, args.chunk, bank_steps, seed=seed,
                        corpus=args.corpus)  # fmt: skip
            recalls.setdefault(bank_steps, []).append(out["recall_at_1"])
            print(f"bank {bank_steps:3d} steps  seed {seed}  loss {out['loss']:.3f}  "
                  f"R@1 {out['recall_at_1']:.3f}")  # fmt: skip
    for bank_steps, r in recalls.items():
        print(f"bank {bank_steps:3d} steps: R@1 mean {np.mean(r):.3f} (min {min(r):.3f}, "
              f"max {max(r):.3f}) over {len(r)} seeds")  # fmt: skip
    return recalls


if __name__ == "__main__":
    main()
