"""Types shared by every module of gc_jax, declared once (as optax's ``base.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax

PyTree = Any
"""A pytree of arrays (a batch, parameters, representations)."""

AxisName = Any
"""A mesh axis name of ``shard_map``/``pmap``, or a tuple of them."""

Encoder = Callable[[PyTree, PyTree, jax.Array | None], PyTree]
"""``encode(params, chunk, key) -> reps``: ``key`` is None when no ``rng`` is given."""

EncoderView = Literal["auto", "local", "global"]
"""How an encoder sees a chunk under ``jit`` over a batch split across devices.

* ``"local"``: each device encodes its own rows under ``shard_map`` over the batch's
  mesh axes, with its own copy of the parameters: plain local arrays, as in a
  data-parallel program (an embedding lookup needs no annotation). Each chunk's
  gradient stays on its device; the step all-reduces once.
* ``"global"``: the chunk spans the devices, typed as a sharded global array, as the
  encoder would see a batch under plain ``jit``: its own sharding annotations apply
  (FSDP weights gathered per layer, activations constrained by rows). The compiler
  places the gradient reductions (per chunk, or once per loop).
* ``"auto"``: ``"local"`` when every input is split the same way, no parameter is
  sharded over the batch axes (by its explicit type), the encoder traces so and its
  jaxpr has no sharding annotation naming a batch axis (MaxText's activation
  constraints); else ``"global"``, what plain ``jit`` does.
"""
