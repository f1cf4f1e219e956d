"""The dual-encoder example's modules, for the benchmarks that train or time the example.

``examples/`` is a folder of scripts that import each other by bare name
(``import retrieval_data``), as a script's own folder allows; it is not a package.
So these benchmarks need that folder on the import path, given on the command line
rather than by editing ``sys.path``, from the repository root::

    PYTHONPATH=examples python -m benchmarks.paper_experiment
    PYTHONPATH=examples python -m benchmarks.token_budget
    PYTHONPATH=examples python -m benchmarks.fsdp_pod

The model, tokenizer, data and evaluation are then the example's own, not copies.
"""

from __future__ import annotations

_MODULES = {"dual_encoder", "large_embedder", "retrieval_data"}

try:
    import dual_encoder
    import large_embedder
    import retrieval_data
except ModuleNotFoundError as err:
    if err.name not in _MODULES:
        raise
    raise ModuleNotFoundError(
        f"No module named {err.name!r}: the example's modules are imported from examples/; "
        "run this benchmark from the repository root as "
        "`PYTHONPATH=examples python -m benchmarks.<name>`.",
        name=err.name,
    ) from err

__all__ = ["dual_encoder", "large_embedder", "retrieval_data"]
