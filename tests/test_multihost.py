"""Two JAX processes on loopback, the runtime a TPU pod uses, against one full batch."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two processes: out of the fast lane (docs/development.md)

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_single_process_full_batch():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # 4 devices each
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i)],
            cwd=WORKER.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert "matches the full batch" in out
