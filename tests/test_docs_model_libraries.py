"""docs/model_libraries.md: its code is examples/library_embedders.py, block for block.

The recipes need MaxText, gemma and Penzai (2.8-3.5 GB installs), so CI does not run
them: ``benchmarks/model_libraries.py`` does (docs/benchmarks/model_libraries.md), with
the functions of ``examples/library_embedders.py``. This test keeps the page and that
module the same, and checks that the module imports without the libraries.
"""

import importlib.util
import re
from pathlib import Path

from doc_pages import blocks

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/model_libraries.md"
MODULE = ROOT / "examples" / "library_embedders.py"
NAMES = ["gemma", "gemma: the step", "maxtext", "maxtext: the step", "penzai", "penzai: the step"]


def segments() -> dict[str, str]:
    """The module's code between ``# [name]`` and ``# [/name]``, by name."""
    found = re.findall(r"^# \[([^\]/][^\]]*)\]\n(.*?)\n# \[/\1\]$", MODULE.read_text(), re.M | re.S)
    return {name: code.strip("\n") for name, code in found}


def test_every_block_is_the_modules_code():
    page = blocks(PAGE)
    assert list(page) == NAMES
    module = segments()
    assert sorted(module) == sorted(NAMES)
    for name, code in page.items():
        assert code.strip("\n") == module[name], f"{PAGE} block '{name}' is not the module's"


def test_the_module_imports_without_the_libraries():
    spec = importlib.util.spec_from_file_location("library_embedders", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the libraries are imported inside the functions
    assert callable(module.maxtext_embedder) and callable(module.penzai_step)
