"""docs/models.md, run top to bottom in one namespace as a reader pastes it: every model's
block gives an encoder that works with and without a key, and the step trains."""

import os

import jax
import pytest
from doc_pages import blocks, run_page

PAGE = "docs/models.md"


@pytest.fixture(scope="module")
def page() -> dict:
    os.environ.setdefault("KERAS_BACKEND", "jax")  # before the page imports keras
    for module in ("keras", "keras_hub", "equinox"):
        pytest.importorskip(module)
    return run_page(PAGE)


@pytest.mark.parametrize("name", ["nnx", "linen", "keras", "equinox", "by hand"])
def test_model_block_gives_an_encoder(page, name):
    ns, own = page[name].namespace, page[name].defined
    encode, params, batch = ns["encode"], ns["params"], ns["batch"]
    assert {"encode", "params", "batch"} <= set(own), "each model's block defines its own"
    with_key = encode(params, batch, jax.random.key(0))
    without = own.get("eval_encode", encode)(params, batch, None)  # this block's eval encoder
    assert with_key.shape == without.shape and with_key.shape[0] == 4
    assert not jax.numpy.allclose(with_key, without), "dropout must be on with a key"


def test_the_step_trains_the_last_encoder(page):
    """The step comes last, and trains the encoder defined just before it (by hand)."""
    assert list(page)[-2:] == ["by hand", "the step"]
    ns = page["the step"].namespace
    assert ns["encode"] is page["by hand"].namespace["encode"]
    assert bool(ns["metrics"]["is_finite"])


def test_nnx_without_a_key_names_rng(page):
    ns = page["nnx"].namespace
    with pytest.raises(TypeError, match=r"dropout in training mode.*rng="):
        ns["encode"](ns["params"], ns["batch"], None)


def test_keras_write_back_and_save(page, tmp_path, monkeypatch):
    ns = page["keras"].namespace
    monkeypatch.chdir(tmp_path)
    ns["params"] = jax.tree.map(lambda p: p + 1.0, ns["params"])
    exec(blocks(PAGE)["after training: write back and save"], ns)  # with other params
    model = ns["model"]
    assert (tmp_path / "tower.weights.h5").exists()
    out = model(ns["batch"], training=False)["pooled_output"]
    assert jax.numpy.allclose(out, ns["encode"](ns["params"], ns["batch"], None))
