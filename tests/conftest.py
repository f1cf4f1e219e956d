"""Settings for the test run: XLA:CPU compiles the tests' programs with LLVM at -O0, and the
tests measured as slow are marked ``slow`` (out of the fast lane).

Most of the suite's time is XLA:CPU compiling small programs. The backend optimisation
level only changes the machine code LLVM emits: the HLO passes, and so every compiled
memory figure and every collective the tests assert on, are the same (checked for a
gc_jax step and a full-batch step on XLA:CPU, and for the TPU compiler), and the
gradients are compared with tolerances. Benchmarks and users keep XLA's default.
"""

import os
from pathlib import Path

import pytest

_FLAG = "--xla_backend_optimization_level=0"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # set before any backend starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()


SLOW_TESTS = Path(__file__).parent / "fixtures" / "slow_tests.txt"


def pytest_collection_modifyitems(items):
    """Marks ``slow`` the tests listed in ``fixtures/slow_tests.txt`` (measured CPU time
    over 2 s), beside the files and tests that carry the mark themselves."""
    listed = {
        line.strip() for line in SLOW_TESTS.read_text().splitlines() if line.strip()[:1] not in "#"
    }
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
