"""Doctests of the optional adapters (``gc_jax/_keras.py``, ``gc_jax/_equinox.py``) are
skipped, with the reason, where their library is not installed."""

import importlib.util

import pytest

OPTIONAL = {"_keras.py": "keras", "_equinox.py": "equinox"}


def pytest_collection_modifyitems(items):
    for item in items:
        module = OPTIONAL.get(item.path.name)
        if module and importlib.util.find_spec(module) is None:
            item.add_marker(pytest.mark.skip(reason=f"{module} is not installed"))
