"""InfoNCE with in-batch and hard negatives: :func:`contrastive_loss`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses import _bank, _common, _docs, _options
from gc_jax.losses._bank import Bank


@_docs.shared_docs
def contrastive_loss(
    x: jax.Array,
    y: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    directions: tuple[str, ...] = ("query_to_doc",),
    partition_mode: str = "joint",
    query_ids: jax.Array | None = None,
    doc_ids: jax.Array | None = None,
    guide: tuple[jax.Array, jax.Array] | None = None,
    margin_strategy: str = "absolute",
    margin: float | jax.Array = 0.0,
    docs_per_query: int | None = None,
    hardness_mode: str | None = None,
    hardness_strength: float | jax.Array = 0.0,
    bank: Bank | None = None,
    reduction: str = "mean",
    block_size: int | None = None,
    axis_name: AxisName | None = None,
    method: str = "auto",
) -> jax.Array:
    """InfoNCE of queries ``x`` against documents ``y``, with GTE's and GISTEmbed's options.

    ``y`` holds ``k = len(y) // len(x)`` rows per query: its positive first, then its
    hard negatives, so query ``i``'s positive is ``p_i = y[i * k]``. With
    ``s(a, b) = a . b / temperature``, query ``i``'s loss is::

      loss_i = log Z_i - s(x_i, p_i)
      Z_i =   sum_j         exp(s(x_i, y_j))   "query_to_doc"   (always)
            + sum_{e != i}  exp(s(x_i, x_e))   "query_to_query"
            + sum_e         exp(s(p_i, x_e))   "doc_to_query"
            + sum_{j not i} exp(s(p_i, y_j))   "doc_to_doc"

    every sum over the global batch (across devices), only the ``directions``
    chosen (default: ``query_to_doc`` alone, plain InfoNCE: every other row of
    ``y`` is a negative); ``j not i``: the documents of queries other than ``i``.
    ``partition_mode="per_direction"`` averages one InfoNCE per direction instead,
    ``loss_i = mean_D log Z_i^D - s(x_i, p_i)`` (for the directions that hold the
    positive pair: ``query_to_doc`` and ``doc_to_query``, symmetric InfoNCE). These
    are sentence-transformers 6.2's ``MultipleNegativesRankingLoss(directions=,
    partition_mode=)`` with ``scale = 1 / temperature``; GTE (Li et al., 2023) uses
    the four directions, joint.

    *False negatives* are removed from every sum (the positive pair itself, in
    ``query_to_doc`` and ``doc_to_query``, never is):

    * ``doc_ids``: every document with the id of ``p_i`` (a duplicate of the
      positive in the batch, or a hard negative that is the positive again), and
      every query whose positive has that id.
    * ``query_ids``: every query with the id of ``x_i`` (a duplicate query), and
      that query's positive.
    * ``guide``: every pair the guide model scores above its score of the positive
      pair, ``t_i = g(x_i, p_i)``, less a margin: ``g > t_i - margin``
      (``margin_strategy="absolute"``) or ``g > t_i - |t_i| * margin``
      (``"relative"``), as sentence-transformers 6.2's ``GISTEmbedLoss``. ``g`` is
      the dot product of the guide's representations: normalise them for its
      cosine. ``directions=("query_to_doc", "query_to_query", "doc_to_doc")`` is its
      default (contrasting anchors and positives); with hard negatives, its
      positive-positive term leaves them out where ``doc_to_doc`` contrasts them.

    Args:
      x: queries, ``[n, d]``.
      y: documents, ``[n * k, d]``.
      temperature: logits are ``x @ y.T / temperature``; may be a traced parameter.
      directions: the terms of the partition function (see above), a tuple of
        ``"query_to_doc"`` (required), ``"query_to_query"``, ``"doc_to_query"``
        and ``"doc_to_doc"``.
      partition_mode: ``"joint"`` (one partition function over every direction)
        or ``"per_direction"`` (one per direction, averaged).
      query_ids: an id per query, ``[n]`` or ``[n, w]`` integers (rows of ``w``
        words compare whole), e.g. :func:`text_ids` of its tokens; or None.
        Across devices, split like ``x``.
      doc_ids: an id per document, ``[n * k]`` or ``[n * k, w]``; or None. Across
        devices, split like ``y``.
      guide: ``(guide_x, guide_y)``, a frozen guide model's representations of the
        rows of ``x`` and ``y`` (``[n, g]``, ``[n * k, g]``, split like them across
        devices; no gradient reaches them), or None.
      margin_strategy: ``"absolute"`` or ``"relative"`` (with ``guide``).
      margin: the guide's margin (with ``guide``; ``0``: drop what it scores above
        the positive). It only moves the guide's thresholds: no gradient reaches it.
      docs_per_query: ``k``, the rows of ``y`` per query (default ``len(y) //
        len(x)``). Required, when ``k > 1``, under ``pmap`` and
        ``shard_map(check_vma=False)``, where this device's documents cannot be told
        from every device's passed replicated.
      hardness_mode: which negatives' logits gain ``hardness_strength * s_raw`` (their
        score before the temperature, not differentiated), as sentence-transformers
        6.2's ``MultipleNegativesRankingLoss``: ``"hard_negatives"`` (the query's own
        hard negatives; EmbeddingGemma's), ``"in_batch_negatives"`` (every other
        query's documents) or ``"all_negatives"`` (every document but the positive),
        in ``query_to_doc`` only; or None.
      hardness_strength: ``alpha`` above, ``>= 0`` (EmbeddingGemma uses 5 with hard
        negatives; Lan et al. 2025 use 9 in batch). May be a traced parameter, which
        is differentiated (``s_raw`` is not) but cannot be checked: a traced strength
        needs ``hardness_mode`` (without one it raises rather than be ignored).
      bank: a :class:`Bank` of earlier steps' queries and documents (ContAccum, MoCo),
        extra negatives without gradient: ``query_to_doc`` and ``doc_to_doc`` also
        sum over the bank's documents, ``query_to_query`` and ``doc_to_query`` over
        its queries. The ids mask its entries as they mask the batch's (the bank then
        holds ids); empty slots are masked out. Across devices, split like ``x``.
        None: no bank. See :func:`init_bank` and :doc:`/recipes`.
      {shared args}

    Returns:
      {shared returns}

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gc_jax.losses import contrastive_loss
      >>> q = jnp.array([[1.0, 0.0], [0.0, 1.0]])
      >>> float(contrastive_loss(q, q, temperature=0.1)) < 1e-4
      True
      >>> x, y = jnp.sin(jnp.arange(80.0)).reshape(2, 10, 4)
      >>> blockwise = jax.jit(contrastive_loss, static_argnames="block_size")
      >>> bool(jnp.allclose(blockwise(x, y, block_size=3), contrastive_loss(x, y)))
      True

      bfloat16 rows: a float32 loss, bfloat16 gradients.

      >>> value, grad = jax.jit(jax.value_and_grad(contrastive_loss))(x.astype(jnp.bfloat16), y)
      >>> value.dtype, grad.dtype
      (dtype('float32'), dtype(bfloat16))

      Under ``shard_map`` with a learnable temperature: the loss and the temperature's
      gradient are replicated, each device gets its rows' gradients.

      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> def step(x, y, t):
      ...     loss = lambda x, y, t: contrastive_loss(x, y, temperature=t, axis_name="data")
      ...     return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, y, t)
      >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data"), P()),
      ...                           out_specs=(P(), (P("data"), P("data"), P()))))
      >>> x, y = jnp.sin(jnp.arange(16.0 * jax.device_count())).reshape(2, -1, 4)
      >>> rows = NamedSharding(mesh, P("data"))
      >>> got = f(jax.device_put(x, rows), jax.device_put(y, rows), 0.5)
      >>> full = lambda x, y, t: contrastive_loss(x, y, temperature=t)
      >>> want = jax.jit(jax.value_and_grad(full, argnums=(0, 1, 2)))(x, y, 0.5)
      >>> jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-6)), got, want))
      True

      The ring form: ``y``'s blocks travel around the devices, nothing is gathered.

      >>> def ring(x, y, t):
      ...     return contrastive_loss(x, y, temperature=t, axis_name="data", method="ring")
      >>> f = jax.jit(jax.shard_map(jax.value_and_grad(ring, argnums=(0, 1, 2)), mesh=mesh,
      ...     in_specs=(P("data"), P("data"), P()), out_specs=(P(), (P("data"), P("data"), P()))))
      >>> got = f(jax.device_put(x, rows), jax.device_put(y, rows), 0.5)
      >>> jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-6)), got, want))
      True

      GTE's improved contrastive loss, duplicates masked by the ids of their tokens
      (documents 0 and 2 are one text): a smaller partition function, a smaller loss.

      >>> from gc_jax.losses import text_ids
      >>> tokens = jnp.array([[5, 6, 0], [7, 8, 9], [5, 6, 0], [1, 2, 0]])
      >>> ids = text_ids(tokens, attention_mask=tokens != 0)
      >>> q, d = jnp.sin(jnp.arange(32.0)).reshape(2, 4, 4)
      >>> gte = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
      >>> plain = contrastive_loss(q, d, temperature=0.1, directions=gte)
      >>> masked = contrastive_loss(q, d, temperature=0.1, directions=gte, doc_ids=ids)
      >>> bool(masked < plain)
      True
      >>> tiled = contrastive_loss(q, d, temperature=0.1, directions=gte, doc_ids=ids, block_size=3)
      >>> bool(jnp.allclose(masked, tiled))
      True

      GISTEmbed: a frozen guide drops the negatives it scores above the positive.
      Its representations come from a forward-only chunked pass (no gradient, no
      activations kept for a backward), in one jitted step with the student's
      gradient-cached one; the ids and the guide's rows reach the loss as keyword
      arguments of the step.

      >>> import optax, gc_jax
      >>> student = lambda w, x, key: jnp.tanh(x @ w)
      >>> def guide(w, x, key):
      ...     g = x @ w
      ...     return g / jnp.linalg.norm(g, axis=-1, keepdims=True)  # cosine scores
      >>> encode_guide = gc_jax.chunked_encoder(guide, chunk_size=4)
      >>> gist = ("query_to_doc", "query_to_query", "doc_to_doc")
      >>> def loss(w, q, d, guide_reps):
      ...     return contrastive_loss(q, d, temperature=0.05, directions=gist,
      ...                             guide=guide_reps, margin=0.05)
      >>> step = gc_jax.make_train_step(loss, student, chunk_size=4, optimizer=optax.sgd(0.1))
      >>> @jax.jit
      ... def train(state, guide_w, q, d):
      ...     guide_w = jax.lax.stop_gradient(guide_w)  # frozen
      ...     reps = (encode_guide(guide_w, q), encode_guide(guide_w, d))
      ...     return step(state, q, d, guide_reps=reps)
      >>> w, guide_w = jnp.eye(4) + 0.1, jnp.eye(4)[::-1] + 0.2
      >>> q, d = jnp.sin(jnp.arange(64.0)).reshape(2, 8, 4)
      >>> (w, opt_state), metrics = train((w, optax.sgd(0.1).init(w)), guide_w, q, d)
      >>> bool(metrics["is_finite"])
      True
    """
    block_size, method = _common.check_options(reduction, block_size, method)
    _common.check_pair(x, y, multiple=True)
    _options.real_scalar(temperature, "temperature")
    k = _common.docs_per_query(len(x), len(y), docs_per_query, axis_name)
    options = _options.Options(
        _options.check_directions(directions, partition_mode),
        partition_mode,
        _options.check_ids(query_ids, len(x), "query_ids", "x"),
        _options.check_ids(doc_ids, len(y), "doc_ids", "y"),
        _options.check_guide(guide, x, y),
        margin_strategy,
        _options.check_margin(margin, margin_strategy, guide),
        hardness_mode,
        _options.check_hardness(hardness_mode, hardness_strength),
    )
    bank = _bank.check_bank(bank, x, y, k, options)
    count = None
    if bank is not None:
        options, count = options._replace(bank=bank._replace(count=None)), bank.count
    kw = {"reduction": reduction, "method": method, "axis_name": axis_name}
    return with_options(x, y, k, options, temperature, block_size=block_size, count=count, **kw)


def with_options(
    x, y, k, options, temperature, *, reduction, block_size, method, axis_name, count=None,
    scale_of=lambda temperature: 1.0 / temperature,
):  # fmt: skip
    """InfoNCE over the families of checked ``options`` (``_options.spec``), in any form.

    ``count``: the bank's count (its slots filled), with ``options.bank``. ``scale_of``:
    the logits' multiplier from ``temperature`` (``clip_loss`` passes a log scale).
    """
    kw = {"reduction": reduction, "method": method, "axis_name": axis_name}
    spec = _options.spec(options, k)

    def local_options(x, y, temperature, margin, alpha, *count, per_row, axis_name, ring):
        opts = options._replace(margin=margin, hardness_strength=alpha).with_rows(per_row)
        if count:  # the bank's count travels as a scalar
            opts = opts._replace(bank=opts.bank._replace(count=count[0]))
        scale, where = scale_of(temperature), _common.Where(block_size, axis_name, ring)
        losses = _common.dispatch(spec, x, y, (scale, None), where, opts)
        rows = len(x) * _common.num_devices(axis_name)
        return _common.reduce(losses, rows, reduction, axis_name)

    sides = (y, x) if any(f.cols == "x" for f in spec.families) else (y,)
    sides += () if options.guide is None else options.guide
    scalars = (temperature, options.margin, jnp.asarray(options.hardness_strength, float))
    if options.bank is not None:
        sides += _bank.columns(options.bank)
        scalars += (jax.lax.stop_gradient(count),)
    per_row = options.per_row()
    return _common.run(local_options, x, y, scalars, sides=sides, per_row=per_row, **kw)
