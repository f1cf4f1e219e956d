"""The docs' python blocks, run as a reader runs them: a page top to bottom, in one namespace,
printing what the page says they print.

Every python block of a page starts with a comment naming it (``# quick start``).
:func:`run_page` runs all of a page's blocks in order in one namespace, in a scratch
directory (a block may write files), once per test process, and returns what each
block left: the namespace after it, the names it bound, what it printed. The tests
then check what the blocks computed, block by block, without running a page twice;
:func:`run_block` runs one block in a namespace of the test's.

**What it prints.** A block says what it prints in comments ``# prints: TEXT``, one
line of output each, in order (``...`` stands for any text, as in doctests with
ELLIPSIS). What the block prints must be exactly that: a block that prints and says
nothing, or says and prints something else, fails with a diff (:func:`check_output`).

**From the repository root.** pytest puts ``examples/`` on the path for the tests; a
reader at the root has only what is installed and the root's own folders, and
``examples/`` where the page says ``PYTHONPATH=examples``: each module a block imports
must be found so (:func:`unimportable_from_the_root`).
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import functools
import importlib.machinery
import io
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
_UNSET = object()
_PRINTS = re.compile(r"#\s*prints:\s?(.*)$")


def blocks(page: str) -> dict[str, str]:
    """``page``'s python blocks (``page`` relative to the repository root), by name."""
    text = (ROOT / page).read_text()
    found = re.findall(r"```python\n# ([^\n]*)\n(.*?)```", text, flags=re.S)
    assert len(found) == text.count("```python"), f"{page}: a python block has no # name"
    assert len({n for n, _ in found}) == len(found), f"{page}: two python blocks share a name"
    return dict(found)


def expected_output(code: str) -> str:
    """What ``code`` says it prints: its ``# prints: TEXT`` comments, a line each, in order."""
    said = (_PRINTS.search(line) for line in code.splitlines())
    return "\n".join(match.group(1).rstrip() for match in said if match)


def check_output(where: str, code: str, printed: str) -> None:
    """Fails, with a diff, unless ``printed`` is what ``code``'s ``# prints:`` comments
    say (``...`` matches any text; trailing spaces and newlines are ignored)."""
    want = expected_output(code)
    got = "\n".join(line.rstrip() for line in printed.rstrip("\n").splitlines())
    pattern = ".*?".join(re.escape(part) for part in want.split("..."))
    if re.fullmatch(pattern, got, flags=re.S):
        return
    diff = difflib.unified_diff(
        want.splitlines(), got.splitlines(), "the page says (# prints:)", "printed", lineterm=""
    )
    raise AssertionError(f"{where} prints what the page does not say:\n" + "\n".join(diff))


def run_block(page: str, name: str, namespace: dict[str, Any]) -> str:
    """Runs block ``name`` of ``page`` in ``namespace``, checks what it prints against the
    page (:func:`check_output`), and returns that output (also written to ``sys.stdout``,
    for ``capsys``)."""
    code, printed = blocks(page)[name], io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"{page}, block '{name}'", "exec"), namespace)
    sys.stdout.write(printed.getvalue())
    check_output(f"{page}, block '{name}'", code, printed.getvalue())
    return printed.getvalue()


def imported_modules(code: str) -> set[str]:
    """The top-level modules ``code`` imports (``import a.b`` and ``from a.b import c``: ``a``)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names


def unimportable_from_the_root(page: str) -> set[str]:
    """The modules ``page``'s blocks import that a reader at the repository root cannot:
    found neither among the installed ones (nor the root's own folders), nor in
    ``examples/`` where the page says ``PYTHONPATH=examples``. pytest's ``pythonpath``
    (which adds ``examples/``) does not count."""
    text = (ROOT / page).read_text()
    installed = [p for p in sys.path if p and Path(p).resolve() not in (ROOT, EXAMPLES)]
    path = [str(ROOT), *([str(EXAMPLES)] if "PYTHONPATH=examples" in text else []), *installed]

    def found(name: str) -> bool:
        finders = (importlib.machinery.BuiltinImporter, importlib.machinery.FrozenImporter)
        return any(f.find_spec(name) for f in finders) or bool(
            importlib.machinery.PathFinder.find_spec(name, path)
        )

    modules = set().union(*map(imported_modules, blocks(page).values()))
    return {name for name in modules if not found(name)}


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
        for name in blocks(page):
            before = dict(namespace)
            printed = run_block(page, name, namespace)
            defined = {k: v for k, v in namespace.items() if before.get(k, _UNSET) is not v}
            ran[name] = Ran(dict(namespace), defined, printed)
    return ran


def run_page(page: str) -> dict[str, Ran]:
    """Every block of ``page`` run top to bottom in one namespace: what each left, by
    block name (copies: a test may change them)."""
    return {
        name: Ran(dict(r.namespace), dict(r.defined), r.printed)
        for name, r in _run_page(page).items()
    }
