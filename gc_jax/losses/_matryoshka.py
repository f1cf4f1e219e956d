"""Matryoshka representation learning: any loss summed over truncated widths."""

from __future__ import annotations

import functools
import itertools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def matryoshka(
    loss: Callable[..., jax.Array],
    dims: Sequence[int],
    *,
    weights: Sequence[float] | None = None,
    normalize: bool = True,
    n_dims_per_step: int | None = None,
    argnums: int | Sequence[int] = (0, 1),
) -> Callable[..., jax.Array]:
    """Wraps ``loss`` into its weighted sum over the leading ``dims`` of the representations.

    Matryoshka representation learning (Kusupati et al., 2022) trains the first ``m``
    features of every representation to work on their own, for each ``m`` in
    ``dims``. The wrapped loss truncates the representations (the arguments at
    ``argnums``) along their last axis to each width and sums::

      matryoshka_loss(x, y, ...) = sum_i weights[i] * loss(cut(x, dims[i]), cut(y, dims[i]), ...)
      cut(v, m) = v[..., :m]                  (normalize=False)
      cut(v, m) = v[..., :m] / |v[..., :m]|   (normalize=True, along the last axis)

    Every width reads the same representations: inside ``cached_value_and_grad`` or
    ``chunked_encoder`` they are encoded and cached once, at full width, and their
    gradient sums every width's. As in sentence-transformers' ``MatryoshkaLoss``,
    ``normalize=True`` (the default) rescales each truncated vector to unit length
    (``F.normalize``'s ``eps=1e-12``), so that a loss on unit vectors (dot products as
    cosine similarities) sees unit vectors at every width; pass ``normalize=False`` for
    a loss on raw dot products.

    The other arguments and keywords go to ``loss`` unchanged at every width:
    temperatures and logit scales, ``reduction``, ``block_size``, ``axis_name``,
    ``method``, masks (``maxsim_loss``'s ``q_mask``/``d_mask``: token masks have no
    feature axis and are not cut), or any other option of ``loss``. Each width is one
    call of ``loss`` in the form those options pick (dense, blockwise, ring), so memory
    is that of one call plus the truncated copies of the representations (the
    renormalised ones are recomputed in the backward pass, not kept).

    Args:
      loss: any loss, e.g. ``functools.partial(contrastive_loss, temperature=0.05)``,
        :func:`maxsim_loss`, or a ``loss_fn(params, *reps)`` of
        ``cached_value_and_grad`` (with ``argnums=(1, 2)``).
      dims: the widths, strictly decreasing, e.g. ``(768, 512, 256, 128, 64)``; the
        first is usually the representation's own (not required).
      weights: one weight per width (default: 1 each): floats, scalar arrays, or a
        ``[len(dims)]`` array (which may be traced).
      normalize: rescale each truncated vector to unit length (see above).
      n_dims_per_step: if set, each call sums a random ``n_dims_per_step`` of the
        widths only (drawn without replacement from ``key``; weights are not
        rescaled, as in sentence-transformers), computing only those.
      argnums: which positional arguments of ``loss`` are representations to cut,
        each an array ``[..., width]``.

    Returns:
      ``matryoshka_loss(*args, key=None, **kwargs)``: ``loss``'s signature, plus
      ``key`` (a PRNG key, the same on every device) when ``n_dims_per_step`` is set.

    Raises:
      ValueError: ``dims`` empty, not positive or not strictly decreasing;
        ``weights`` not one per width; and, when called, a width wider than a
        representation, or ``key`` missing with ``n_dims_per_step``.

    Examples:
      >>> import functools, jax, jax.numpy as jnp
      >>> from gc_jax.losses import contrastive_loss, matryoshka
      >>> x, y = jnp.sin(jnp.arange(96.0)).reshape(2, 6, 8)
      >>> loss = functools.partial(contrastive_loss, temperature=0.1)
      >>> mrl = matryoshka(loss, dims=(8, 4, 2), weights=(1.0, 0.5, 0.25), normalize=False)
      >>> want = loss(x, y) + 0.5 * loss(x[:, :4], y[:, :4]) + 0.25 * loss(x[:, :2], y[:, :2])
      >>> bool(jnp.allclose(mrl(x, y), want))
      True

      Options pass through at every width (here: blockwise tiles of 4 rows).

      >>> bool(jnp.allclose(mrl(x, y, block_size=4), want))
      True

      Around a ``loss_fn(params, q, d)`` of ``cached_value_and_grad``:

      >>> import gc_jax
      >>> loss_fn = lambda params, q, d: contrastive_loss(q, d, temperature=params["t"])
      >>> grad_fn = gc_jax.cached_value_and_grad(
      ...     matryoshka(loss_fn, dims=(8, 4), argnums=(1, 2)),
      ...     lambda params, x, key: jnp.tanh(x @ params["w"]), chunk_size=2)
      >>> params = {"w": jnp.eye(8), "t": jnp.float32(0.5)}
      >>> value, grads = jax.jit(grad_fn)(params, x, y)
      >>> grads["w"].shape
      (8, 8)
    """
    dims = _check_dims(dims)
    weights = _check_weights(weights, len(dims))
    argnums = _check_argnums(argnums)
    if n_dims_per_step is not None:
        if not isinstance(n_dims_per_step, numbers.Integral) or n_dims_per_step <= 0:
            raise ValueError(
                f"n_dims_per_step must be a positive int (widths per call) or None (all), "
                f"got {n_dims_per_step!r}."
            )
        if n_dims_per_step >= len(dims):
            n_dims_per_step = None  # every width, every call

    def matryoshka_loss(*args: Any, key: jax.Array | None = None, **kwargs: Any) -> jax.Array:
        _check_widths(args, argnums, dims)
        if (key is None) != (n_dims_per_step is None):
            raise ValueError(
                "key: pass a PRNG key (the same on every device) when n_dims_per_step is "
                "set, to draw the widths of this step, and none otherwise; got "
                f"key={key!r} with n_dims_per_step={n_dims_per_step!r}."
            )

        def at_width(i: int, args: tuple) -> jax.Array:
            cut = [_cut(a, dims[i], normalize) if j in argnums else a for j, a in enumerate(args)]
            return weights[i] * loss(*cut, **kwargs)

        if n_dims_per_step is None:
            return sum(at_width(i, args) for i in range(len(dims)))
        picks = jax.random.choice(key, len(dims), (n_dims_per_step,), replace=False)
        branches = [lambda args, i=i: at_width(i, args) for i in range(len(dims))]
        return sum(jax.lax.switch(p, branches, args) for p in picks)

    name = getattr(loss, "__name__", type(loss).__name__)
    matryoshka_loss.__name__ = matryoshka_loss.__qualname__ = f"matryoshka({name})"
    return matryoshka_loss


