"""Rules for gc_jax's own modules: the shape of the house, checked on every run.

1. **No import cycle.** Modules import each other at module level along a DAG (a
   function-level import is not counted: it runs when called, not at import).
2. **No module-level mutable state.** No module binds a list, dict or set (literal,
   comprehension or constructor call) at its top level (``__all__`` aside): state that
   outlives a call goes through arguments, or a ``contextvars.ContextVar`` where it
   must be implicit (``gc_jax._layout.batch_layout``); a constant table is a
   ``types.MappingProxyType``.
3. **One concept per module, readable in one sitting.** A line cap cuts modules by
   length, not by idea; what is checked instead:

   a. every module opens with a docstring whose first line is one sentence that names
      its concept (a PEP 257 summary line: it ends with a period, holds no second
      sentence, and a blank line or the end follows). Whether the module keeps to
      that concept is for review; the test sees that it is stated;
   b. no function or method has a body (after its docstring) longer than
      :data:`MAX_BODY` lines, about a screen: a function read at once. A nested
      function counts in its own right and in the function around it;
   c. no module is longer than :data:`MAX_MODULE`: a backstop, well above a module of
      one concept.
4. **No model adapter imports another** (Flax, Keras, Equinox): what they share is in
   ``gc_jax._model_calls``.
5. **One kind test.** Only the plan factory (``gc_jax._chunks.plan``) asks whether a chunk
   plan or ``chunk_size`` is of a kind (``isinstance`` on ``ChunkPlan``,
   ``TokenPlan``, ``PackPlan``, ``TokenBudget`` or ``TokenPacking``): everything else
   calls the plan protocol.
6. **One definition of a constant.** No two modules bind a top-level name to the same
   string (``MASK = "attention_mask"`` lives in ``gc_jax._chunks.token_rows``; the
   others import it).
7. **One name, one module.** No two modules (or packages) of gc_jax share a name, a
   leading ``_`` aside (``gc_jax._plan`` beside ``gc_jax.losses._engine.plan`` once
   meant two things), but for a package and its main module (``_engine.engine``). The
   0.1 paths kept as deprecated aliases (``gc_jax._deprecated.MODULES``) are the other
   exception, until 0.3.0 removes them.
8. **The benchmarks and examples use the public API**: none imports a ``_``-prefixed
   module or name of gc_jax, so what they measure is what users can call.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path
from types import MappingProxyType

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gc_jax"
MAX_BODY = 60
MAX_MODULE = 600
LONG_FOR_NOW = MappingProxyType(
    {
        # Functions over MAX_BODY, and the most lines each may keep. Empty: an entry
        # added here must shrink; one that grows, or is no longer over the bound, fails.
    }
)
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
    assert {"gc_jax", "gc_jax._chunks.plan", "gc_jax.losses", "gc_jax.losses._common"} <= set(edges)
    assert "gc_jax._layout" in edges["gc_jax._chunks.plan"]
    assert "gc_jax.losses._common" in edges["gc_jax.losses._contrastive"]


def test_cycles_are_found():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    found = cycle(graph())
    assert found is None, f"import cycle: {' -> '.join(found)}"


ADAPTERS = ("gc_jax._flax", "gc_jax._keras", "gc_jax._equinox")


def test_no_model_adapter_imports_another():
    """What the adapters share lives in ``gc_jax._model_calls``: Keras and Equinox code
    never depends on Flax's adapter."""
    edges = graph()
    crossing = {a: sorted(edges[a] & set(ADAPTERS)) for a in ADAPTERS if edges[a] & set(ADAPTERS)}
    assert not crossing, f"model adapters import each other: {crossing}"


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


def summary_problem(source: str) -> str | None:
    """What is wrong with ``source``'s module docstring as a one-sentence summary, or None."""
    doc = ast.get_docstring(ast.parse(source))
    if not doc:
        return "no module docstring"
    first, *rest = doc.splitlines()
    if not first.endswith(".") or re.search(r"[.!?] [A-Z]", first):
        return f"its first line is not one sentence: {first!r}"
    if rest and rest[0].strip():
        return f"its first line runs on into a second: {first!r}"
    return None


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ('"""Chunks of rows, read and written in place.\n\nMore."""\n', None),
        ('"""Chunks of rows."""\n', None),
        ("import jax\n", "no module docstring"),
        ('"""Chunks of rows"""\n', "not one sentence"),
        ('"""Chunks of rows. Also token budgets."""\n', "not one sentence"),
        ('"""Chunks of rows.\nRead and written in place."""\n', "runs on"),
    ],
)
def test_summary_problems_are_found(source, problem):
    found = summary_problem(source)
    assert found is None if problem is None else problem in found


def test_every_module_states_its_one_concept():
    found = {n: m for n, p in modules().items() if (m := summary_problem(p.read_text()))}
    assert not found, f"module docstrings without a one-sentence summary line: {found}"


def long_functions(source: str, limit: int, module: str = "m") -> dict[str, int]:
    """``{module.qualified.name: lines}`` of the functions and methods of ``source``
    whose body, after its docstring, is longer than ``limit`` lines."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            scope = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            name = f"{prefix}.{child.name}" if scope else prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                body = child.body[1:] if ast.get_docstring(child) is not None else child.body
                lines = body[-1].end_lineno - body[0].lineno + 1 if body else 0
                if lines > limit:
                    found[name] = lines
            visit(child, name)

    visit(ast.parse(source), module)
    return found


LONG_DOC = 'def f():\n    """Doc.\n\n    More doc.\n    """\n    return 1\n'
NESTED = """\
class C:
    def f(self):
        def g():
            a = 1
            return a

        return g
