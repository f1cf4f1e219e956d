"""Rules for every file the repository tracks (``git ls-files``), not for gc_jax's code.

1. **No machine paths.** A tracked text file names no location of the machine it was
   written on. Forbidden, wherever they start a path (not inside a URL or after a
   word, so ``https://host/work/x`` and ``homework/`` pass):

   * ``/work/...``: this project's workspace (checkouts, virtual environments, notes);
   * ``/root/...`` and ``/home/<user>/...`` (also macOS ``/Users/<user>/...``): home
     folders;
   * any absolute path through ``site-packages`` or ``dist-packages``: an
     installation's files (a bare folder name, as in a list of folders to skip, is
     fine).

   Allowed: ``/tmp/...`` (the README and BENCHMARKS.md use it in commands a reader runs,
   e.g. ``--checkpoint-dir /tmp/code_search``: a scratch folder, the same on every
   machine), ``~/...``, and paths relative to the repository. Binary files (a NUL
   byte, or not UTF-8) are skipped, and so is this file, whose examples break the rule.

2. **No ``sys.path`` edits.** No tracked Python file changes the import path:
   ``sys.path.insert/append/extend/...``, assigning to ``sys.path`` or an item or
   slice of it, ``from sys import path``, or ``site.addsitedir``. Code is imported
   from the repository root (``python -m pytest``, ``python -m benchmarks.<name>``);
   a folder that must be importable goes on ``PYTHONPATH`` on the command line.
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS_FILE = "tests/test_repository.py"  # its test cases are machine paths

# Where each rule's pattern may start: not after a word character, a dot, a dash, a
# tilde or a slash (so URLs, relative paths like homework/ and ~/ are not matched).
_START = r"(?<![\w.~/-])"
MACHINE_PATH = re.compile(
    _START
    + r"(?:/work/|/root/|/home/[\w.-]+/|/Users/[\w.-]+/|"
    + r"/(?:[^\s/\"'`()<>]+/)*(?:site|dist)-packages\b)"
)

# Files that still edit sys.path, each with who must change it and how; the test fails
# when one no longer does, so that its entry is removed. None today.
KNOWN_SYS_PATH_EDITS: set[str] = set()


@cache
def tracked_files() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return tuple(name for name in out.stdout.decode().split("\0") if name)


def text_of(name: str) -> str | None:
    """The file's text, or None for a binary file (or one deleted but not yet staged)."""
    path = ROOT / name
    if not path.is_file():
        return None
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def machine_paths(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line of ``text`` that names a machine path."""
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]


def _is_sys_path(node: ast.AST) -> bool:
    """``sys.path``, or an item or slice of it."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


_LIST_EDITS = {"append", "clear", "extend", "insert", "pop", "remove", "reverse", "sort"}


def _edits_sys_path(node: ast.AST) -> bool:
    match node:
        case ast.Call(func=ast.Attribute(value=owner, attr=attr)):
            if attr == "addsitedir":
                return True  # site.addsitedir(...)
            return _is_sys_path(owner) and (attr in _LIST_EDITS or attr.startswith("__"))
        case ast.Assign(targets=targets) | ast.Delete(targets=targets):
            return any(map(_is_sys_path, targets))  # sys.path[:0] = ..., del sys.path[0]
        case ast.AugAssign(target=target) | ast.AnnAssign(target=target):
            return _is_sys_path(target)  # sys.path += ...
        case ast.ImportFrom(module="sys", names=names):
            return any(alias.name == "path" for alias in names)  # from sys import path
    return False


def sys_path_edits(source: str) -> list[int]:
    """Line numbers where Python ``source`` edits the import path."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source)) if _edits_sys_path(node)})


def test_the_checks_see_the_repository():
    names = tracked_files()
    assert {"README.md", "BENCHMARKS.md", "gc_jax/__init__.py", "benchmarks/common.py"} <= set(
        names
    )


@pytest.mark.parametrize(
    "line",
    [
        "Python venv `/work/venv`: jax 0.10.2",
        "see /work/shared/reference/tpu-compile-only.md",
        '"json": "/work/wt/i15/benchmarks/results/ring_speed.json"',
        "cd /root/project && make",
        "File /home/alice/src/gc_jax/losses.py, line 3",
        "/Users/bob/gc_jax",
        "  File /usr/lib/python3/dist-packages/jax/_src/core.py",
        "/opt/venv/lib/python3.12/site-packages/flax/nnx/module.py:12",
        "(/usr/local/lib/python3.11/site-packages)",
    ],
)
def test_machine_paths_are_found(line):
    assert machine_paths(line), line


@pytest.mark.parametrize(
    "line",
    [
        "python examples/dual_encoder.py --checkpoint-dir /tmp/code_search",
        '{"test", "tests", "idle_test", "site-packages", "dist-packages"}',
        "https://example.com/work/reports and https://example.com/home/alice/x",
        "see homework/ or network/work/ or ~/work/notes",
        "PYTHONPATH=examples python -m benchmarks.paper_experiment",
        "benchmarks/results/ring_speed.json",
    ],
)
def test_other_paths_are_not_machine_paths(line):
    assert not machine_paths(line), line


def test_no_tracked_file_names_a_machine_path():
    found = {}
    for name in tracked_files():
        text = None if name == THIS_FILE else text_of(name)
        if text is not None and (lines := machine_paths(text)):
            found[name] = lines[:5]
    assert not found, f"machine-specific paths (see this test's docstring): {found}"


@pytest.mark.parametrize(
    ("source", "edits"),
    [
        ("import sys\nsys.path.insert(0, 'x')\n", [2]),
        ("import sys\nsys.path.append('x')\n", [2]),
        ("import sys\nsys.path[:0] = ['x', 'y']\n", [2]),
        ("import sys\nsys.path += ['x']\n", [2]),
        ("import sys\nsys.path = ['x']\n", [2]),
        ("import sys\ndel sys.path[0]\n", [2]),
        ("from sys import path\n", [1]),
        ("import site\nsite.addsitedir('x')\n", [2]),
        ("import sys\nprint(sys.path)\nx = list(sys.path)\ny = sys.path.index('x')\n", []),
        ('"""Mentions sys.path.insert(0, here) in a docstring."""\n', []),
        ("import os\nos.path.join('a', 'b')\n", []),
    ],
)
def test_sys_path_edits_are_found(source, edits):
    assert sys_path_edits(source) == edits


def test_no_python_file_edits_sys_path():
    found = {}
    for name in tracked_files():
        text = text_of(name) if name.endswith(".py") else None
        if text is not None and (lines := sys_path_edits(text)):
            found[name] = lines
    unexpected = {k: v for k, v in found.items() if k not in KNOWN_SYS_PATH_EDITS}
    assert not unexpected, f"sys.path edited (see this test's docstring): {unexpected}"
    fixed = KNOWN_SYS_PATH_EDITS - set(found)
    assert not fixed, f"these no longer edit sys.path: remove them from the list: {fixed}"
