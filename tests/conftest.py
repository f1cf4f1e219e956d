"""Settings for the test run: XLA:CPU compiles the tests' programs with LLVM at -O0, libtpu
is told it runs on a one-chip host (so that it prints nothing), and the tests measured as
slow are marked ``slow`` (out of the fast lane).

Most of the suite's time is XLA:CPU compiling small programs. The backend optimisation
level only changes the machine code LLVM emits: the HLO passes, and so every compiled
memory figure and every collective the tests assert on, are the same (checked for a
gc_jax step and a full-batch step on XLA:CPU, and for the TPU compiler), and the
gradients are compared with tolerances. Benchmarks and users keep XLA's default.
"""

import glob
import os
from pathlib import Path

import pytest

_FLAG = "--xla_backend_optimization_level=0"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # set before any backend starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

# libtpu (the ``tpu`` extra) looks for the TPU host it runs on when a backend starts, and on
# a machine without one prints ``Failed to find host bounds ...`` and ``E0000 ...
# TPU_WORKER_HOSTNAMES`` lines on stderr. Naming a one-chip host silences them; the TPU
# tests compile for compile-only topologies, whose programs are the same with or without
# these settings (docs/development.md). Not on a TPU host (its chips are /dev/accel* or
# /dev/vfio/N), where libtpu must find the real topology; values already set are kept.
if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


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
