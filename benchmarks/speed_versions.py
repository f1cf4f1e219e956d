"""The headline gc/full step-time ratio of ``speed.py`` for several gc_jax commits, interleaved.

Each commit's ``gc_jax`` is taken with ``git archive`` into a temporary folder; every
round runs one worker process per commit (alternating the order), whose
``PYTHONPATH`` puts that commit's ``gc_jax`` before this checkout's ``benchmarks``.
Each worker times the full-batch and gc steps of ``speed.py``'s headline model
(6-layer MLP, B = 2048, chunk 256) in paired, alternating repetitions after two
warm-ups (``common.interleaved_times``). Reported per commit: the median and range of
the paired gc/full ratios, wall and process CPU time. Used for issue 18's speed
regression.

Usage::

    python -m benchmarks.speed_versions 7634503 951f672 HEAD --rounds 4 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(src: str, reps: int) -> None:
    """Times the steps with the ``gc_jax`` of ``src`` (imported here, not at the top)."""
    import jax

    import gc_jax
    from benchmarks import common

    assert gc_jax.__file__.startswith(src), gc_jax.__file__
    cfg = common.ModelConfig()
    steps = {k: jax.jit(v) for k, v in common.make_steps(256, None, ["full", "gc"]).items()}
    params = common.init_params(cfg, jax.random.key(0))
    q, d = common.make_batch(cfg, 2048, jax.random.key(1))
    t = common.interleaved_times(steps, (params, q, d), reps, warmup=2)
    print(json.dumps({k: {"wall": t.wall[k], "cpu": t.cpu[k]} for k in steps}))


def worker_command(src: Path, reps: int) -> list[str]:
    return [sys.executable, "-m", "benchmarks.speed_versions", "--worker", str(src),
            "--reps", str(reps)]  # fmt: skip


def worker_env(src: Path) -> dict[str, str]:
    """The environment of a worker: ``src``'s ``gc_jax``, then this checkout's ``benchmarks``."""
    path = [str(src), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("commits", nargs="*")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.reps)
    tmp = Path(tempfile.mkdtemp())
    for c in args.commits:
        (tmp / c).mkdir()
        archive = subprocess.run(["git", "archive", c, "gc_jax"], cwd=ROOT,
                                 check=True, capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(tmp / c)], input=archive, check=True)
    ratios = {c: {"wall": [], "cpu": []} for c in args.commits}
    for r in range(args.rounds):
        for c in args.commits if r % 2 == 0 else args.commits[::-1]:
            cmd, env = worker_command(tmp / c, args.reps), worker_env(tmp / c)
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env, check=True)
            d = json.loads(out.stdout.strip().splitlines()[-1])
            for m in ("wall", "cpu"):
                ratios[c][m] += [g / f for g, f in zip(d["gc"][m], d["full"][m], strict=True)]
        print(f"round {r}: load average {os.getloadavg()[0]:.1f}", flush=True)
    for c, x in ratios.items():
        parts = [f"{m} median {statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"
                 for m, v in x.items()]  # fmt: skip
        print(f"{c}: gc/full {', '.join(parts)} (n={len(x['wall'])})")


if __name__ == "__main__":
    main()
