"""The public API, name by name and signature by signature, against a checked-in snapshot.

Every public module's ``__all__`` (every module of the package whose dotted path has no
``_``-prefixed part: ``gc_jax``, ``gc_jax.losses``, ``gc_jax.compat.cachex.training`` ...;
not the deprecated 0.1 paths of ``gc_jax._deprecated.MODULES``), each name's kind and call
signature (``inspect.signature``), and a public class's public methods and properties,
one per line in ``tests/fixtures/api_snapshot.txt``. A change to the public API (a name
added, renamed or removed, an argument added, renamed, reordered or given another
default) fails here until the snapshot is regenerated on purpose, from the repository
root (where ``python -m`` imports this checkout's gc_jax)::

    python -m tests.test_api

and the diff of ``tests/fixtures/api_snapshot.txt`` reviewed with the change (and a
CHANGELOG entry where users see it).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import tomllib
from pathlib import Path

import gc_jax
from gc_jax import _deprecated

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "fixtures" / "api_snapshot.txt"


def public_modules() -> tuple[str, ...]:
    """Every public module of gc_jax, from the package's files (none is imported)."""
    found = set()
    for path in Path(gc_jax.__file__).parent.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not any(p.startswith("_") for p in name.split(".")):
            found.add(name)
    return tuple(sorted(found - set(_deprecated.MODULES)))


MODULES = public_modules()
UPDATE = "python -m tests.test_api"


def signature(obj: object) -> str:
    """``obj``'s call signature, object addresses dropped (``(...)`` where it has none)."""
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    text = re.sub(r"ForwardRef\(('[^']*')\)", r"\1", text)  # a NamedTuple's, by Python version
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def members(qualified: str, cls: type) -> list[str]:
    """A public class's own public methods, properties and class attributes (its fields,
    a NamedTuple's or a dataclass's, are in the class's signature)."""
    fields = {*getattr(cls, "_fields", ()), *getattr(cls, "__dataclass_fields__", ())}
    found = []
    for name, value in sorted(vars(cls).items()):
        if name.startswith("_") or name in fields:
            continue
        if isinstance(value, property):
            found.append(f"{qualified}.{name}: property")
        elif isinstance(value, classmethod | staticmethod):
            found.append(f"{qualified}.{name}{signature(getattr(cls, name))}")
        elif callable(value):
            found.append(f"{qualified}.{name}{signature(value)}")
        else:
            found.append(f"{qualified}.{name}: {type(value).__name__}")
    return found


def describe(module: str, name: str) -> list[str]:
    """The snapshot's lines for ``module.name``."""
    obj, qualified = getattr(importlib.import_module(module), name), f"{module}.{name}"
    if inspect.ismodule(obj):
        return [f"{qualified}: module {obj.__name__}"]
    if inspect.isclass(obj):
        return [f"{qualified}: class{signature(obj)}", *members(qualified, obj)]
    if callable(obj):
        return [f"{qualified}{signature(obj)}"]
    return [f"{qualified}: {type(obj).__name__}"]


def snapshot() -> str:
    """The public API as text, a line per name (sorted within each module)."""
    lines = []
    for module in MODULES:
        exported = importlib.import_module(module).__all__
        for name in sorted(exported):
            lines += describe(module, name)
    for old, new in sorted(_deprecated.MODULES.items()):
        lines.append(f"{old}: deprecated module, now {new} (removed in {_deprecated.REMOVED_IN})")
    for old, (module, name) in sorted(_deprecated.ATTRIBUTES.items()):
        lines.append(
            f"gc_jax.{old}: deprecated, now {module}.{name} (removed in {_deprecated.REMOVED_IN})"
        )
    return "\n".join(lines) + "\n"


def test_every_public_module_declares_all():
    for module in MODULES:
        found = importlib.import_module(module)
        missing = [n for n in found.__all__ if not hasattr(found, n)]
        assert not missing, f"{module}.__all__ names what it does not define: {missing}"


def test_the_version_is_the_one_pyproject_declares():
    """``gc_jax.__version__`` is what the wheel is built as (``pyproject.toml``)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert importlib.import_module("gc_jax").__version__ == declared


def test_the_public_api_matches_the_snapshot():
    want, got = SNAPSHOT.read_text(), snapshot()
    if got != want:
        diff = "".join(
            difflib.unified_diff(
                want.splitlines(keepends=True),
                got.splitlines(keepends=True),
                "tests/fixtures/api_snapshot.txt (checked in)",
                "the public API now",
            )
        )
        raise AssertionError(
            f"The public API changed:\n{diff}\nIf that is deliberate, regenerate the snapshot "
            f"from the repository root with `{UPDATE}`, review its diff, and commit it with "
            "the change (and a CHANGELOG entry)."
        )


if __name__ == "__main__":  # regenerate the snapshot: python -m tests.test_api
    SNAPSHOT.write_text(snapshot())
    print(f"wrote {SNAPSHOT.relative_to(ROOT)} ({len(snapshot().splitlines())} lines)")
