"""The GPU plan of ``vs_pytorch.py`` in one command: its runs in order of value, in time.

A lent GPU session has minutes of device time, so the comparison of gc_jax with PyTorch
GradCache has to come from one prepared command. This runs ``vs_pytorch.py``'s runs
one after the other, most valuable first, each under its own time limit (and never past
``--time-limit`` in all: a run that would start with under ``--min-step-s`` left is
skipped), with the weights drawn once for all of them; each run's JSON goes to
``--out/vs_pytorch_<name>.json`` as it ends, and ``--out/vs_pytorch_plan.json`` says
which ran, how long each took and how each ended. A run that fails or times out does
not stop the next. The runs (chunks of 256 rows; ``--tiny``: the 2-layer model, chunks
of 8, batches of 32 for 4,096 and 64 for 65,536, a CPU check of the plan itself):

1. bf16, B = 4,096, both sides, ``--check`` (the same weights: losses and gradients);
2. bf16, B = 65,536, both sides, two timed steps (XLA's attention in both bf16 runs);
3. fp32, B = 4,096, both sides;
4. bf16, B = 4,096, gc_jax only, cuDNN's fused attention (``--attention cudnn``);
5. fp32, B = 65,536, both sides, two timed steps.

Usage::

    python -m benchmarks.vs_pytorch_plan --out DIR --time-limit 420
    python -m benchmarks.vs_pytorch_plan --tiny --out /tmp/plan --frameworks jax
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import vs_pytorch

# (name, seconds at most, vs_pytorch arguments), most valuable first. The times are
# planned from the H200's: a 4,096-row worker took 30-50 s (33 s of it compiling); a
# 65,536-row step of gc_jax ~22 s in bf16, GradCache's ~30 s. XLA's attention in bf16
# but for run 4: cuDNN's (``--attention auto``'s choice for bf16 on a GPU) has never run,
# and the parent's path that chose it there printed no row in minutes.
STEPS = (
    ("bf16_4096_check", 150, "--precisions bf16 --batches 4096 --check --attention xla"),
    (
        "bf16_65536",
        240,
        "--precisions bf16 --batches 65536 --steps 2 --budget-s 100 --attention xla",
    ),
    ("fp32_4096", 120, "--precisions fp32 --batches 4096"),
    ("bf16_4096_cudnn", 90, "--precisions bf16 --batches 4096 --frameworks jax --attention cudnn"),
    ("fp32_65536", 240, "--precisions fp32 --batches 65536 --steps 2 --budget-s 100"),
)
TINY_BATCHES = {"4096": "32", "65536": "64"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="a folder for the JSON files")
    p.add_argument("--time-limit", type=float, default=420.0, help="seconds for all the runs")
    p.add_argument("--min-step-s", type=float, default=40.0, help="start no run with less left")
    p.add_argument("--frameworks", nargs="+", default=["jax", "torch"], choices=["jax", "torch"])
    p.add_argument("--torch-python", default=sys.executable, help="Python of the torch side")
    p.add_argument("--tiny", action="store_true", help="the 2-layer model, small batches: CPU")
    return p.parse_args(argv)


def step_argv(args: argparse.Namespace, name: str, flags: str, limit: float, weights: str):
    """``vs_pytorch``'s arguments for one run of the plan, or None if none of its
    frameworks is among ``--frameworks``."""
    argv = flags.split()
    if "--frameworks" in argv:
        at = argv.index("--frameworks")
        wanted = [fw for fw in argv[at + 1 : at + 2] if fw in args.frameworks]
        if not wanted:
            return None
        del argv[at : at + 2]
    else:
        wanted = args.frameworks
    if args.tiny:
        argv = [TINY_BATCHES.get(a, a) for a in argv] + ["--tiny"]
    return [*argv, "--frameworks", *wanted, "--time-limit", f"{limit:.0f}", "--weights",
            weights, "--torch-python", args.torch_python, "--json",
            str(args.out / f"vs_pytorch_{name}.json")]  # fmt: skip


def run_step(argv: list[str]) -> str:
    """One ``vs_pytorch`` run in this process: how it ended."""
    try:
        vs_pytorch.main(argv)
    except (Exception, SystemExit) as e:  # the next run still gets its turn
        traceback.print_exc()
        return f"error: {type(e).__name__}: {e}"[:400]
    return "done"


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    done = []
    with tempfile.TemporaryDirectory() as tmp:
        weights = f"{tmp}/weights.npz"
        vs_pytorch.draw_weights(args.tiny, weights)
        print(f"[plan: weights drawn and saved: {time.perf_counter() - start:.1f} s]", flush=True)
        for name, most, flags in STEPS:
            left = args.time_limit - (time.perf_counter() - start)
            argv_ = step_argv(args, name, flags, min(most, left), weights)
            if argv_ is None or left < args.min_step_s:
                why = "skipped: " + ("no framework" if argv_ is None else f"{left:.0f} s left")
                done.append({"name": name, "status": why})
            else:
                print(f"[plan: {name}, at most {min(most, left):.0f} s]", flush=True)
                t0 = time.perf_counter()
                status = run_step(argv_)
                done.append({"name": name, "argv": argv_, "status": status,
                             "wall_s": round(time.perf_counter() - t0, 1)})  # fmt: skip
            print(f"[plan: {name}: {done[-1]['status']} {done[-1].get('wall_s', '')}]", flush=True)
            plan = {"command": " ".join(["python -m benchmarks.vs_pytorch_plan",
                                         *(sys.argv[1:] if argv is None else argv)]),
                    "time_limit_s": args.time_limit, "steps": done}  # fmt: skip
            vs_pytorch.write_json(args.out / "vs_pytorch_plan.json", plan)
    print(f"[plan: {time.perf_counter() - start:.1f} s in all]", flush=True)


if __name__ == "__main__":
    main()
