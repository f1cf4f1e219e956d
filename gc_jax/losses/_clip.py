"""CLIP's symmetric InfoNCE: :func:`clip_loss`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses import _common, _contrastive, _docs, _options


@_docs.shared_docs
def clip_loss(
    x: jax.Array,
    y: jax.Array,
    logit_scale: float | jax.Array,
    *,
    query_ids: jax.Array | None = None,
    doc_ids: jax.Array | None = None,
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
    every ``x``. It is :func:`contrastive_loss` with ``directions=("query_to_doc",
    "doc_to_query")`` and ``partition_mode="per_direction"``, and runs as it does.

    With ids, a pair ``(i, j)``, ``j != i``, whose ``x`` rows or ``y`` rows share an id
    (the same image or caption twice) is not counted as a negative in either direction.

    Args:
      x: one modality, ``[n, d]`` (normalise rows yourself, as CLIP does).
      y: the other modality, ``[n, d]``; row ``i`` pairs with ``x[i]``.
      logit_scale: *log* of the logit multiplier (learnable in CLIP, which starts
        at ``log(1 / 0.07)``); logits are ``exp(logit_scale) * x @ y.T``.
      query_ids: an id per row of ``x``, ``[n]`` or ``[n, w]`` integers, split like
        ``x``; None: no ids.
      doc_ids: an id per row of ``y``, likewise.
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
    _options.real_scalar(logit_scale, "logit_scale")
    options = _options.Options(
        ("query_to_doc", "doc_to_query"),
        "per_direction",
        _options.check_ids(query_ids, len(x), "query_ids", "x"),
        _options.check_ids(doc_ids, len(y), "doc_ids", "y"),
    )
    kw = {"reduction": reduction, "block_size": block_size, "method": method}
    return _contrastive.with_options(
        x, y, 1, options, logit_scale, axis_name=axis_name, scale_of=jnp.exp, **kw
    )
