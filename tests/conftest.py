"""Test-session settings: XLA:CPU compiles the tests' programs with LLVM at -O0.

Most of the suite's time is XLA:CPU compiling small programs. The backend optimisation
level only changes the machine code LLVM emits: the HLO passes, and so every compiled
memory figure and every collective the tests assert on, are the same (checked for a
gc_jax step and a full-batch step on XLA:CPU, and for the TPU compiler), and the
gradients are compared with tolerances. Benchmarks and users keep XLA's default.
"""

import os

_FLAG = "--xla_backend_optimization_level=0"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # set before any backend starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
