"""The documentation site (docs/) builds with warnings as errors and documents the public API.

The build is the one docs/conf.py describes, ``python -m sphinx -W --keep-going -b html
docs OUT``, run from the repository root so that this checkout's gc_jax is the one
imported (autodoc reads its docstrings): a docstring that is not valid reStructuredText,
a broken link between pages or to a heading, a page in no table of contents, all fail.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gc_jax

pytestmark = pytest.mark.slow  # the docs build: out of the fast lane (docs/development.md)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", out],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, f"the Sphinx build failed:\n{build.stderr}{build.stdout}"
    assert "WARNING" not in build.stderr, build.stderr
    return out


def public_names() -> list[str]:
    """Every public function and class: ``gc_jax.__all__`` and its public modules'."""
    names = []
    modules = (gc_jax, gc_jax.losses, gc_jax.packing, gc_jax.compat.functional, gc_jax.testing,
               gc_jax.compat.cachex)  # fmt: skip
    for module in modules:
        exported = getattr(module, "__all__", None) or [
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and (inspect.isfunction(value) or inspect.isclass(value))
            and value.__module__ == module.__name__
        ]
        for name in exported:
            if not inspect.ismodule(getattr(module, name)):
                names.append(f"{module.__name__}.{name}")
    return names


def test_the_site_builds_without_warnings(site):
    assert (site / "index.html").is_file()
    assert (site / "quickstart.html").is_file()


def test_every_public_name_has_an_entry_in_the_api_reference(site):
    pages = "".join(p.read_text() for p in (site / "api").glob("*.html"))
    missing = [name for name in public_names() if f'id="{name}"' not in pages]
    assert not missing, f"add these to docs/api/: {missing}"
    assert len(public_names()) >= 25


def test_one_build_command_with_warnings_as_errors():
    """The README and docs/development.md give the same command, this test's build: warnings
    as errors, and the ``test`` extra (which brings Sphinx) is all it installs."""
    command = (
        'pip install -e ".[test]" && python -m sphinx -W --keep-going -b html docs /tmp/gc_jax_docs'
    )
    for page in (ROOT / "README.md", ROOT / "docs" / "development.md"):
        text = page.read_text()
        assert command in text, page
        assert text.count("python -m sphinx") == 1, f"{page}: one build command"
