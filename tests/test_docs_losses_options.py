"""docs/losses_options.md: the page runs top to bottom, and each block gives what the naive
reference gives."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from doc_pages import run_page
from options_reference import contrastive
from test_gist import reference as gist_reference

PAGE = "docs/losses_options.md"
TOL = {"rtol": 2e-5, "atol": 2e-6}


def run(name: str) -> dict:
    """The page's names after its block ``name``: the page runs top to bottom in one
    namespace (``doc_pages.run_page``), as a reader runs it."""
    return run_page(PAGE)[name].namespace


def test_directions_block():
    ns = run("directions")
    q, d, gte = ns["q"], ns["d"], ns["gte"]
    chex.assert_trees_all_close(ns["loss"], contrastive(q, d, 0.05, directions=gte), **TOL)
    symmetric = contrastive(q, d, 0.05, directions=("query_to_doc", "doc_to_query"),
                            partition_mode="per_direction")  # fmt: skip
    chex.assert_trees_all_close(ns["symmetric"], symmetric, **TOL)
    chex.assert_trees_all_close(ns["blockwise"], ns["loss"], rtol=2e-5)


def test_ids_block():
    ns = run("ids")
    ids = ns["text_ids"](ns["tokens"], ns["mask"])
    assert bool((ids[6] == ids[0]).all()) and len({tuple(map(int, r)) for r in ids}) == 15
    want = contrastive(ns["q"], ns["d"], 0.05, doc_ids=np.asarray(ids))
    chex.assert_trees_all_close(ns["masked"], want, **TOL)
    assert float(ns["masked"]) < float(ns["plain"])


def test_guide_block_trains_with_the_full_batch_gradient():
    ns = run("guide")
    q, d, guide_w = ns["q"], ns["d"], ns["guide_w"]
    w0 = jnp.eye(16) + 0.05
    reps = (ns["guide"](guide_w, q, None), ns["guide"](guide_w, d, None))
    enc = lambda w, x: ns["student"](w, x, None)
    k = len(d) // len(q)
    full = lambda w: gist_reference(enc(w, q), enc(w, d), 0.05, reps, k=k, margin=0.1)
    assert bool(ns["metrics"]["is_finite"])
    chex.assert_trees_all_close(ns["w"], w0 - 0.1 * jax.grad(full)(w0), rtol=1e-5, atol=1e-6)
