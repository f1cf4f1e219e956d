"""Doctest collection over the package: the optional adapters' doctests
(``gc_jax/_keras.py``, ``gc_jax/_equinox.py``) are skipped, with the reason, where their
library is not installed, and the deprecated 0.1 import paths
(``gc_jax._deprecated.MODULES``) are not collected: importing one warns by design
(``tests/test_deprecated.py`` checks them)."""

import importlib.util
from pathlib import Path

import pytest

OPTIONAL = {"_keras.py": "keras", "_equinox.py": "equinox"}
ROOT = Path(__file__).resolve().parent


def _deprecated_files() -> set[Path]:
    from gc_jax import _deprecated

    found = set()
    for name in _deprecated.MODULES:
        path = ROOT.joinpath(*name.split("."))
        found.add(path / "__init__.py" if path.is_dir() else path.with_suffix(".py"))
    return found


def pytest_ignore_collect(collection_path):
    if collection_path.suffix == ".py" and collection_path in _deprecated_files():
        return True
    return None


def pytest_collection_modifyitems(items):
    for item in items:
        module = OPTIONAL.get(item.path.name)
        if module and importlib.util.find_spec(module) is None:
            item.add_marker(pytest.mark.skip(reason=f"{module} is not installed"))
