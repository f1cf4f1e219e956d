"""Import paths of 0.1 kept as aliases of their new homes until 0.3.0.

0.2.0 moved the porting layers under :mod:`gc_jax.compat`. Each old module is a file
that calls :func:`moved` and re-exports the new one; ``gc_jax.GradCache`` is served
by the package's ``__getattr__`` through :func:`attribute`. Each warns once per
process, with a ``DeprecationWarning`` that names the path to write instead.
"""

from __future__ import annotations

import importlib
import warnings
from types import MappingProxyType
from typing import Any

REMOVED_IN = "0.3.0"

MODULES = MappingProxyType(
    {
        # old module -> its new home; each old module is a file that calls `moved`
        "gc_jax.cachex": "gc_jax.compat.cachex",
        "gc_jax.cachex.functional": "gc_jax.compat.cachex.transforms",
        "gc_jax.cachex.training": "gc_jax.compat.cachex.training",
        "gc_jax.cachex.tree_utils": "gc_jax.compat.cachex.tree_utils",
        "gc_jax.functional": "gc_jax.compat.functional",
    }
)

ATTRIBUTES = MappingProxyType(
    {
        # gc_jax.<name> -> (module, attribute) of its new home
        "GradCache": ("gc_jax.compat", "GradCache"),
        "cachex": ("gc_jax.compat", "cachex"),
        "functional": ("gc_jax.compat", "functional"),
    }
)


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new} in gc_jax 0.2.0; the old path is removed in {REMOVED_IN}. "
        f"Write `{_spelling(new)}` instead.",
        DeprecationWarning,
        stacklevel=4,
    )


def _spelling(new: str) -> str:
    parent, _, name = new.rpartition(".")
    return f"from {parent} import {name}"


def moved(old: str) -> Any:
    """Warns that module ``old`` moved (:data:`MODULES`) and returns its new home.

    Called at the top of an old module's file, which runs once per process (the
    import system caches modules), so the warning is given once.
    """
    _warn(old, MODULES[old])
    return importlib.import_module(MODULES[old])


def attribute(name: str) -> Any:
    """``gc_jax.<name>`` for a name that moved; raises ``AttributeError`` otherwise."""
    if name not in ATTRIBUTES:
        raise AttributeError(f"module 'gc_jax' has no attribute {name!r}")
    module, attr = ATTRIBUTES[name]
    _warn(f"gc_jax.{name}", f"{module}.{attr}")
    return getattr(importlib.import_module(module), attr)
