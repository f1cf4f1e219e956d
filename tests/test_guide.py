"""The guide's pages (docs/*.md): every python block runs and computes what the page says.

Each block starts with a comment naming it (``# quick start``). A page's blocks run in
order in one namespace, as a reader would run them, and each test checks what they
computed against plain ``jax.value_and_grad`` over the whole (unsharded) batch.
``docs/models.md`` is tested by ``tests/test_docs.py``; ``test_every_block_is_run``
makes sure no block on any other page goes untested.
"""

import contextlib
import functools
import io
import os
from operator import itemgetter
from pathlib import Path

import chex
import doc_pages
import jax
import jax.numpy as jnp
import optax
import pytest
from doc_pages import run_page

import gc_jax

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # as tests/test_tpu.py: others may hold it
DOCS = Path(__file__).resolve().parent.parent / "docs"
TOL = {"rtol": 2e-5, "atol": 2e-6}

# The blocks each page has, in order; the tests below run them.
PAGES = {
    "quickstart.md": [
        "quick start",
        "run it",
        "a full training step",
        "a full training step: params and opt_state",
        "bring your own step: a plain optax loop",
        "bring your own step: nnx",
    ],
    "chunk_size.md": ["setup", "largest chunk size", "keep what fits"],
    "mixed_precision.md": ["bfloat16", "float16: dynamic loss scaling"],
    "token_budgets.md": ["token budget", "run it", "token packing"],
    "scaling_out.md": [
        "setup",
        "shard_map",
        "sharded jit, explicit axes",
        "sharded jit, auto axes",
    ],
    "losses.md": [
        "setup",
        "the losses inside shard_map",
        "blockwise",
        "ring",
        "your own distributed loss",
    ],
    "porting.md": ["GradCache class", "cachex"],
    "large_embedders.md": [
        "setup",
        "the step: LoRA, an FSDP base, the ring loss",
        "gathered once per step: full fine-tuning, the local view",
    ],
    "correctness.md": ["check your model", "a model that mixes rows"],
    "recipes.md": [
        "setup",
        "sparse: the encoder",
        "sparse: the step",
        "EmbeddingGemma: the loss",
        "EmbeddingGemma: the step",
        "bank: the loss",
        "bank: the step",
    ],
}
TESTED_ELSEWHERE = {
    "models.md",  # tests/test_docs.py
    "losses_options.md",  # tests/test_docs_losses_options.py
    "losses_matryoshka_maxsim.md",  # tests/test_losses_guide.py
    "model_libraries.md",  # tests/test_docs_model_libraries.py (benchmarks/ runs its code)
}


def blocks(page: str) -> dict[str, str]:
    """The page's python blocks by their first line, a comment naming them."""
    return doc_pages.blocks(f"docs/{page}")


def run(page: str, *names: str, namespace: dict | None = None) -> dict:
    """Runs ``names``' blocks of ``page`` in ``namespace`` (a new one by default), from
    the repository root, each printing what the page says (:func:`doc_pages.run_block`).
    The blocks a namespace has run must be the page's first ones, in order: a reader runs
    the page top to bottom (:func:`doc_pages.run_page` runs a whole page once)."""
    namespace = {} if namespace is None else namespace
    done = namespace.setdefault("__blocks__", [])
    for name in names:
        doc_pages.run_block(f"docs/{page}", name, namespace)
        done.append(name)
    assert done == list(blocks(page))[: len(done)], f"{page}: not top to bottom: {done}"
    return namespace


def full_value_and_grad(loss_fn, encode, params, *inputs):
    """Plain ``jax.value_and_grad`` over the whole batch, no chunks, no key."""
    total = lambda p: loss_fn(p, *(encode(p, x, None) for x in inputs))
    return jax.jit(jax.value_and_grad(total))(params)


def adamw_step(params, grads, lr=1e-3):
    tx = optax.adamw(lr)
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def test_every_block_is_run():
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    for page in sorted(pages - TESTED_ELSEWHERE):
        assert list(blocks(page)) == PAGES.get(page, []), f"{page}: update PAGES and its test"


