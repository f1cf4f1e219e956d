"""docs/models.md: every model's block runs, and its encoder works with and without a key."""

import os
import re
from pathlib import Path

import jax
import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "models.md"
NEEDS = {"keras": ("keras", "keras_hub"), "equinox": ("equinox",)}


def blocks() -> dict[str, str]:
    """The page's python blocks by their first line, a comment (``# nnx``)."""
    found = re.findall(r"```python\n# ([^\n]*)\n(.*?)```", PAGE.read_text(), flags=re.S)
    return dict(found)


def run_block(name: str) -> dict:
    for module in NEEDS.get(name, ()):
        if module == "keras":
            os.environ.setdefault("KERAS_BACKEND", "jax")
        pytest.importorskip(module)
    namespace: dict = {}
    exec(blocks()[name], namespace)
    return namespace


@pytest.mark.parametrize("name", ["nnx", "linen", "keras", "equinox", "by hand"])
def test_model_block_gives_an_encoder(name):
    ns = run_block(name)
    encode, params, batch = ns["encode"], ns["params"], ns["batch"]
    with_key = encode(params, batch, jax.random.key(0))
    without = ns.get("eval_encode", encode)(params, batch, None)
    assert with_key.shape == without.shape and with_key.shape[0] == 4
    assert not jax.numpy.allclose(with_key, without), "dropout must be on with a key"


def test_the_step_trains_a_hand_written_encoder():
    ns = run_block("by hand")
    exec(blocks()["the step"], ns)
    assert bool(ns["metrics"]["is_finite"])


def test_keras_write_back_and_save(tmp_path, monkeypatch):
    ns = run_block("keras")
    monkeypatch.chdir(tmp_path)
    ns["params"] = jax.tree.map(lambda p: p + 1.0, ns["params"])
    exec(blocks()["after training: write back and save"], ns)
    model = ns["model"]
    assert (tmp_path / "tower.weights.h5").exists()
    out = model(ns["batch"], training=False)["pooled_output"]
    assert jax.numpy.allclose(out, ns["encode"](ns["params"], ns["batch"], None))
