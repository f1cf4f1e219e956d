"""gc_jax's benchmarks: one script per question, run from the repository root.

Each script is a module of this package, run with ``python -m``, e.g.
``python -m benchmarks.speed --quick``; running from the root also imports the
checkout's ``gc_jax``. Shared helpers live in :mod:`benchmarks.common`, the BERT-base
dual encoder in :mod:`benchmarks.bert`. ``benchmarks/README.md`` lists every script
with its question, command, runtime and benchmark page (docs/benchmarks/, indexed by
BENCHMARKS.md).
"""
