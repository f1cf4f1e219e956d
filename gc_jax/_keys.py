"""The dropout keys of gradient caching: every fold of a key happens here.

Chunk ``c`` of input ``i`` is encoded with ``fold_in(fold_in(rng, i), c)`` in both
passes, so pass 2 replays pass 1's dropout masks exactly. Data parallelism adds the
device: under ``shard_map``/``pmap`` with ``axis_name`` the device index is folded
into ``rng`` first; under ``jit`` over a sharded batch, device ``s``'s rows of a chunk
get the chunk's key folded with ``s``. A None key stays None (deterministic encoders).
"""

from __future__ import annotations

from typing import Any

import jax


def _fold(key: jax.Array | None, data: Any) -> jax.Array | None:
    return None if key is None else jax.random.fold_in(key, data)


def input_key(rng: jax.Array | None, index: int) -> jax.Array | None:
    """The key of input ``index``'s chunks: ``fold_in(rng, index)``."""
    return _fold(rng, index)


def chunk_key(key: jax.Array | None, number: Any) -> jax.Array | None:
    """The key chunk ``number`` of an input with key ``key`` gets, in both passes."""
    return _fold(key, number)


def device_key(key: jax.Array | None, device: Any) -> jax.Array | None:
    """``key`` folded with a device's index (``lax.axis_index``, or a shard number)."""
    return _fold(key, device)