@functools.partial(jax.checkpoint, static_argnums=(1, 2))
def _cut(v: jax.Array, width: int, normalize: bool) -> jax.Array:
    """``v[..., :width]``, rescaled to unit length along the last axis if ``normalize``.

    Rematerialised: the backward recomputes the cut from ``v`` (the representations,
    kept anyway) instead of keeping every width's unit vectors (the memory saved is in
    docs/benchmarks/losses.md, "MaxSim and Matryoshka losses").
    """
    v = v[..., :width]
    if not normalize:
        return v
    wide = v.astype(jnp.promote_types(v.dtype, jnp.float32))
    norm2 = jnp.sum(jnp.square(wide), axis=-1, keepdims=True)
    return (wide * jax.lax.rsqrt(jnp.maximum(norm2, 1e-24))).astype(v.dtype)


def _check_dims(dims: Any) -> tuple[int, ...]:
    if not isinstance(dims, Sequence) or isinstance(dims, str) or not dims:
        raise ValueError(
            f"dims must be a non-empty sequence of widths, e.g. (768, 512, 256, 128, 64), "
            f"got {dims!r}."
        )
    if not all(isinstance(m, numbers.Integral) and not isinstance(m, bool) for m in dims):
        raise ValueError(f"dims must hold ints (widths), got {tuple(dims)!r}.")
    if any(m <= 0 for m in dims):
        raise ValueError(f"dims must be positive widths, got {tuple(dims)}.")
    if any(a <= b for a, b in itertools.pairwise(dims)):
        raise ValueError(
            f"dims must decrease strictly (the widest first), got {tuple(dims)}; pass "
            f"{tuple(sorted(set(dims), reverse=True))} (and reorder weights alike)."
        )
    return tuple(int(m) for m in dims)


def _check_weights(weights: Any, n: int) -> tuple[Any, ...]:
    """One real scalar per width: a sequence of floats or scalar arrays, or a ``[n]``
    array (concrete or traced: a weight only scales its width's loss)."""
    if weights is None:
        return (1.0,) * n
    if hasattr(weights, "shape") and hasattr(weights, "dtype"):  # an array of weights
        if tuple(weights.shape) != (n,) or not _real(weights.dtype):
            raise ValueError(
                f"weights must hold one weight per width of dims ({n}): a sequence, or a "
                f"real array of shape ({n},), got {weights.dtype} of shape "
                f"{tuple(weights.shape)}."
            )
        return tuple(weights[i] for i in range(n))
    if not isinstance(weights, Sequence) or isinstance(weights, str) or len(weights) != n:
        got = len(weights) if isinstance(weights, Sequence) else repr(weights)
        raise ValueError(
            f"weights must hold one weight per width of dims ({n}), got {got}; or pass "
            "weights=None for 1 each."
        )
    for i, w in enumerate(weights):
        dtype = getattr(w, "dtype", None)
        bad = isinstance(w, bool) or np.ndim(w) != 0
        bad = bad or (not _real(dtype) if dtype is not None else not np.isreal(w))
        if bad:
            raise ValueError(f"weights[{i}] must be a real scalar (a width's weight), got {w!r}.")
    return tuple(weights)


def _real(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)


def _check_argnums(argnums: Any) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, numbers.Integral) else argnums
    if (
        not isinstance(nums, Sequence)
        or not nums
        or not all(isinstance(i, numbers.Integral) and i >= 0 for i in nums)
    ):
        raise ValueError(
            f"argnums must be the positions of the representations among loss's positional "
            f"arguments, e.g. (0, 1), or (1, 2) for a loss_fn(params, q, d); got {argnums!r}."
        )
    return tuple(int(i) for i in nums)


def _check_widths(args: tuple, argnums: tuple[int, ...], dims: tuple[int, ...]) -> None:
    for i in argnums:
        if i >= len(args):
            raise ValueError(
                f"argnums={argnums} names positional argument {i}, but the loss was called "
                f"with {len(args)}; pass the representations positionally."
            )
        width = getattr(args[i], "shape", (None,))[-1:] or (None,)
        if width[0] is None or not jnp.issubdtype(args[i].dtype, jnp.floating):
            raise ValueError(
                f"argument {i} (in argnums) must be a float array [..., width] of "
                f"representations to truncate, got {getattr(args[i], 'shape', type(args[i]))}."
            )
        if dims[0] > width[0]:
            raise ValueError(
                f"dims={dims} holds widths larger than argument {i}'s representations "
                f"(width {width[0]}, shape {args[i].shape}); use widths of at most {width[0]}."
            )
