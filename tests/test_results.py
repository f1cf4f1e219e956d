"""``benchmarks/results/`` holds the raw outputs the pages cite, and nothing else.

A page (README.md, BENCHMARKS.md, benchmarks/README.md, every Markdown file under docs/)
cites a raw output by its path, ``benchmarks/results/NAME``. A citation may name several
files with braces, ``benchmarks/results/speed.{txt,json}``, or a pattern with ``*``, and a
command's placeholder in capitals (``token_budget_DATA_small_BATCH.json``) stands for any
text. Every citation must find a file, and every file must be cited: a figure no page
quotes any more goes with its raw output (git history keeps both).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CITATION = re.compile(r"benchmarks/results/([\w.*{},\-]+)")
PLACEHOLDER = re.compile(r"[A-Z]{3,}")  # DATA, BATCH: a command's placeholders


def pages() -> list[Path]:
    top = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "README.md"]
    return [*top, *sorted((ROOT / "docs").rglob("*.md"))]


def expand(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``["abd", "acd"]``, brace groups expanded left to right."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [name for alt in match.group(1).split(",") for name in expand(head + alt + tail)]


def citations(text: str) -> list[str]:
    """The file patterns ``text`` cites under ``benchmarks/results/``."""
    found = []
    for cited in CITATION.findall(text):
        cited = cited.rstrip(".,")
        if not cited or cited.endswith("/"):
            continue
        found += [PLACEHOLDER.sub("*", name) for name in expand(cited)]
    return found


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("see `benchmarks/results/speed.json`.", ["speed.json"]),
        ("`benchmarks/results/a_{x,y}.{txt,json}`", ["a_x.txt", "a_x.json", "a_y.txt", "a_y.json"]),
        (
            "--json benchmarks/results/token_budget_DATA_small_BATCH.json",
            ["token_budget_*_small_*.json"],
        ),
        ("benchmarks/results/token_budget_*_lines*.json,", ["token_budget_*_lines*.json"]),
        ("raw outputs are in `benchmarks/results/`", []),
    ],
)
def test_citations_are_read(text, want):
    assert citations(text) == want


def cited_by_page() -> dict[str, list[str]]:
    return {str(page.relative_to(ROOT)): citations(page.read_text()) for page in pages()}


def test_every_citation_finds_a_file():
    files = [path.name for path in RESULTS.iterdir()]
    missing = [
        (page, pattern)
        for page, patterns in cited_by_page().items()
        for pattern in patterns
        if not fnmatch.filter(files, pattern)
    ]
    assert not missing, f"cited but not in benchmarks/results/: {missing}"


def test_every_file_is_cited():
    patterns = [p for found in cited_by_page().values() for p in found]
    uncited = sorted(
        path.name
        for path in RESULTS.iterdir()
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns)
    )
    assert not uncited, (
        f"no page cites these raw outputs: cite them where their figures are quoted, or "
        f"delete them (git history keeps them): {uncited}"
    )
