"""Flax adapters: Linen and NNX modules as gc_jax encoders.

An encoder is ``encode(params, chunk, key) -> reps``. The adapters call the module
on a chunk the way the PyTorch GradCache calls a model: an array ``x`` as
``model(x)``, a list or tuple as ``model(*x)``, a dict as ``model(**x)``, a
``(list, dict)`` pair as ``model(*x[0], **x[1])``; and
``get_rep`` picks the representation out of the output (e.g. a pooled vector).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import linen, nnx

PyTree = Any


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


def _identity(x: Any) -> Any:
    return x


def linen_encoder(
    module: linen.Module,
    *,
    method: str | Callable[..., Any] | None = None,
    get_rep: Callable[[Any], PyTree] | None = None,
    rng_collection: str = "dropout",
    **apply_kwargs: Any,
) -> Callable[[PyTree, PyTree, jax.Array | None], PyTree]:
    """Turns a Linen module into an encoder over its ``params`` collection.

    Args:
      module: the Linen module.
      method: the method to apply (name or unbound method), default ``__call__``;
        e.g. ``"encode_image"`` for one tower of a two-tower module.
      get_rep: picks the representation out of the module's output.
      rng_collection: the RNG collection the chunk key feeds (Flax's ``Dropout``
        uses ``"dropout"``). With no key, no RNG is passed.
      **apply_kwargs: static keyword arguments for every call, e.g.
        ``deterministic=False``.

    Returns:
      ``encode(params, chunk, key)`` where ``params`` is the module's ``"params"``
      collection (``variables["params"]``, or ``TrainState.params``).

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, gc_jax
      >>> model = nn.Dense(3)
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
      >>> encode = gc_jax.linen_encoder(model)
      >>> encode(params, jnp.ones((4, 2)), None).shape
      (4, 3)
    """
    get_rep = get_rep or _identity

    def encode(params, chunk, key):
        rngs = {} if key is None else {rng_collection: key}
        fn = lambda *a, **k: module.apply(
            {"params": params}, *a, method=method, rngs=rngs, **apply_kwargs, **k
        )
        return get_rep(call_with_chunk(fn, chunk))

    return encode


def nnx_encoder(
    model: nnx.Module,
    *,
    method: str = "__call__",
    get_rep: Callable[[Any], PyTree] | None = None,
) -> Callable[[nnx.State, PyTree, jax.Array | None], PyTree]:
    """Turns an NNX module into an encoder over its ``nnx.Param`` state.

    The module's other state (RNG streams, non-trainable variables) is captured as
    it is now. Each chunk reseeds every RNG stream of the module with the chunk's
    key, so dropout masks are replayed exactly in pass 2; with no key the module
    runs deterministically (``nnx.view(model, deterministic=True)``).

    Args:
      model: the NNX module.
      method: the method to call, default ``__call__``.
      get_rep: picks the representation out of the module's output.

    Returns:
      ``encode(params, chunk, key)`` where ``params = nnx.state(model, nnx.Param)``.

    Examples:
      >>> import jax.numpy as jnp, gc_jax
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> encode = gc_jax.nnx_encoder(model)
      >>> encode(nnx.state(model, nnx.Param), jnp.ones((4, 2)), None).shape
      (4, 3)
    """
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    get_rep = get_rep or _identity

    def encode(params, chunk, key):
        # A fresh copy of the captured state, so the merged module's variables
        # belong to the current trace and may be updated (RNG counters).
        module = nnx.merge(graphdef, params, jax.tree.map(_identity, rest))
        if key is None:
            with contextlib.suppress(ValueError):  # no module has `deterministic`
                module = nnx.view(module, deterministic=True)
        else:
            streams = {s.tag for _, s in nnx.iter_graph(module) if isinstance(s, nnx.RngStream)}
            if streams:
                nnx.reseed(module, **dict.fromkeys(streams, key))
        return get_rep(call_with_chunk(getattr(module, method), chunk))

    return encode
