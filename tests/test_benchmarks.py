"""The accelerator benchmark runs (on this CPU, with a tiny model) and reports what it says."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_step


def test_gpu_step_worker_trains_the_tiny_model(capsys):
    gpu_step.main(["--tiny", "--worker", "gc_jax (grow)", "--batches", "32", "--steps", "1",
                   "--grow-chunk", "8"])  # fmt: skip
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert line["batch"] == 32 and line["chunk"] == 8 and line["finite"]
    assert line["median_s"] > 0 and "peak_bytes" in line  # None on a CPU
