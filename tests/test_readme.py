"""The README's quick start runs as written and gives the full-batch gradient."""

import re
from pathlib import Path

import chex
import jax
import jax.numpy as jnp

import gc_jax

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_quick_start_runs_and_matches_full_batch():
    namespace: dict = {}
    exec(python_blocks()[0], namespace)  # the quick start: encode, loss_fn, grad_fn, train_step
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (8, 16)), "w2": jax.random.normal(k2, (16, 4))}
    queries, docs = jax.random.normal(k3, (600, 8)), jax.random.normal(k4, (600, 8))
    opt_state = namespace["optimizer"].init(params)
    _, _, loss = namespace["train_step"](params, opt_state, queries, docs, None)

    encode, loss_fn = namespace["encode"], namespace["loss_fn"]
    full = jax.value_and_grad(lambda p: loss_fn(p, encode(p, queries, None), encode(p, docs, None)))
    want_loss, want_grads = jax.jit(full)(params)
    chex.assert_trees_all_close(loss, want_loss, rtol=1e-5)
    _, grads = jax.jit(namespace["grad_fn"])(params, queries, docs)
    chex.assert_trees_all_close(grads, want_grads, rtol=2e-5, atol=1e-6)
    assert jnp.isfinite(loss)


def test_bring_your_own_step_matches_full_batch():
    namespace: dict = {}
    exec(python_blocks()[0], namespace)  # encode, loss_fn from the quick start
    (byo,) = [b for b in python_blocks() if b.startswith("# bring your own step")]
    exec(byo, namespace)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    params = {"w1": jax.random.normal(k1, (8, 16)), "w2": jax.random.normal(k2, (16, 4))}
    queries, docs = jax.random.normal(k3, (600, 8)), jax.random.normal(k4, (600, 8))
    opt_state = namespace["tx"].init(params)
    new_params, _, loss = namespace["my_step"](params, opt_state, queries, docs, None)

    encode, tx = namespace["encode"], namespace["tx"]
    loss_of = lambda p: gc_jax.losses.contrastive_loss(
        encode(p, queries, None), encode(p, docs, None), temperature=0.05
    )
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss_of))(params)
    updates, _ = tx.update(want_grads, tx.init(params), params)
    want = jax.tree.map(lambda p, u: p + u, params, updates)
    chex.assert_trees_all_close(loss, want_loss, rtol=1e-5)
    chex.assert_trees_all_close(new_params, want, rtol=1e-4, atol=1e-6)
