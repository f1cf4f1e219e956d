"""docs/losses_matryoshka_maxsim.md: the page runs top to bottom, and what each block computes
is right."""

import chex
import jax
import jax.numpy as jnp
from doc_pages import run_page

PAGE = "docs/losses_matryoshka_maxsim.md"


def run_block(name: str) -> dict:
    """The page's names after its block ``name``: the page runs top to bottom in one
    namespace (``doc_pages.run_page``), as a reader runs it."""
    return run_page(PAGE)[name].namespace


def test_matryoshka_block_matches_the_full_batch():
    ns = run_block("matryoshka")
    loss_fn, params, q, d = ns["loss_fn"], ns["params"], ns["q"], ns["d"]
    unit = lambda v: v / jnp.linalg.norm(v, axis=-1, keepdims=True)

    def full(p):  # the definition: every width by hand, renormalised
        x, y = q @ p["w"], d @ p["w"]
        return sum(loss_fn(p, unit(x[:, :m]), unit(y[:, :m])) for m in (64, 32, 16, 8))

    want = jax.jit(jax.value_and_grad(full))(params)
    chex.assert_trees_all_close((ns["value"], ns["grads"]), want, rtol=2e-5, atol=2e-6)
    x, y = q @ params["w"], d @ params["w"]
    by_hand = sum(w * ns["loss"](unit(x[:, :m]), unit(y[:, :m]))
                  for m, w in zip((64, 32, 16, 8), (1.0, 1.0, 0.5, 0.5), strict=True))  # fmt: skip
    chex.assert_trees_all_close(ns["mrl"](x, y), by_hand, rtol=2e-5)


def test_maxsim_block_matches_the_full_batch_with_and_without_a_budget():
    ns = run_block("maxsim")
    encode, loss_fn, params, q, d = (ns[k] for k in ("encode", "loss_fn", "params", "q", "d"))
    full = lambda p: loss_fn(p, encode(p, q, None), encode(p, d, None))
    want = jax.jit(jax.value_and_grad(full))(params)
    chex.assert_trees_all_close((ns["value"], ns["grads"]), want, rtol=2e-5, atol=2e-6)
    chex.assert_trees_all_close((ns["value_tb"], ns["grads_tb"]), want, rtol=2e-5, atol=2e-6)