# The libraries a page tells its reader to install first, beside gc_jax's extras.
INSTALLED_BY_THE_READER = {"docs/model_libraries.md": {"gemma", "kauldron", "maxtext", "penzai"}}


def test_every_import_resolves_from_the_repository_root():
    """A reader runs the blocks from the repository root: each module they import is
    installed (by gc_jax's extras, or by the install notes of the page), or in
    ``examples/`` where the page says ``PYTHONPATH=examples``."""
    for page in sorted(p.relative_to(DOCS.parent).as_posix() for p in DOCS.rglob("*.md")):
        missing = doc_pages.unimportable_from_the_root(page)
        assert not missing - INSTALLED_BY_THE_READER.get(page, set()), (page, missing)


def test_a_block_prints_what_its_page_says():
    """``# prints:`` lines are compared with the output, ``...`` matching any text; a
    print the page does not announce, or another text, fails with a diff."""
    code = 'print("loss 9.72")  # prints: loss 9.72\nprint(error)  # prints: gradient caching ...'
    doc_pages.check_output("page", code, "loss 9.72\ngradient caching differs\nrows: 3\n")
    page_says, printed = "# prints: 2 PartitionSpec('data',)", "2 P('data', None, None)"
    with pytest.raises(AssertionError) as error:
        doc_pages.check_output("recipes.md, block 'bank: the step'", page_says, printed)
    assert str(error.value).splitlines() == [
        "recipes.md, block 'bank: the step' prints what the page does not say:",
        "--- the page says (# prints:)",
        "+++ printed",
        "@@ -1 +1 @@",
        "-2 PartitionSpec('data',)",
        "+2 P('data', None, None)",
    ]
    with pytest.raises(AssertionError, match=r"\+loss 1\.00"):
        doc_pages.check_output("page", "print(loss)", "loss 1.00\n")  # printed, not said


def test_quickstart():
    """The page's blocks in order, in one namespace, as a reader runs them."""
    from flax import nnx

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ns = run("quickstart.md", "quick start", "run it")
    params, queries, docs = ns["params"], ns["queries"], ns["docs"]
    want_loss, want_grads = full_value_and_grad(ns["loss_fn"], ns["encode"], params, queries, docs)
    want_params = adamw_step(params, want_grads)
    chex.assert_trees_all_close(ns["loss"], want_loss, **TOL)
    chex.assert_trees_all_close(ns["new_params"], want_params, **TOL)
    # What it prints is what the page says, a plausible loss for unit-norm embeddings.
    printed = out.getvalue().strip()
    assert printed == f"loss {float(want_loss):.2f}" and 6 < float(want_loss) < 15

    run("quickstart.md", "a full training step", namespace=ns)
    chex.assert_trees_all_close(ns["metrics"]["loss"], want_loss, **TOL)
    chex.assert_trees_all_close(ns["state"].params, want_params, **TOL)

    reference = nnx.Linear(8, 4, rngs=nnx.Rngs(0))  # the next block's model, before its step
    unit = lambda out: out / jnp.linalg.norm(out, axis=-1, keepdims=True)
    encode = gc_jax.nnx_encoder(reference, get_rep=unit)
    weights = nnx.state(reference, nnx.Param)
    want_value, want_grads_nnx = full_value_and_grad(ns["loss_fn"], encode, weights, queries, docs)
    run("quickstart.md", "a full training step: params and opt_state", namespace=ns)
    chex.assert_trees_all_close(ns["metrics"]["loss"], want_value, **TOL)
    trained = adamw_step(weights, want_grads_nnx)
    chex.assert_trees_all_close(ns["weights"], trained, **TOL)  # the (params, opt_state) pair
    chex.assert_trees_all_close(nnx.state(ns["linear"], nnx.Param), trained, **TOL)  # nnx.update

    run("quickstart.md", "bring your own step: a plain optax loop", namespace=ns)
    tx = ns["tx"]
    updates, _ = tx.update(want_grads, tx.init(params), params)
    chex.assert_trees_all_close(ns["loss"], want_loss, **TOL)  # its step, run on `params`
    chex.assert_trees_all_close(ns["new_params"], optax.apply_updates(params, updates), **TOL)

    reference = nnx.Linear(8, 4, rngs=nnx.Rngs(0))  # the next block's model, before its step
    nnx_params = nnx.state(reference, nnx.Param)
    want_loss, want_grads = full_value_and_grad(
        ns["loss_fn"], gc_jax.nnx_encoder(reference), nnx_params, queries, docs
    )
    run("quickstart.md", "bring your own step: nnx", namespace=ns)
    chex.assert_trees_all_close(ns["value"], want_loss, **TOL)
    got = jax.tree.leaves(nnx.state(ns["model"], nnx.Param))
    chex.assert_trees_all_close(got, jax.tree.leaves(adamw_step(nnx_params, want_grads)), **TOL)