"""


def test_long_functions_are_found():
    assert long_functions(LONG_DOC, 1) == {}  # the docstring is not counted
    assert long_functions(NESTED, 4) == {"m.C.f": 5}
    assert long_functions(NESTED, 1) == {"m.C.f": 5, "m.C.f.g": 2}


def test_no_function_is_longer_than_a_screen():
    found = {}
    for name, path in modules().items():
        found |= long_functions(path.read_text(), MAX_BODY, name)
    new = {n: k for n, k in found.items() if k > LONG_FOR_NOW.get(n, MAX_BODY)}
    assert not new, f"function bodies over {MAX_BODY} lines: split them by step: {new}"
    stale = sorted(set(LONG_FOR_NOW) - set(found))
    assert not stale, f"no longer over {MAX_BODY} lines: delete from LONG_FOR_NOW: {stale}"
    assert all(n.startswith("gc_jax.losses.") for n in LONG_FOR_NOW), "only losses wait here"


def test_no_module_is_beyond_one_sitting():
    lines = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    long = {n: k for n, k in lines.items() if k > MAX_MODULE}
    assert not long, f"modules over {MAX_MODULE} lines: split them by concept: {long}"


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
    assert kind_tests("isinstance(c, budget.TokenBudget)\nisinstance(p, int)\n") == [1]
    found = {
        n: lines
        for n, p in modules().items()
        if n != "gc_jax._chunks.plan" and (lines := kind_tests(p.read_text()))
    }
    assert not found, f"isinstance on a plan kind outside gc_jax._chunks.plan: {found}"


def string_constants(source: str) -> dict[str, str]:
    """``{name: value}`` of the top-level names ``source`` binds to a string literal."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                tuples = isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                names = target.elts if tuples else [target]
                values = node.value.elts if tuples else [node.value]
                for n, v in zip(names, values, strict=False):
                    if isinstance(v, ast.Constant) and isinstance(v.value, str):
                        found[ast.unparse(n)] = v.value
    return found


def test_string_constants_are_found():
    source = 'A, B = "a", "b"\nC: str = "c"\nD = ("x", "y")\n__all__ = ["A"]\n'
    assert string_constants(source) == {"A": "a", "B": "b", "C": "c"}


def test_a_constant_is_defined_once():
    where = {}
    for name, path in modules().items():
        for constant, value in string_constants(path.read_text()).items():
            where.setdefault(value, []).append(f"{name}.{constant}")
    twice = {v: w for v, w in where.items() if len(w) > 1}
    assert not twice, f"a string defined in several modules (define it once, import it): {twice}"


def shared_names(names: list[str]) -> dict[str, list[str]]:
    """``{name: modules}`` of the names (last part, a leading ``_`` aside) that more than
    one of the dotted module names ``names`` has."""
    by_name = {}
    for name in names:
        if "." in name:
            by_name.setdefault(name.rpartition(".")[2].lstrip("_"), []).append(name)
    return {n: sorted(m) for n, m in by_name.items() if len(m) > 1 and not _package_and_main(m)}


def _package_and_main(names: list[str]) -> bool:
    """A package and the one module in it named after it (``_engine`` and
    ``_engine.engine``): one concept, the package's main module."""
    if len(names) != 2:
        return False
    a, b = sorted(names, key=len)
    return b.rpartition(".")[0] == a


def test_shared_names_are_found():
    found = shared_names(["gc_jax", "gc_jax._plan", "gc_jax.losses._engine.plan", "gc_jax.x"])
    assert found == {"plan": ["gc_jax._plan", "gc_jax.losses._engine.plan"]}
    assert shared_names(["gc_jax.a._engine", "gc_jax.a._engine.engine"]) == {}
    assert shared_names(["gc_jax._engine", "gc_jax.a._engine.engine"]) != {}


def test_no_two_modules_share_a_name():
    from gc_jax import __version__, _deprecated

    aliases = set(_deprecated.MODULES)
    if aliases:  # 0.3.0 removes them, and this exception with them
        assert tuple(map(int, __version__.split(".")[:2])) < (0, 3), (
            f"gc_jax {__version__} still has the deprecated 0.1 paths {sorted(aliases)}: "
            f"{_deprecated.REMOVED_IN} removes them (their files and gc_jax._deprecated)"
        )
    found = shared_names(sorted(set(modules()) - aliases))
    assert not found, f"modules that share a name (give each concept one name): {found}"


def private_imports(source: str) -> list[str]:
    """The ``_``-prefixed gc_jax modules and names ``source`` imports, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "gc_jax"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gc_jax"):
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if any(p.startswith("_") for p in n.split("."))]
    return found


def test_private_imports_are_found():
    source = (
        "import gc_jax\nfrom gc_jax._chunks import lines\ndef f():\n    from gc_jax import _x\n"
    )
    assert private_imports(source) == ["gc_jax._chunks.lines", "gc_jax._x"]


def test_benchmarks_and_examples_use_the_public_api():
    root = PACKAGE.parent
    found = {
        str(path.relative_to(root)): names
        for folder in ("benchmarks", "examples")
        for path in sorted((root / folder).rglob("*.py"))
        if (names := private_imports(path.read_text()))
    }
    assert not found, f"benchmarks or examples importing gc_jax's private names: {found}"
