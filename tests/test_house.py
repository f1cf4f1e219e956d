"""Rules for gc_jax's own modules: the shape of the house, checked on every run.

1. **No import cycle.** Modules import each other at module level along a DAG (a
   function-level import is not counted: it runs when called, not at import).
2. **No module-level mutable state.** No module binds a list, dict or set (literal,
   comprehension or constructor call) at its top level (``__all__`` aside): state that
   outlives a call goes through arguments, or a ``contextvars.ContextVar`` where it
   must be implicit (``gc_jax._layout.batch_layout``); a constant table is a
   ``types.MappingProxyType``.
3. **Small modules.** No module is longer than :data:`MAX_LINES`.
4. **One kind test.** Only the plan factory (``gc_jax._plan``) asks whether a chunk
   plan or ``chunk_size`` is of a kind (``isinstance`` on ``ChunkPlan``,
   ``TokenPlan``, ``PackPlan``, ``TokenBudget`` or ``TokenPacking``): everything else
   calls the plan protocol.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gc_jax"
MAX_LINES = 420
KINDS = {"ChunkPlan", "TokenPlan", "PackPlan", "TokenBudget", "TokenPacking"}


@cache
def modules() -> dict[str, Path]:
    """``gc_jax.x.y`` -> its file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported(name: str, tree: ast.Module) -> set[str]:
    """The gc_jax modules ``name``'s top-level statements import."""
    known, found = modules(), set()
    package = name if modules()[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    found.add(full)  # a submodule
                elif base in known:
                    found.add(base)  # a name defined in the module (or package)
    return found - {name}


def graph() -> dict[str, set[str]]:
    return {n: imported(n, ast.parse(p.read_text())) for n, p in modules().items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``edges`` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_rules_see_the_package():
    edges = graph()
    assert {"gc_jax", "gc_jax._plan", "gc_jax.losses", "gc_jax.losses._common"} <= set(edges)
    assert "gc_jax._layout" in edges["gc_jax._plan"]
    assert "gc_jax.losses._common" in edges["gc_jax.losses._contrastive"]


def test_cycles_are_found():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    found = cycle(graph())
    assert found is None, f"import cycle: {' -> '.join(found)}"


def mutable_globals(source: str) -> list[str]:
    """Top-level names bound to a list, dict or set in ``source``."""
    makers = {"list", "dict", "set", "defaultdict", "OrderedDict", "Counter", "deque"}
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            value = node.value
            literal = isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp |
                                 ast.DictComp | ast.SetComp)  # fmt: skip
            call = isinstance(value, ast.Call) and getattr(value.func, "id", None) in makers
            if literal or call:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [ast.unparse(t) for t in targets if ast.unparse(t) != "__all__"]
    return found


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("_CONTEXT: list[int] = []\n", ["_CONTEXT"]),
        ("CACHE = dict()\nSEEN = {1, 2}\n", ["CACHE", "SEEN"]),
        ("NAMES = ('a', 'b')\nV = contextvars.ContextVar('v', default=None)\n", []),
        ("def f():\n    x = []\n    return x\n", []),
    ],
)
def test_mutable_globals_are_found(source, found):
    assert mutable_globals(source) == found


def test_no_module_level_mutable_state():
    found = {n: g for n, p in modules().items() if (g := mutable_globals(p.read_text()))}
    assert not found, f"module-level mutable state (see this test's docstring): {found}"


def test_no_module_is_too_long():
    lines = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    long = {n: k for n, k in lines.items() if k > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: split them by idea: {long}"


def kind_tests(source: str) -> list[int]:
    """Lines of ``source`` that call ``isinstance`` on a plan kind or TokenBudget."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            names = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])}
            if names & KINDS:
                found.append(node.lineno)
    return found


def test_only_the_plan_factory_asks_a_plan_its_kind():
    assert kind_tests("isinstance(c, _token_chunks.TokenBudget)\nisinstance(p, int)\n") == [1]
    found = {
        n: lines
        for n, p in modules().items()
        if n != "gc_jax._plan" and (lines := kind_tests(p.read_text()))
    }
    assert not found, f"isinstance on a plan kind outside gc_jax._plan: {found}"
