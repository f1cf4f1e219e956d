"""gc_jax's benchmarks: one script per question, run from the repository root.

Each script is a module of this package, run with ``python -m``, e.g.
``python -m benchmarks.speed --quick``; running from the root also imports the
checkout's ``gc_jax``. Shared helpers live in :mod:`benchmarks.common`, the BERT-base
dual encoder in :mod:`benchmarks.bert`. ``benchmarks/README.md`` lists every script
with its question, command, runtime and benchmark page (docs/benchmarks/, indexed by
BENCHMARKS.md).
"""

import glob as _glob
import os as _os

# As tests/conftest.py: on a machine without TPU chips, name a one-chip host so that
# libtpu (the ``tpu`` extra) prints no host-lookup warnings when a backend starts; the
# compile-only topologies the TPU benchmarks use compile the same programs either way.
if not _glob.glob("/dev/accel*") and not _glob.glob("/dev/vfio/[0-9]*"):
    _os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    _os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
