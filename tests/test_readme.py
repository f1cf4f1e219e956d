"""The README's quick start runs as written and gives the full-batch gradient.

The guide's blocks (bring your own step, scaling out, ...) are run by tests/test_guide.py.
"""

import contextlib
import io
import re
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
from doc_pages import check_output

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_quick_start_runs_and_matches_full_batch():
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the quick start: encode, loss_fn, grad_fn, ...
        exec(python_blocks()[0], namespace)
    check_output("README.md, quick start", python_blocks()[0], printed.getvalue())
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


def test_quick_start_is_the_guides():
    """The guide's quick start (docs/quickstart.md, tests/test_guide.py) is the README's."""
    guide = (README.parent / "docs" / "quickstart.md").read_text()
    (block,) = re.findall(r"```python\n# quick start\n(.*?)```", guide, flags=re.S)
    assert block == python_blocks()[0]


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_to_benchmark_sections_land_on_their_headings():
    """The README's figures link sections of the benchmark pages (BENCHMARKS.md and
    docs/benchmarks/): every anchor is a heading of the page it names."""
    linked = re.findall(r"\((BENCHMARKS\.md|docs/benchmarks/\w+\.md)#([^)]+)\)", README.read_text())
    assert len(linked) >= 5
    for page, anchor in linked:
        text = (README.parent / page).read_text()
        headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}
        assert anchor in headings, (page, anchor)


def test_two_set_up_commands():
    """The README's set-up is two commands: run the example, run the tests."""
    section = README.read_text().split("## Two commands\n")[1].split("\n## ")[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    commands = [line for line in block.splitlines() if line.strip() and line[0] != "#"]
    assert len(commands) == 2 and all(c.startswith("pip install -e ") for c in commands)
