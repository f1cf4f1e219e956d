"""The test run is quiet: libtpu prints nothing on a machine without a TPU.

libtpu, loaded to compile for compile-only TPU topologies, looks for the TPU host it runs
on and, finding none, prints ``Failed to find host bounds ...`` and ``E0000 ...
TPU_WORKER_HOSTNAMES`` lines. ``tests/conftest.py`` names a one-chip host
(``TPU_ACCELERATOR_TYPE``, ``TPU_WORKER_HOSTNAMES``) for the test run and every process it
starts; this test checks that a process started so prints none of those lines.
"""

import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

pytestmark = [
    pytest.mark.slow,  # a process that loads libtpu: a few seconds
    pytest.mark.skipif(find_spec("libtpu") is None, reason="libtpu is not installed"),
]

SCRIPT = """
import jax
from jax.experimental import topologies
topology = topologies.get_topology_desc(  # as tests/test_tpu.py builds a v5e chip
    platform="tpu", topology_name="v5e:1x1", chip_config_name="default",
    chips_per_host_bounds=(1, 1, 1), num_slices=1, wrap=(False, False, False),
)
print(len(topology.devices))
"""


def test_libtpu_prints_nothing_in_the_test_run():
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # other processes may hold libtpu
    assert env.get("TPU_WORKER_HOSTNAMES"), "tests/conftest.py sets it before JAX starts"
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "1"
    for line in ("Failed to find host bounds", "E0000", "unexpected worker hostname"):
        assert line not in run.stderr, run.stderr