def test_mixed_precision():
    ns = run("mixed_precision.md", "bfloat16")
    want_loss, want_grads = full_value_and_grad(
        ns["loss_fn"], ns["encode"], ns["params"], ns["queries"], ns["docs"]
    )
    chex.assert_trees_all_close(ns["loss"], want_loss, rtol=1e-4)  # the same bfloat16 reps
    chex.assert_trees_all_close(ns["grads"], want_grads, rtol=2e-2, atol=5e-3)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(ns["grads"]))

    run("mixed_precision.md", "float16: dynamic loss scaling", namespace=ns)
    params, _, scale = ns["state"]
    assert float(scale.scale) == 2.0**14 and int(scale.good_steps) == 3  # one skip, three steps
    assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(params))


def test_largest_chunk_size_on_a_compile_only_tpu():
    """Needs libtpu (the ``tpu`` extra), as tests/test_tpu.py does: fails without it."""
    from flax.training.train_state import TrainState

    ns = run("chunk_size.md", "setup", "largest chunk size")
    assert isinstance(ns["state"], TrainState)
    # This model's full batch of 4,096 rows takes a few MiB: the largest candidate fits.
    assert ns["chip"].platform == "tpu"
    assert ns["chunk"] == 4096


def test_token_budget(capsys):
    ns = run("token_budgets.md", "token budget", "run it")
    want = full_value_and_grad(ns["loss_fn"], ns["encode"], ns["params"], ns["queries"], ns["docs"])
    chex.assert_trees_all_close((ns["loss"], ns["grads"]), want, **TOL)
    shapes = capsys.readouterr().out.strip()
    assert shapes == "((256, 32), (128, 64), (64, 128), (32, 256))"
    assert f"(above: `{shapes}`)" in (DOCS / "token_budgets.md").read_text()


def test_token_packing(capsys):
    ns = run("token_budgets.md", "token budget", "run it", "token packing")
    enc = ns["packed_encode"]
    want = full_value_and_grad(ns["loss_fn"], enc, ns["params"], ns["queries"], ns["docs"])
    chex.assert_trees_all_close((ns["loss"], ns["grads"]), want, **TOL)
    counts = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"(above: `{counts}`:" in (DOCS / "token_budgets.md").read_text()
    assert ns["packed"].chunk_shapes(256, 256) == ((32, 256),)


def test_scaling_out():
    ns = run("scaling_out.md", "setup")
    want = full_value_and_grad(ns["loss_fn"], ns["encode"], ns["params"], ns["queries"], ns["docs"])
    for name in PAGES["scaling_out.md"][1:]:
        ns.pop("loss", None)
        run("scaling_out.md", name, namespace=ns)
        chex.assert_trees_all_close((ns["loss"], ns["grads"]), want, **TOL)


def test_losses_inside_shard_map():
    ns = run("losses.md", "setup", "the losses inside shard_map")  # the page's first blocks
    loss = lambda x, y, t: gc_jax.losses.contrastive_loss(x, y, temperature=t)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(ns["x"], ns["y"], 0.05)
    chex.assert_trees_all_close((ns["value"], (ns["dx"], ns["dy"], ns["dt"])), want, **TOL)


