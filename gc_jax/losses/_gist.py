"""sentence-transformers' ``GISTEmbedLoss``, block for block: :func:`gist_loss`."""

from __future__ import annotations

import jax

from gc_jax._base import AxisName
from gc_jax.losses import _common, _contrastive, _docs, _options


@_docs.shared_docs
def gist_loss(
    x: jax.Array,
    y: jax.Array,
    guide: tuple[jax.Array, jax.Array],
    *,
    temperature: float | jax.Array = 0.01,
    margin_strategy: str = "absolute",
    margin: float | jax.Array = 0.0,
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
    docs_per_query: int | None = None,
    reduction: str = "mean",
    block_size: int | None = None,
    axis_name: AxisName | None = None,
    method: str = "auto",
) -> jax.Array:
    """GISTEmbed's loss as sentence-transformers 6.2's ``GISTEmbedLoss`` computes it.

    Each query ``x_i`` is scored, in one softmax, against every document (its positive
    ``p_i`` the target), against every query (``contrast_anchors``) and, from its
    positive ``p_i``, against every positive (``contrast_positives``). A frozen guide
    drops every pair it scores above ``t_i - margin`` (``"absolute"``) or
    ``t_i - |t_i| * margin`` (``"relative"``), where ``t_i = g(x_i, p_i)`` is its score of
    the positive pair; only ``(x_i, p_i)`` itself is never dropped.

    As in sentence-transformers, self pairs (``x_i . x_i``, ``p_i . p_i``) are dropped
    only by that threshold, and the positive-positive block holds no hard negative.
    ``contrastive_loss(directions=("query_to_doc", "query_to_query", "doc_to_doc"),
    guide=...)`` differs on both: GTE's directions always drop the self pairs, and its
    ``doc_to_doc`` scores each positive against the other queries' hard negatives too.

    Args:
      x: queries (anchors), ``[n, d]``.
      y: documents, ``[n * k, d]``: each query's positive, then its ``k - 1`` hard
        negatives.
      guide: ``(guide_x, guide_y)``, the guide model's representations of the rows of
        ``x`` and ``y`` (no gradient): ``g`` is their dot product, so normalise them
        for sentence-transformers' cosine.
      temperature: logits are ``x @ y.T / temperature`` (sentence-transformers'
        default 0.01); normalise ``x`` and ``y`` for its cosine.
      margin_strategy: ``"absolute"`` or ``"relative"``.
      margin: the guide's margin (0: drop what the guide scores above the positive).
      contrast_anchors: score queries against queries.
      contrast_positives: score positives against positives.
      docs_per_query: ``k``, the rows of ``y`` per query (default ``len(y) //
        len(x)``); required when ``k > 1`` under ``pmap`` and
        ``shard_map(check_vma=False)`` (see :func:`contrastive_loss`).
      {shared args}

    Returns:
      {shared returns}

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import gist_loss
      >>> unit = lambda v: v / jnp.linalg.norm(v, axis=-1, keepdims=True)
      >>> rows = jnp.arange(24.0).reshape(6, 4)
      >>> q, d = unit(jnp.sin(rows)), unit(jnp.cos(rows))
      >>> loss = gist_loss(q, d, (q, d), temperature=0.05, margin=0.1)
      >>> bool(jnp.allclose(loss, gist_loss(q, d, (q, d), temperature=0.05, margin=0.1,
      ...                                   block_size=4)))
      True
    """
    block_size, method = _common.check_options(reduction, block_size, method)
    _common.check_pair(x, y, multiple=True)
    _options.real_scalar(temperature, "temperature")
    k = _common.docs_per_query(len(x), len(y), docs_per_query, axis_name)
    if guide is None:
        raise ValueError(
            "gist_loss needs guide=(guide_x, guide_y), the guide model's representations "
            "of the rows of x and y; without a guide use contrastive_loss."
        )
    blocks = ("query_to_doc",)
    blocks += ("gist_query_to_query",) if contrast_anchors else ()
    blocks += ("gist_doc_to_doc",) if contrast_positives else ()
    checked = _options.check_guide(guide, x, y)
    options = _options.Options(
        directions=blocks,
        guide=checked,
        margin_strategy=margin_strategy,
        margin=_options.check_margin(margin, margin_strategy, checked),
    )
    return _contrastive.with_options(
        x, y, k, options, temperature, reduction=reduction, block_size=block_size,
        method=method, axis_name=axis_name,
    )  # fmt: skip
