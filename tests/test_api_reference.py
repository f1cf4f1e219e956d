"""docs/reference/ is the API reference as Markdown, generated from the docstrings, and current.

``docs/api/generate.py`` writes one page per public module (``gc_jax`` and every module its
``__all__`` names, recursively) with the signature and docstring of every name of the
module's ``__all__``, for a reader without the Sphinx site. This test fails while a page
differs from what the script writes now: after changing a public docstring or signature,
regenerate them from the repository root with ``python docs/api/generate.py``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import gc_jax

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "reference"
REGENERATE = "regenerate them: python docs/api/generate.py"


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "docs" / "api" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def written(generate) -> dict[str, str]:
    return generate.pages(gc_jax)


def test_the_pages_are_current(written):
    on_disk = {path.name: path.read_text() for path in PAGES.glob("*.md")}
    assert sorted(on_disk) == sorted(written), f"pages added or gone: {REGENERATE}"
    stale = [name for name, text in written.items() if on_disk[name] != text]
    assert not stale, f"{stale} differ from the docstrings: {REGENERATE}"


def test_every_public_module_and_name_has_its_entry(generate, written):
    modules = generate.public_modules(gc_jax)
    names = {m.__name__ for m in modules}
    assert {"gc_jax", "gc_jax.losses", "gc_jax.testing"} <= names
    assert any(name.startswith("gc_jax.compat") for name in names)
    for module in modules:
        text = written[f"{module.__name__}.md"]
        headings = set(re.findall(r"^## `(\w+)`$", text, flags=re.M))
        assert set(module.__all__) <= headings, module.__name__
    index = written["README.md"]
    assert all(f"]({name}.md)" in index for name in names)


@pytest.mark.parametrize(
    ("rst", "markdown"),
    [
        ("``x`` and :func:`gc_jax.make_train_step`", "`x` and `gc_jax.make_train_step`"),
        (":class:`~gc_jax.TokenBudget`", "`gc_jax.TokenBudget`"),
        ("a ``literal\nover two lines``", "a `literal\nover two lines`"),
    ],
)
def test_inline_markup_becomes_markdown(generate, rst, markdown):
    assert generate.inline(rst) == markdown


def test_sections_doctests_and_arguments(generate):
    def f(a, *, b=2):
        """Does f.

        Args:
          a: the first
            argument.
          b: the second.

        Examples:
          >>> 1 + 1
          2
        """

    assert generate.docstring(f) == [
        "Does f.",
        "",
        "**Args:**",
        "",
        "- `a`: the first argument.",
        "- `b`: the second.",
        "",
        "**Examples:**",
        "",
        "```pycon",
        ">>> 1 + 1",
        "2",
        "```",
    ]
    assert generate.signature("f", f) == "f(a, *, b=2)"
