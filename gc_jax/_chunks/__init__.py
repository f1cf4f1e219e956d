"""The chunk plans, one module per kind of ``chunk_size``.

* :mod:`~gc_jax._chunks.rows`: an int, chunks of rows (``ChunkPlan``);
* :mod:`~gc_jax._chunks.budget`: a :class:`gc_jax.TokenBudget`, rows grouped into
  bucket lengths (``TokenPlan``), planned by :mod:`~gc_jax._chunks.spans`;
* :mod:`~gc_jax._chunks.lines`: a :class:`gc_jax.TokenPacking`, rows packed into
  lines (``PackPlan``);
* :mod:`~gc_jax._chunks.token_rows`: what the two token kinds share (row lengths,
  argument checks, rows gathered and written by index).

Each kind's module holds its config class, its plan and its checks. The plan factory,
``gc_jax._chunks.plan``, is the one place that tells the kinds apart.
"""
