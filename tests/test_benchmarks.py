"""The benchmarks: the accelerator runs (on this CPU, with a tiny model) and what they
report; the package runs as ``python -m benchmarks.<name>`` and its index is complete."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common, gpu_step, tpu_compile


def test_gpu_step_worker_trains_the_tiny_model(capsys):
    gpu_step.main(["--tiny", "--worker", "gc_jax (grow)", "--batches", "32", "--steps", "1",
                   "--grow-chunk", "8"])  # fmt: skip
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert line["batch"] == 32 and line["chunk"] == 8 and line["finite"]
    assert line["median_s"] > 0 and "peak_bytes" in line  # None on a CPU


def test_tpu_compile_search_brackets_the_largest_fit():
    """The search on a fake compiler (affine bytes; refused above the limit): the largest
    grid batch that fits, the next grid point refused, and two compiled batches for the
    bytes per row, from starts below, around and above the boundary."""
    fixed, per_row, limit = 3e9, 5e3, 16e9  # fits up to 2.6 M rows: 2^21 fits, 3 * 2^20 not
    probed = []

    def probe(rows):
        probed.append(rows)
        total = fixed + per_row * rows
        return {"fits": total <= limit, "compiled": total <= limit, "allocated_total": total,
                "total": total}  # fmt: skip

    for start in [(2**10, 2**11), (2**20, 3 * 2**19), (2**21, 3 * 2**20), (2**24, 2**25)]:
        probed.clear()
        found = tpu_compile.search(probe, start, limit)
        assert (found["largest_fit"], found["first_no_fit"]) == (2**21, 3 * 2**20), start
        assert found["per_row_bytes"] == per_row and found["fixed_bytes"] == fixed
        assert len(probed) == len(set(probed)) <= 6, (start, probed)  # no batch twice


def test_out_of_memory_messages_are_read_in_any_unit():
    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
               "HLO temporaries ({}) exceeds available HBM ({}).")  # fmt: skip
    assert common.out_of_memory(RuntimeError(message.format("1.37T", "95.74G"))) == (
        1.37 * 2**40, 95.74 * 2**30)  # fmt: skip
    assert common.out_of_memory(RuntimeError(message.format("512.5M", "15.75G")))[0] == (
        512.5 * 2**20)  # fmt: skip
    assert common.out_of_memory(RuntimeError("INTERNAL: something else")) is None


# --- the package and its index -------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "benchmarks" / "README.md"
SHARED = {"__init__.py", "common.py", "bert.py", "example_modules.py"}  # not scripts
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in SHARED)
# Files that still give an old command (`python benchmarks/x.py`, `PYTHONPATH=.`), each with
# who changes it; the test fails when one no longer does, so that it is removed here.
OLD_COMMANDS_PENDING: set[str] = set()


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_script_has_a_row_in_the_index():
    index = INDEX.read_text()
    rows = re.findall(r"^\| `(\w+\.py)` \|", index, flags=re.M)
    assert sorted(set(rows) - SHARED) == SCRIPTS
    assert set(rows) >= SHARED - {"__init__.py"}
    for script in SCRIPTS:
        assert f"python -m benchmarks.{script[:-3]}" in index, script


def test_the_index_links_sections_of_benchmarks_md():
    headings = re.findall(r"^#+ (.*)$", (ROOT / "BENCHMARKS.md").read_text(), flags=re.M)
    anchors = set(re.findall(r"\(\.\./BENCHMARKS\.md#([^)]+)\)", INDEX.read_text()))
    assert anchors and anchors <= {slug(h) for h in headings}


def test_commands_run_the_benchmarks_as_modules():
    old = re.compile(r"python3? (?:\./)?benchmarks/\w+\.py|PYTHONPATH=\.(?:\s|$)")
    found = set()
    for path in [ROOT / "BENCHMARKS.md", ROOT / "README.md", *(ROOT / "benchmarks").glob("*")]:
        if path.suffix in {".md", ".py"} and old.search(path.read_text()):
            found.add(str(path.relative_to(ROOT)))
    assert found == OLD_COMMANDS_PENDING, f"old commands: {found - OLD_COMMANDS_PENDING}"


def test_every_benchmark_module_imports_from_the_root():
    """``python -m benchmarks.<name>`` imports (examples/ on PYTHONPATH for two of them)."""
    modules = [f"benchmarks.{name.removesuffix('.py')}" for name in sorted(SHARED | set(SCRIPTS))]
    modules = [m.removesuffix(".__init__") for m in modules]
    env = dict(os.environ, PYTHONPATH="examples")
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]"
    out = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


def test_buffer_assignment_reads_both_libtpu_formats():
    """libtpu 0.0.42 and 0.0.50 write the preallocated temporaries differently; both
    parse, by memory colour, and text with none of them is an error, never a zero."""
    old = (
        "allocation 7: size 100, preallocated-temp:\n"
        "allocation 8: size 5, color 1, preallocated-temp:"
    )
    new = (
        "allocation 7: size 100, page 0, preallocated-temp:\n"
        "allocation 8: size 5, color 1, page 0, preallocated-temp:\n"
        "allocation 9: size 3, color 2, page 0, preallocated-temp:"
    )
    assert common.preallocated_temps(old) == {0: 100, 1: 5}
    assert common.preallocated_temps(new) == {0: 100, 1: 5, 2: 3}
    with pytest.raises(ValueError, match="format changed"):
        common.preallocated_temps("allocation 1: size 4, page 0, parameter 0")
