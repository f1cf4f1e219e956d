"""Sphinx configuration: the guide (Markdown, MyST) and the API reference (autodoc).

Build from the repository root, where ``python -m`` imports this checkout's gc_jax::

    python -m sphinx -W --keep-going -b html docs /tmp/gc_jax_docs

``tests/test_sphinx.py`` runs that build with warnings as errors.
"""

import gc_jax

project = "gc_jax"
author = "the gc_jax authors"
copyright = "the gc_jax authors"
release = version = gc_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "reference"]  # docs/reference: the API as Markdown, for the forge
html_theme = "furo"
html_title = "gc_jax"

myst_heading_anchors = 4  # [text](page.md#a-heading) links, as on GitHub

autodoc_member_order = "bysource"
autodoc_typehints = "description"  # types next to each documented argument
autodoc_typehints_description_target = "documented"
napoleon_google_docstring = True
napoleon_numpy_docstring = False


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """NamedTuple fields are documented by the class's ``Attributes:`` section."""
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


# BENCHMARKS.md and benchmarks/README.md are included whole (docs/benchmarks.md,
# docs/benchmark_scripts.md), and the benchmark pages (docs/benchmarks/) link the
# index at the repository root: their links to each other become links between pages.
# CHANGELOG.md (docs/changelog.md) links pages under docs/ from the repository root.
_LINKS = {
    "BENCHMARKS.md": {
        "](benchmarks/README.md": "](benchmark_scripts.md",
        "](docs/benchmarks/": "](benchmarks/",
    },
    "benchmarks/README.md": {
        "](../BENCHMARKS.md": "](benchmarks.md",
        "](../docs/benchmarks/": "](benchmarks/",
    },
    "benchmark pages": {"](../../BENCHMARKS.md": "](../benchmarks.md"},
    "CHANGELOG.md": {"](docs/": "]("},
}


def _relink(app, relative_path, parent_docname, content):
    name = relative_path.as_posix().removeprefix("../")
    for old, new in _LINKS.get(name, {}).items():
        content[0] = content[0].replace(old, new)


def _relink_pages(app, docname, content):
    if docname.startswith("benchmarks/"):
        for old, new in _LINKS["benchmark pages"].items():
            content[0] = content[0].replace(old, new)


def setup(app):
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("include-read", _relink)
    app.connect("source-read", _relink_pages)
