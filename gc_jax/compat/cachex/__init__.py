"""``gc_jax.compat.cachex``: the API of the original GradCache's JAX port, on current JAX.

Code written for ``grad_cache.cachex`` (luyug/GradCache, as used by Tevatron) runs
unchanged once ``from grad_cache import cachex`` becomes
``from gc_jax.compat import cachex``: same names, signatures and pre-chunked
``[n_chunk, rows, ...]`` inputs, with ``jax.tree.map`` instead of the removed
``jax.tree_multimap``. Every gradient-caching function runs gc_jax's own two passes
(``gc_jax._passes``) with the chunk axis as their row axis and one chunk per step
(``grad_with_cache`` is the original's helper, a plain ``jax.grad`` of the output
contracted with a given cotangent, and ``tree_chunk``/``unchunk_args`` only reshape):

==============================================  ================================================
``cachex``                                      gc_jax
==============================================  ================================================
``grad_cached(f, policy)(params, batch)``       :func:`gc_jax.chunked_encoder` (``chunk_size=1``
                                                over the chunk axis)
``chunk_encode(fn)(**xx)``                      pass 1 (representations only)
``cache_grad(fn)(params, acc, grad, **xx)``     pass 2 (re-encode, pull back, accumulate)
``cache_train_step(loss_fn, state, ss, tt)``    both passes around ``jax.value_and_grad`` of
                                                the loss: :func:`gc_jax.make_train_step`,
                                                :func:`gc_jax.cached_value_and_grad`
==============================================  ================================================

Differences from the original:

* Memory: the original's ``grad_cached`` relied on ``jax.checkpoint`` around a
  ``lax.scan``; here the forward keeps nothing and the backward re-encodes one chunk
  at a time, whatever the ``policy``. A ``policy`` other than None /
  ``nothing_saveable`` is applied *within* each chunk's re-encoding (the original
  saved what it names for every chunk), and ``prevent_cse`` has no effect.
* Argument errors (an ``n_chunk`` that does not divide the batch, leaves with
  different numbers of chunks, a ``cached_grad`` of the wrong shape) raise
  ``ValueError``/``TypeError`` naming the argument.
* Sharding: under auto mesh axes (plain ``jit`` with shardings, as Tevatron does)
  ``grad_cached``, ``chunk_encode`` and ``cache_grad`` work on a batch sharded along
  its rows, however it is chunked. Under explicit axes
  (``AxisType.Explicit``, ``jax.make_mesh``'s default), with or without
  ``jax.set_mesh``, every form works on a pre-chunked batch sharded over its chunks
  (``P("data")``: each device encodes its own chunks) or within them
  (``P(None, "data")``), and ``tree_chunk`` inside the ``jit`` works when ``n_chunk``
  is a multiple of the number of shards (else it raises a ``ValueError`` saying so).
* Encoders may return pytrees of arrays; integer outputs and inputs (ids, masks,
  raw or typed per-chunk dropout keys) get no gradient.

Without pre-chunking, the native forms are :func:`gc_jax.chunked_encoder`
(wrap the encoder, keep your own loss and optimizer step) and
:func:`gc_jax.cached_value_and_grad` (one call for the loss and the gradient).

Examples:
  Tevatron's pattern: per-chunk dropout keys in the pre-chunked batch.

  >>> import jax, jax.numpy as jnp
  >>> from gc_jax.compat import cachex
  >>> def fwd(params, batch):
  ...     h = jnp.tanh(batch["x"] @ params)
  ...     return h * jax.random.bernoulli(batch["dropout_rng"], 0.9, h.shape) / 0.9
  >>> batch = {"x": jnp.arange(32.0).reshape(8, 4) / 32}
  >>> batch = cachex.tree_chunk(batch, 4)
  >>> batch["dropout_rng"] = jax.random.split(jax.random.key(0), 4)
  >>> loss = lambda p, f: jnp.sum(f(p, batch) ** 2)
  >>> g = jax.jit(jax.grad(loss), static_argnums=1)(jnp.eye(4), cachex.grad_cached(fwd, None))
  >>> def plain(p, b):  # no caching: each chunk with its key, concatenated
  ...     return jnp.concatenate([fwd(p, jax.tree.map(lambda v: v[c], b)) for c in range(4)])
  >>> bool(jnp.allclose(g, jax.grad(loss)(jnp.eye(4), plain), atol=1e-6))
  True
"""

from gc_jax.compat.cachex.training import (
    cache_train_step,
)
from gc_jax.compat.cachex.transforms import (
    cache_grad,
    chunk_encode,
    grad_cached,
    grad_with_cache,
    unchunk_args,
)
from gc_jax.compat.cachex.tree_utils import (
    tree_chunk,
    tree_unchunk,
)

__all__ = [
    "cache_grad",
    "cache_train_step",
    "chunk_encode",
    "grad_cached",
    "grad_with_cache",
    "tree_chunk",
    "tree_unchunk",
    "unchunk_args",
]
