"""What every model adapter (Flax, Keras, Equinox) shares.

How a chunk is passed to a model, and why per-chunk batch statistics are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gc_jax._base import PyTree

PER_CHUNK_STATISTICS = (
    "BatchNorm in training mode normalises every chunk with that chunk's own "
    "statistics, so the gradient would not be the full batch's"
)


def call_with_chunk(fn: Callable[..., Any], chunk: PyTree) -> Any:
    """Calls ``fn`` on a chunk as the PyTorch GradCache calls a model.

    ``(list, dict)`` pair: ``fn(*chunk[0], **chunk[1])``; list/tuple: ``fn(*chunk)``;
    dict: ``fn(**chunk)``; anything else: ``fn(chunk)``.
    """
    if (
        isinstance(chunk, tuple)
        and len(chunk) == 2
        and isinstance(chunk[0], list | tuple)
        and isinstance(chunk[1], Mapping)
    ):
        return fn(*chunk[0], **chunk[1])
    if isinstance(chunk, list | tuple):
        return fn(*chunk)
    if isinstance(chunk, Mapping):
        return fn(**chunk)
    return fn(chunk)
