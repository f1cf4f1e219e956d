"""The 0.1 import paths of the porting layers: aliases that warn once, until 0.3.0.

Each check runs in a fresh interpreter, where nothing has imported the old path yet.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gc_jax import _deprecated

ROOT = Path(__file__).resolve().parents[1]

# How 0.1 code reaches each old path, and the object it must get (the new home's).
FORMS = {
    "gc_jax.cachex": ("from gc_jax import cachex as got", "gc_jax.compat.cachex"),
    "gc_jax.cachex.functional": (
        "from gc_jax.cachex.functional import grad_cached as got",
        "gc_jax.compat.cachex.grad_cached",
    ),
    "gc_jax.cachex.training": (
        "import gc_jax.cachex.training; got = gc_jax.cachex.training.cache_train_step",
        "gc_jax.compat.cachex.cache_train_step",
    ),
    "gc_jax.cachex.tree_utils": (
        "from gc_jax.cachex.tree_utils import tree_chunk as got",
        "gc_jax.compat.cachex.tree_chunk",
    ),
    "gc_jax.functional": (
        "from gc_jax.functional import cached as got",
        "gc_jax.compat.functional.cached",
    ),
    "gc_jax.GradCache": ("import gc_jax; got = gc_jax.GradCache", "gc_jax.compat.GradCache"),
}

PROBE = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    {form}
    got_again = got  # noqa
    {form}
import gc_jax, gc_jax.compat
assert got is {new}, (got, {new})
print(len(caught))
for w in caught:
    print(w.category.__name__, w.message)
"""


def run(form: str, new: str) -> list[str]:
    code = PROBE.format(form=form, new=new)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_every_alias_is_tested():
    assert set(FORMS) == set(_deprecated.MODULES) | {f"gc_jax.{a}" for a in _deprecated.ATTRIBUTES}


@pytest.mark.parametrize("old", sorted(FORMS))
def test_an_old_path_gives_the_new_object_and_warns_once(old):
    form, new = FORMS[old]
    count, *lines = run(form, new)
    target = _deprecated.MODULES.get(old) or ".".join(_deprecated.ATTRIBUTES[old[7:]])
    own = [line for line in lines if line.startswith(f"DeprecationWarning {old} moved")]
    assert len(own) == 1, f"{old}: want one warning, got {lines}"
    parent, _, name = target.rpartition(".")
    assert f"moved to {target} in gc_jax 0.2.0" in own[0], own[0]
    assert f"Write `from {parent} import {name}` instead" in own[0], own[0]
    assert "removed in 0.3.0" in own[0]
    assert all(line.startswith("DeprecationWarning") for line in lines), lines
    assert int(count) == len(lines)


def test_the_new_paths_do_not_warn():
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c",
         "import gc_jax; from gc_jax.compat import GradCache, cachex, functional; "
         "from gc_jax.compat.cachex import training, tree_utils, transforms"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_an_unknown_attribute_still_raises():
    import gc_jax

    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        gc_jax.nothing_here  # noqa: B018
