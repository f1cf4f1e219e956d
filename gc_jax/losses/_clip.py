"""CLIP's symmetric InfoNCE: :func:`clip_loss`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses import _common, _docs, _strategies
from gc_jax.losses._order import after


@_docs.shared_docs
def clip_loss(
    x: jax.Array,
    y: jax.Array,
    logit_scale: float | jax.Array,
    *,
    reduction: str = "mean",
    block_size: int | None = None,
    axis_name: AxisName | None = None,
    method: str = "auto",
) -> jax.Array:
    """Symmetric CLIP loss: the mean of image-to-text and text-to-image InfoNCE.

    Row ``i`` of ``x`` pairs with row ``i`` of ``y``. With
    ``s(a, b) = exp(logit_scale) * a . b``, pair ``i``'s loss is::

      loss_i = ( logsumexp_j s(x_i, y_j) - s(x_i, y_i)
               + logsumexp_j s(x_j, y_i) - s(x_i, y_i) ) / 2

    the sums running over every row of the batch, across devices. Across devices
    each device scores its ``x`` rows against every ``y`` and its ``y`` rows against
    every ``x``.

    Args:
      x: one modality, ``[n, d]`` (normalise rows yourself, as CLIP does).
      y: the other modality, ``[n, d]``; row ``i`` pairs with ``x[i]``.
      logit_scale: *log* of the logit multiplier (learnable in CLIP, which starts
        at ``log(1 / 0.07)``); logits are ``exp(logit_scale) * x @ y.T``.
      {shared args}

    Returns:
      {shared returns}

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import clip_loss
      >>> e = jnp.eye(3)
      >>> bool(clip_loss(e, e, jnp.log(100.0)) < 1e-3)
      True
      >>> bool(jnp.allclose(clip_loss(e, e, 0.0, block_size=2), clip_loss(e, e, 0.0)))
      True
    """
    block_size, method = _common.check_options(reduction, block_size, method)
    _common.check_pair(x, y, multiple=False)

    def local(x, y, logit_scale, *, axis_name, ring):
        scale, kind = jnp.exp(logit_scale), _strategies.Softmax
        rows = lambda a, b: _common.rows(kind, a, b, 1, scale, 0.0, block_size, axis_name, ring)
        x_to_y = rows(x, y)
        if ring:  # one ring at a time, forward and backward (else both hold their buffers)
            x_to_y, x, y = jax.lax.optimization_barrier((x_to_y, x, y))
            x, y = after((x, y), x_to_y)  # kept on XLA:CPU too
        per_row = (x_to_y + rows(y, x)) / 2
        num_rows = len(x) * _common.num_devices(axis_name)
        return _common.reduce(per_row, num_rows, reduction, axis_name)

    kw = {"reduction": reduction, "method": method, "axis_name": axis_name}
    return _common.run(local, x, y, (logit_scale,), sides=(x, y), **kw)
