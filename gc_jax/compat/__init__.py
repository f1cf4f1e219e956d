"""Porting layers: the APIs of the original GradCache, on gc_jax's two passes.

For code written against the original project (luyug/GradCache); new code needs
none of them (start at :func:`gc_jax.cached_value_and_grad`). Each runs the same two
passes (``gc_jax._passes``) as the front door:

* :class:`GradCache` (:mod:`gc_jax.compat.grad_cache`): the PyTorch class
  (``grad_cache.GradCache``), for Flax NNX modules.
* :mod:`gc_jax.compat.functional`: the PyTorch functional API
  (``grad_cache.functional``: ``cached``, ``cat_inputs``, ``gather_inputs``).
* :mod:`gc_jax.compat.cachex`: the original's JAX port (``grad_cache.cachex``), its
  names, signatures and pre-chunked inputs, on current JAX.

Until 0.2.0 these lived at the top level (``gc_jax.GradCache``,
``gc_jax.functional``, ``gc_jax.cachex``); those paths still import, with a
``DeprecationWarning`` naming the new one, and are removed in 0.3.0.
"""

from gc_jax.compat import cachex, functional
from gc_jax.compat.grad_cache import GradCache

__all__ = [
    "GradCache",
    "cachex",
    "functional",
]