def test_blockwise_loss():
    ns = run_page("docs/losses.md")["blockwise"].namespace
    dense = lambda x, y: gc_jax.losses.clip_loss(x, y, jnp.log(1 / 0.07))
    want = jax.jit(jax.value_and_grad(dense, argnums=(0, 1)))(ns["x"], ns["y"])
    assert ns["x"].shape[0] % 96, "the page says 96 does not divide the batch"
    chex.assert_trees_all_close((ns["value"], (ns["dx"], ns["dy"])), want, **TOL)


def test_ring_loss():
    ns = run_page("docs/losses.md")["ring"].namespace
    loss = lambda x, y: gc_jax.losses.sigmoid_loss(x, y, jnp.log(10.0), -10.0)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(ns["x"], ns["y"])
    chex.assert_trees_all_close((ns["value"], (ns["dx"], ns["dy"])), want, **TOL)


def test_your_own_distributed_loss():
    ns = run_page("docs/losses.md")["your own distributed loss"].namespace
    x, y = ns["x"], ns["y"]
    full = lambda w: jnp.mean(jnp.sum((jnp.tanh(x @ w) - jnp.tanh(y @ w)) ** 2, axis=1))
    want = jax.jit(jax.value_and_grad(full))(ns["w"])
    chex.assert_trees_all_close((ns["value"], ns["dw"]), want, **TOL)


def test_porting_the_gradcache_class():
    from flax import nnx

    towers = [nnx.Linear(8, 4, rngs=nnx.Rngs(seed)) for seed in (0, 1)]  # the block's, fresh
    params = tuple(nnx.state(t, nnx.Param) for t in towers)
    ns = run_page("docs/porting.md")["GradCache class"].namespace
    encoders = [gc_jax.nnx_encoder(t) for t in towers]
    total = lambda p: gc_jax.losses.contrastive_loss(
        encoders[0](p[0], ns["xx"], None), encoders[1](p[1], ns["yy"], None)
    )
    want_loss, want_grads = jax.jit(jax.value_and_grad(total))(params)
    chex.assert_trees_all_close(ns["loss"], want_loss, **TOL)
    chex.assert_trees_all_close(jax.tree.leaves(ns["grads"]), jax.tree.leaves(want_grads), **TOL)
    # Adam's first step moves every weight by about the learning rate: both towers moved.
    moved = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(a - b))),
        [nnx.state(t, nnx.Param) for t in (ns["enc1"], ns["enc2"])],
        list(params),
    )
    assert all(1e-4 < m < 2e-3 for m in jax.tree.leaves(moved)), moved


def test_porting_cachex():
    ns = run_page("docs/porting.md")["cachex"].namespace  # after the GradCache class block
    qq, pp, fwd_fn = ns["qq"], ns["pp"], ns["fwd_fn"]

    def plain(p, chunks):  # no caching: each chunk with its own key, concatenated
        n = chunks["x"].shape[0]
        return jnp.concatenate([fwd_fn(p, jax.tree.map(itemgetter(c), chunks)) for c in range(n)])

    total = lambda p: ns["loss_fn"](plain(p, qq), plain(p, pp))
    want = jax.jit(jax.value_and_grad(total))(ns["params"])
    chex.assert_trees_all_close((ns["loss"], ns["grads"]), want, **TOL)


def test_correctness_checks():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run("correctness.md", "check your model", "a model that mixes rows")
    # The first block passes (it raises otherwise); the second prints the error.
    assert out.getvalue().startswith(
        "gradient caching with chunk_size=8 differs from the full batch. Does the model mix rows"
    ), out.getvalue()


