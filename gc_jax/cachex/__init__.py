"""A deprecated import path of 0.1, removed in 0.3.0.

``gc_jax.cachex`` is :mod:`gc_jax.compat.cachex` since 0.2.0.
"""

from gc_jax import _deprecated

_new = _deprecated.moved(__name__)
globals().update({name: getattr(_new, name) for name in _new.__all__})
__all__ = _new.__all__
