"""Compile time of a token-budget step against ``gc_jax.testing``'s reference of it.

``gc_jax.testing.full_batch_value_and_grad(loss, encode, budget)`` with ``rng`` encodes
every chunk the budget could cut, with its key, differentiably (the reference that
checks dropout replay on a small batch). It should compile about as fast as the
cached step itself: issue 24 found 424 s against 23.5 s (unrolled turns), the bound
asked is 2x. Here: a 2-layer attention encoder with dropout (width 32), B = 64 rows
per input padded to 96 tokens, a 6-bucket budget (256 tokens: 16 ... 96), InfoNCE.
Prints the wall-clock lower + compile seconds of each, ``--rounds`` times alternating
(median and range), and the largest difference of their loss and gradients.

Usage::

    python -m benchmarks.reference_compile
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import gc_jax

B, L, W, V = 64, 96, 32, 50


def batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    lens = rng.integers(4, L + 1, B)
    mask = (np.arange(L)[None] < lens[:, None]).astype(np.int32)
    return {"input_ids": jnp.asarray(rng.integers(1, V, (B, L)) * mask),
            "attention_mask": jnp.asarray(mask)}  # fmt: skip


def encode(p, b, key):
    x = p["emb"][b["input_ids"]] + p["pos"][: b["input_ids"].shape[1]]
    m = b["attention_mask"]
    for layer in range(2):
        s = jnp.einsum("bqd,bkd->bqk", x @ p["q"][layer], x @ p["k"][layer]) / np.sqrt(W)
        x = x + jax.nn.softmax(jnp.where(m[:, None, :] > 0, s, -1e9), -1) @ x
        x = jnp.tanh(x @ p["o"][layer])
        if key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(key, layer), 0.9, x.shape)
            x = jnp.where(keep, x / 0.9, 0)
    return (x * m[..., None]).sum(1) / m.sum(1, keepdims=True)


def params() -> dict:
    k = jax.random.split(jax.random.key(0), 5)
    small = lambda key, shape: jax.random.normal(key, shape) / 6
    layers = {name: small(key, (2, W, W)) for name, key in zip("qko", k[2:], strict=True)}
    embed = {"emb": jax.random.normal(k[0], (V, W)), "pos": jax.random.normal(k[1], (L, W))}
    return {**embed, **layers}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    loss = lambda p, a, b: gc_jax.losses.contrastive_loss(a, b, temperature=0.1)
    budget = gc_jax.TokenBudget(256, (16, 32, 48, 64, 80, 96))
    p, q, d, key = params(), batch(1), batch(2), jax.random.key(7)
    makers = {"cached": gc_jax.cached_value_and_grad,
              "reference": gc_jax.testing.full_batch_value_and_grad}  # fmt: skip
    times: dict = {name: [] for name in makers}
    for _ in range(args.rounds):
        for name, make in makers.items():
            f = jax.jit(make(loss, encode, budget))
            start = time.perf_counter()
            f.lower(p, q, d, rng=key).compile()
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name}: compile s median {statistics.median(t):.1f} "
              f"(range {min(t):.1f}-{max(t):.1f})")  # fmt: skip
    ratio = statistics.median(times["reference"]) / statistics.median(times["cached"])
    print(f"reference / cached, ratio of medians: {ratio:.2f}")
    got, want = (jax.jit(m(loss, encode, budget))(p, q, d, rng=key) for m in makers.values())
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
    print(f"max |difference| of loss and gradients: {diff:.1e}")
    return {"times": times, "ratio": ratio, "max_diff": diff}


if __name__ == "__main__":
    main()
