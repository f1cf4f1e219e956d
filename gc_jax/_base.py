"""Types shared by every module of gc_jax, declared once (as optax's ``base.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

PyTree = Any
"""A pytree of arrays (a batch, parameters, representations)."""

AxisName = Any
"""A mesh axis name of ``shard_map``/``pmap``, or a tuple of them."""

Encoder = Callable[[PyTree, PyTree, jax.Array | None], PyTree]
"""``encode(params, chunk, key) -> reps``: ``key`` is None when no ``rng`` is given."""
