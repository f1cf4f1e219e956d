"""Docstring-to-code retrieval pairs mined from Python source that ships with packages.

Every function or method with a docstring in the standard library and in the installed
packages of :data:`DEFAULT_PACKAGES` (numpy, scipy, jax, flax, matplotlib, ...) gives
one pair:

* **query**: the docstring's summary (its first paragraph, on one line);
* **document**: the function's source with the docstring statement removed.

The sources are located the way ``inspect.getsourcefile`` does (``importlib`` specs,
``sysconfig``) and read with ``ast`` rather than by importing every module: importing the
whole standard library has side effects (``antigravity`` opens a browser, ``this``
prints) and is slow, while parsing the files sees every function, methods and private
helpers included, in a fixed order.

Leakage: the docstring node is cut out of the source, and a pair is dropped when its
summary still appears in the document (e.g. repeated in a comment or string) or when it
spells out the function's name. The function's name and signature stay in the document,
as in any code search task; they are fair evidence but never the query itself.

Determinism: the roots are mined in the order given (the standard library first), the
files of each in sorted order, and duplicates are resolved in that order, earlier roots
winning: a root's pairs depend only on its own files and those of the roots before it.
The held-out set is whole source *files* (every function of a file lands on the same
side, so held-out pairs come from unseen files), the standard library's first, each
chosen by a seeded hash of its name: so the held-out set depends on the standard
library alone, the same for every install of one Python version, while the training
pairs also depend on the versions of the installed packages. The same Python and
package versions give the same pairs and the same split.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
import sysconfig
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PACKAGES = (
    "stdlib",
    # gc_jax's dependencies and theirs
    "numpy",
    "scipy",
    "jax",
    "flax",
    "optax",
    "chex",
    "orbax",
    "rich",
    "etils",
    "absl",
    "treescope",
    # the `examples` extra's (tokenizers needs huggingface_hub) and theirs
    "huggingface_hub",
    "matplotlib",
    "fontTools",
    "PIL",
    "packaging",
    "pyparsing",
    "dateutil",
    "tqdm",
    "filelock",
    "fsspec",
    "click",
    "opt_einsum",
    "toolz",
    "psutil",
    "google.protobuf",
)
"""What is mined by default, in this order: ``"stdlib"`` (the standard library, first:
the held-out files come from it) and the import names of the packages with docstrings
that ``pip install -e ".[examples]"`` installs. Missing ones are skipped."""

_SKIPPED_DIRS = frozenset(
    {"test", "tests", "testing", "idle_test", "__pycache__", "site-packages", "dist-packages"}
)
# Import names that ``packages_distributions`` does not map to one distribution.
_DISTRIBUTION_OF = {"google.protobuf": "protobuf"}
# Parts of the standard library that Linux distributions ship as separate packages
# (Debian's idle, python3-tk, python3-lib2to3, python3-distutils, python3-venv): not
# mined, so that the standard library's pairs are the same with or without them.
_SPLIT_OFF_STDLIB = frozenset(
    {"idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "distutils"}
)
# The fields holding statement blocks, in the order ``ast`` lists them (try: body,
# handlers, orelse, finalbody); a ``def`` can only appear in one of them.
_BLOCK_FIELDS = ("body", "handlers", "orelse", "finalbody", "cases")
_SIGNATURE_LIKE = re.compile(r"^[\w.]+\s*\(.*\)")  # "split(sep=None) -> list" summaries


@dataclass(frozen=True)
class Limits:
    """Size filters for a pair (characters and lines)."""

    min_query_chars: int = 20
    max_query_chars: int = 200
    min_query_words: int = 4
    min_document_chars: int = 80
    max_document_chars: int = 3000
    min_document_lines: int = 3
    max_document_lines: int = 80


@dataclass(frozen=True)
class Pair:
    """One retrieval pair and where it comes from."""

    query: str
    document: str
    source: str  # "<root name>/<path inside it>", the unit of the train / held-out split
    name: str  # qualified name inside the file, e.g. "JSONDecoder.decode"
    line: int = 0  # line of the ``def`` in the source file (1-based)

    @property
    def module(self) -> str:
        """The dotted module name, e.g. ``json.decoder`` for ``stdlib/json/decoder.py``."""
        return module_name(self.source)


@dataclass(frozen=True)
class Split:
    """Training and held-out pairs."""

    train: list[Pair]
    held_out: list[Pair]


def source_roots(packages: Sequence[str] = DEFAULT_PACKAGES) -> list[tuple[str, Path]]:
    """``(name, directory)`` of each installed package; ``"stdlib"`` is the standard library.

    Packages that are not installed, or are single modules, are skipped.
    """
    roots = []
    for package in packages:
        if package == "stdlib":
            roots.append(("stdlib", Path(sysconfig.get_paths()["stdlib"])))
            continue
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        roots.append((package, Path(next(iter(spec.submodule_search_locations)))))
    return roots


def module_name(source: str) -> str:
    """The dotted module of a pair's source: ``"stdlib/json/decoder.py"`` -> ``"json.decoder"``.

    A package's ``__init__.py`` is the package: ``"numpy/__init__.py"`` -> ``"numpy"``.
    """
    root, _, path = source.partition("/")
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts if root == "stdlib" else [root, *parts])


def describe_roots(roots: Sequence[tuple[str, Path]]) -> str:
    """Names and versions of the mined roots, e.g. ``stdlib 3.11.7, numpy 2.4.6``."""

    distributions = importlib.metadata.packages_distributions()  # import name -> names

    def version(name: str) -> str:
        if name == "stdlib" or name in sys.stdlib_module_names:
            return platform.python_version()
        distribution = _DISTRIBUTION_OF.get(name) or distributions.get(name, [name])[0]
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    return ", ".join(f"{name} {version(name)}" for name, _ in roots)


def python_files(root: Path, skipped: Iterable[str] = _SKIPPED_DIRS) -> list[Path]:
    """The ``.py`` files under ``root``, sorted, without the directories named ``skipped``
    (by default test suites and nested installs)."""
    files = []
    skipped = frozenset(skipped)
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in skipped]  # not descended into
        for name in names:
            is_test = name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
            if name.endswith(".py") and not is_test:
                files.append(Path(directory, name))
    return sorted(files)


def docstring_summary(docstring: str) -> str:
    """The first paragraph of a (cleaned) docstring, whitespace collapsed to single spaces."""
    first_paragraph = re.split(r"\n\s*\n", docstring.strip(), maxsplit=1)[0]
    return " ".join(first_paragraph.split())


def _normalized(text: str) -> str:
    return " ".join(text.lower().split())


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function in ``tree`` with its qualified name, in source order.

    Only statement blocks are visited (a ``def`` is a statement; expressions hold
    none), which is several times faster than walking every node.
    """

    def visit(node: ast.AST, prefix: str):
        for child in _statements(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    yield name, child
                yield from visit(child, f"{name}.")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def _statements(node: ast.AST) -> Iterator[ast.AST]:
    """The statements (and ``except`` / ``case`` clauses) directly inside ``node``, in order."""
    for field in _BLOCK_FIELDS:
        block = getattr(node, field, None)
        if isinstance(block, list):
            yield from block


def document_without_docstring(
    lines: Sequence[str], function: ast.FunctionDef | ast.AsyncFunctionDef
) -> str | None:
    """The function's source (decorators included) with its docstring lines cut out.

    Returns None when the docstring shares a line with other code, so that it cannot be
    cut cleanly, or when it is the whole body. Otherwise the docstring fills whole lines
    and what remains is still a valid function.
    """
    docstring = function.body[0]
    start = min([function.lineno] + [d.lineno for d in function.decorator_list])
    body_rest = function.body[1:]
    first, last = lines[docstring.lineno - 1], lines[docstring.end_lineno - 1]
    shares_line = (
        docstring.lineno <= function.lineno
        or docstring.col_offset != len(first) - len(first.lstrip())
        or docstring.end_col_offset != len(last.rstrip().encode("utf-8"))
        or (body_rest and body_rest[0].lineno <= docstring.end_lineno)
    )
    if shares_line or not body_rest:
        return None
    kept = (
        lines[start - 1 : docstring.lineno - 1] + lines[docstring.end_lineno : function.end_lineno]
    )
    return textwrap.dedent("".join(kept)).strip("\n")


def _query_is_clean(query: str, function_name: str, limits: Limits) -> bool:
    """Size filters for the query; no signatures, no queries that name the function."""
    if not (
        limits.min_query_chars <= len(query) <= limits.max_query_chars
        and len(query.split()) >= limits.min_query_words
    ):
        return False
    if _SIGNATURE_LIKE.match(query) or "->" in query:
        return False
    name = function_name.strip("_").lower()
    # A query naming the function would be solved by matching names alone.
    return re.search(rf"\b{re.escape(name)}\b", query.lower()) is None


def _document_is_clean(query: str, document: str, limits: Limits) -> bool:
    """Size filters for the document; the query must not survive in it (comments, strings)."""
    lines = document.count("\n") + 1
    return (
        limits.min_document_chars <= len(document) <= limits.max_document_chars
        and limits.min_document_lines <= lines <= limits.max_document_lines
        and _normalized(query) not in _normalized(document)
    )


def pairs_in_file(path: Path, source: str, limits: Limits = Limits()) -> Iterator[Pair]:
    """The clean pairs of one source file, in source order."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = text.splitlines(keepends=True)
    for name, function in _functions(tree):
        docstring = ast.get_docstring(function, clean=True)
        if not docstring:
            continue
        query = docstring_summary(docstring)
        if not _query_is_clean(query, function.name, limits):
            continue
        document = document_without_docstring(lines, function)
        if document is not None and _document_is_clean(query, document, limits):
            yield Pair(query, document, source, name, line=function.lineno)


@dataclass
class Seen:
    """The queries (normalised; kept or ambiguous) and documents of the roots mined so far."""

    queries: set[str] = dataclasses.field(default_factory=set)
    documents: set[str] = dataclasses.field(default_factory=set)


@dataclass(frozen=True)
class Mined:
    """What mining one root gave, for progress reports."""

    root: str
    files: int
    pairs: int  # kept after deduplication
    seconds: float


def deduplicate(pairs: Iterable[Pair], seen: Seen | None = None) -> list[Pair]:
    """Drops ambiguous and repeated pairs, keeping the first of each in the given order.

    A query shared by functions of ``pairs`` with *different* code (e.g. "Return a copy
    of the object.") has no single right answer and is dropped; after that, a pair whose
    query or document came before, in ``pairs`` or in ``seen`` (the roots mined before:
    they win), is dropped (vendored or re-exported copies). ``seen`` is updated.
    """
    pairs = list(pairs)
    seen = Seen() if seen is None else seen
    documents_of: dict[str, set[str]] = {}
    for pair in pairs:
        documents_of.setdefault(_normalized(pair.query), set()).add(pair.document)
    unique = []
    for pair in pairs:
        query = _normalized(pair.query)
        if len(documents_of[query]) > 1 or query in seen.queries:
            continue
        if pair.document in seen.documents:
            continue
        seen.queries.add(query)
        seen.documents.add(pair.document)
        unique.append(pair)
    seen.queries.update(documents_of)  # the ambiguous ones stay dropped in later roots
    return unique


def mine_pairs(
    roots: Sequence[tuple[str, Path]] | None = None,
    limits: Limits = Limits(),
    progress: Callable[[Mined], None] | None = None,
) -> list[Pair]:
    """All clean, deduplicated pairs under ``roots`` (default: :func:`source_roots`).

    Roots are mined in order and a pair of a root never displaces one of an earlier root,
    so the standard library's pairs (first) do not depend on the packages installed.
    ``progress`` is called with each root's :class:`Mined` as it is done.
    """
    pairs: list[Pair] = []
    seen = Seen()
    for root_name, root in source_roots() if roots is None else roots:
        skipped = _SKIPPED_DIRS | (_SPLIT_OFF_STDLIB if root_name == "stdlib" else set())
        started, files = time.perf_counter(), python_files(root, skipped)
        mined = []
        for path in files:
            source = f"{root_name}/{path.relative_to(root).as_posix()}"
            mined.extend(pairs_in_file(path, source, limits))
        kept = deduplicate(mined, seen)
        pairs.extend(kept)
        if progress is not None:
            progress(Mined(root_name, len(files), len(kept), time.perf_counter() - started))
    return pairs


def held_out_order(sources: Iterable[str], seed: int = 0) -> list[str]:
    """``sources`` in the order they are held out: the standard library's (``"stdlib/..."``)
    first, each group by a seeded hash of the source's name.

    A file's place depends on its name and ``seed`` alone, not on which other files
    were mined: adding a package does not change which standard-library files are held
    out.
    """

    def key(source: str) -> tuple[bool, bytes]:
        digest = hashlib.sha256(f"{seed}:{source}".encode()).digest()
        return not source.startswith("stdlib/"), digest

    return sorted(set(sources), key=key)


def split_by_source(pairs: Sequence[Pair], held_out_size: int, seed: int = 0) -> Split:
    """Holds out whole source files, in :func:`held_out_order`, until ``held_out_size`` pairs.

    The held-out pairs are the first ``held_out_size`` of the held-out files' pairs in
    mining order (the rest of the last file's, if any, are dropped, not trained on).
    """
    if not 0 < held_out_size < len(pairs):
        raise ValueError(f"held_out_size must be in [1, {len(pairs) - 1}], got {held_out_size}.")
    counts: dict[str, int] = {}
    for pair in pairs:
        counts[pair.source] = counts.get(pair.source, 0) + 1
    held_out_sources: set[str] = set()
    count = 0
    for source in held_out_order(counts, seed):
        if count >= held_out_size:
            break
        held_out_sources.add(source)
        count += counts[source]
    held_out = [p for p in pairs if p.source in held_out_sources][:held_out_size]
    train = [p for p in pairs if p.source not in held_out_sources]
    return Split(train=train, held_out=held_out)
