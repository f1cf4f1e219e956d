"""The docs' python blocks, run as a reader runs them: a page top to bottom, in one namespace.

Every python block of a page starts with a comment naming it (``# quick start``).
:func:`run_page` runs all of a page's blocks in order in one namespace, in a scratch
directory (a block may write files), once per test process, and returns what each
block left: the namespace after it, the names it bound, what it printed. The tests
then check what the blocks computed, block by block, without running a page twice.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
_UNSET = object()


def blocks(page: str) -> dict[str, str]:
    """``page``'s python blocks (``page`` relative to the repository root), by name."""
    text = (ROOT / page).read_text()
    found = re.findall(r"```python\n# ([^\n]*)\n(.*?)```", text, flags=re.S)
    assert len(found) == text.count("```python"), f"{page}: a python block has no # name"
    assert len({n for n, _ in found}) == len(found), f"{page}: two python blocks share a name"
    return dict(found)


class Ran(NamedTuple):
    """What one block left: the page's namespace after it (a copy), the names the block
    bound (new, or bound to another object), and what it printed."""

    namespace: dict[str, Any]
    defined: dict[str, Any]
    printed: str


@functools.cache
def _run_page(page: str) -> dict[str, Ran]:
    namespace: dict[str, Any] = {}
    ran = {}
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        for name, code in blocks(page).items():
            before, printed = dict(namespace), io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(code, f"{page}, block '{name}'", "exec"), namespace)
            defined = {k: v for k, v in namespace.items() if before.get(k, _UNSET) is not v}
            ran[name] = Ran(dict(namespace), defined, printed.getvalue())
    return ran


def run_page(page: str) -> dict[str, Ran]:
    """Every block of ``page`` run top to bottom in one namespace: what each left, by
    block name (copies: a test may change them)."""
    return {
        name: Ran(dict(r.namespace), dict(r.defined), r.printed)
        for name, r in _run_page(page).items()
    }
