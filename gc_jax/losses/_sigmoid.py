"""SigLIP's pairwise sigmoid loss: :func:`sigmoid_loss`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses import _common, _docs, _strategies


@_docs.shared_docs
def sigmoid_loss(
    x: jax.Array,
    y: jax.Array,
    logit_scale: float | jax.Array,
    logit_bias: float | jax.Array,
    *,
    reduction: str = "mean",
    block_size: int | None = None,
    axis_name: AxisName | None = None,
    method: str = "auto",
) -> jax.Array:
    """SigLIP's pairwise sigmoid loss.

    Every pair ``(x[i], y[j])`` is a binary problem, positive iff ``i == j``. With
    logits ``z_ij = exp(logit_scale) * x_i . y_j + logit_bias`` and labels
    ``l_ij = 1`` if ``i == j`` else ``-1``, row ``i``'s loss is::

      loss_i = -sum_j log sigmoid(l_ij * z_ij)

    the sum running over every row of ``y``, across devices. As in SigLIP,
    ``reduction="mean"`` divides the sum over pairs by the number of rows (not pairs).

    Args:
      x: one modality, ``[n, d]``.
      y: the other modality, ``[n, d]``; row ``i`` pairs with ``x[i]``.
      logit_scale: log of the logit multiplier (SigLIP starts at ``log(10)``).
      logit_bias: added to every logit (SigLIP starts at ``-10``).
      {shared args}

    Returns:
      {shared returns}

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import sigmoid_loss
      >>> e = jnp.eye(3)
      >>> bool(sigmoid_loss(e, e, jnp.log(20.0), -10.0) < 1e-3)
      True
      >>> blockwise = sigmoid_loss(e, e, 0.0, -1.0, block_size=2)
      >>> bool(jnp.allclose(blockwise, sigmoid_loss(e, e, 0.0, -1.0)))
      True
    """
    block_size, method = _common.check_options(reduction, block_size, method)
    _common.check_pair(x, y, multiple=False)

    def local(x, y, logit_scale, logit_bias, *, axis_name, ring):
        scale, kind = jnp.exp(logit_scale), _strategies.Sigmoid
        per_row = _common.rows(kind, x, y, 1, scale, logit_bias, block_size, axis_name, ring)
        num_rows = len(x) * _common.num_devices(axis_name)
        return _common.reduce(per_row, num_rows, reduction, axis_name)

    kw = {"reduction": reduction, "method": method, "axis_name": axis_name}
    return _common.run(local, x, y, (logit_scale, logit_bias), sides=(y,), **kw)