def test_large_embedders():
    """The recipe's blocks (an FSDP base on 8 devices), computing in float32, against
    ``jax.value_and_grad`` of the whole batch, unsharded (in bfloat16, as the page
    runs them, the blocks run too: ``tests/test_large_embedder.py`` trains so)."""
    import large_embedder as le

    ns = run("large_embedders.md", "setup")
    ns["dtype"] = jnp.float32
    run("large_embedders.md", *PAGES["large_embedders.md"][1:], namespace=ns)
    size, q, d = ns["size"], *(jax.device_get(ns[k]) for k in ("queries", "docs"))
    base, lora = le.init(size, jax.random.key(0))
    enc = lambda b, adapters, x: le.encode(size, b, adapters, x, dtype=jnp.float32)
    lora_loss = lambda p: le.loss_fn(p, enc(base, p, q), enc(base, p, d))
    chex.assert_trees_all_close(ns["loss"], jax.jit(lora_loss)(lora), rtol=1e-4)
    full_loss = lambda p: le.loss_fn(p, enc(p, None, q), enc(p, None, d))
    want = jax.jit(jax.value_and_grad(full_loss))(
        jax.tree.map(lambda w: w.astype(jnp.float32), base)
    )
    got = jax.device_get((ns["full_loss"], ns["full_grads"]))
    chex.assert_trees_all_close(got, jax.device_get(want), rtol=1e-4, atol=1e-5)


def test_recipes():
    """Each recipe's step against plain ``jax.value_and_grad`` of the whole batch (the
    EmbeddingGemma one unsharded), and the adamw update it makes."""
    ns = run("recipes.md", *PAGES["recipes.md"][:3])
    q, d = ns["sparse_queries"], ns["sparse_docs"]
    loss = functools.partial(ns["sparse_loss"], step=0)
    want_loss, want_grads = full_value_and_grad(
        loss, ns["sparse_encode"], ns["sparse_params"], q, d
    )
    # bfloat16 rows: chunks and the whole batch may round a weight apart.
    chex.assert_trees_all_close(ns["sparse_metrics"]["loss"], want_loss, rtol=1e-3)
    got = ns["sparse_state"].params
    want = adamw_step(ns["sparse_params"], want_grads, lr=3e-3)
    chex.assert_trees_all_close(got, want, atol=3e-4)
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got, ns["sparse_params"])
    assert all(m > 1e-3 for m in jax.tree.leaves(moved)), moved

    run("recipes.md", *PAGES["recipes.md"][3:5], namespace=ns)
    teacher = jax.device_get(ns["teacher"])
    loss = functools.partial(ns["gemma_loss"], teacher=teacher)
    q, d = jax.device_get((ns["inputs_q"], ns["inputs_d"]))
    want_loss, want_grads = full_value_and_grad(loss, ns["gemma_encode"], ns["gemma_params"], q, d)
    chex.assert_trees_all_close(ns["gemma_metrics"]["loss"], want_loss, **TOL)
    got = jax.device_get(ns["gemma_state"].params)
    chex.assert_trees_all_close(got, adamw_step(ns["gemma_params"], want_grads), **TOL)
    check_bank_recipe(run("recipes.md", *PAGES["recipes.md"][5:], namespace=ns))


def check_bank_recipe(ns):
    """The bank's two steps replayed over the whole batch: the first step's gradient with an
    empty bank, the second step's loss with the first step's rows in it, the bank after."""
    from gc_jax.losses import contrastive_loss, init_bank, update_bank

    enc, (b1, b2) = ns["gemma_encode"], jax.device_get(ns["bank_batches"])
    loss = lambda p, q, d, bank: contrastive_loss(q, d, temperature=0.05, bank=bank)
    bank = init_bank(4, *(enc(ns["gemma_params"], v, None) for v in b1))
    _, grads = full_value_and_grad(functools.partial(loss, bank=bank), enc, ns["gemma_params"], *b1)
    params = adamw_step(ns["gemma_params"], grads)
    bank = update_bank(bank, *(enc(ns["gemma_params"], v, None) for v in b1))
    want_loss, _ = full_value_and_grad(functools.partial(loss, bank=bank), enc, params, *b2)
    chex.assert_trees_all_close(ns["bank_metrics"]["loss"], want_loss, **TOL)
    bank = update_bank(bank, *(enc(params, v, None) for v in b2))
    chex.assert_trees_all_close(jax.device_get(ns["bank_state"].bank), bank, **TOL)
