"""SigLIP's pairwise sigmoid loss: :func:`sigmoid_loss`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses import _common, _docs, _options
from gc_jax.losses._engine import strategies as _strategies


@_docs.shared_docs
def sigmoid_loss(
    x: jax.Array,
    y: jax.Array,
    logit_scale: float | jax.Array,
    logit_bias: float | jax.Array,
    *,
    query_ids: jax.Array | None = None,
    doc_ids: jax.Array | None = None,
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

    With ids, a pair ``(i, j)``, ``j != i``, whose ``x`` rows share an id (the same
    image twice) or whose ``y`` rows do (the same caption twice) is a false negative: it
    is dropped from the sum, in every form (dense, blockwise, ring), as
    :func:`contrastive_loss` drops it from the softmax.

    Args:
      x: one modality, ``[n, d]``.
      y: the other modality, ``[n, d]``; row ``i`` pairs with ``x[i]``.
      logit_scale: log of the logit multiplier (SigLIP starts at ``log(10)``).
      logit_bias: added to every logit (SigLIP starts at ``-10``).
      query_ids: an id per row of ``x``, ``[n]`` or ``[n, w]`` integers (e.g. an image
        hash, or :func:`text_ids` of its tokens), split like ``x``; None: no ids.
      doc_ids: an id per row of ``y``, likewise.
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

      Rows 0 and 2 of ``y`` are the same caption: the pairs (0, 2) and (2, 0) are not
      counted as negatives.

      >>> x, y = jnp.eye(3), jnp.eye(3)[jnp.array([0, 1, 0])]
      >>> ids = jnp.array([7, 8, 7])
      >>> z = 2.0 * x @ y.T - 1.0
      >>> labels = 2 * jnp.eye(3) - 1
      >>> keep = (ids[:, None] != ids[None, :]) | jnp.eye(3, dtype=bool)
      >>> want = -jnp.where(keep, jax.nn.log_sigmoid(labels * z), 0).sum() / 3
      >>> got = sigmoid_loss(x, y, jnp.log(2.0), -1.0, doc_ids=ids)
      >>> bool(jnp.allclose(got, want))
      True
    """
    block_size, method = _common.check_options(reduction, block_size, method)
    _common.check_pair(x, y, multiple=False)
    _options.real_scalar(logit_scale, "logit_scale")
    _options.real_scalar(logit_bias, "logit_bias")
    per_row = _options.PerRow(
        doc_ids=_options.check_ids(doc_ids, len(y), "doc_ids", "y"),
        query_ids=_options.check_ids(query_ids, len(x), "query_ids", "x"),
    )

    def local(x, y, logit_scale, logit_bias, *, per_row, axis_name, ring):
        where = _common.Where(block_size, axis_name, ring)
        scalars = (jnp.exp(logit_scale), logit_bias)
        options = _options.Options().with_rows(per_row)
        spec = _options.one_spec(_strategies.Sigmoid, options)
        losses = _common.dispatch(spec, x, y, scalars, where, options)
        num_rows = len(x) * _common.num_devices(axis_name)
        return _common.reduce(losses, num_rows, reduction, axis_name)

    kw = {"reduction": reduction, "method": method, "axis_name": axis_name}
    return _common.run(local, x, y, (logit_scale, logit_bias), sides=(y,), per_row=per_row, **kw)
