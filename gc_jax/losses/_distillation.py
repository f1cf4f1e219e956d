"""Embedding distillation: match a frozen teacher's embeddings, row by row."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses import _batch_terms
from gc_jax.losses._engine.precision import accumulation_dtype

METRICS = ("squared_l2", "mse", "l2", "cosine")
COSINE_EPS = 1e-8  # torch.nn.functional.cosine_similarity's default


def embedding_distillation(
    student: jax.Array,
    teacher: jax.Array,
    *,
    metric: str = "squared_l2",
    axis_name: AxisName | None = None,
) -> jax.Array:
    """Distils a teacher's embedding space by matching its embeddings of the same texts.

    EmbeddingGemma's "geometric embedding distillation" (Schechter Vera et al., 2025,
    arXiv 2509.20354) trains the student's embeddings of the queries, the positive
    passages and the hard negatives to match those of a larger teacher (Gemini
    Embedding), rather than only its relevance scores: its distillation loss is a sum
    of one such term per kind of input, ``L_D = L_q + L_p+ + L_p-``. This follows
    EmbedDistill's embedding matching (Kim et al., 2023) and, as summaries of the paper
    describe it, an L2 distance; the per-row form is not given in what could be read
    while writing this, so this defines it as the mean over the (global) batch::

      "squared_l2" (default):  L = mean_i |s_i - t_i|^2
      "mse":                   L = mean_i |s_i - t_i|^2 / d   (mean over rows and dims)
      "l2":                    L = mean_i |s_i - t_i|         (not squared)
      "cosine":                L = mean_i (1 - cos(s_i, t_i))

    ``"mse"``, ``"l2"`` and ``"cosine"`` are sentence-transformers 6.2's
    ``EmbedDistillLoss(distance_metric=)`` on one column (``"l2"`` is EmbedDistill's
    distance; ST's ``MSELoss`` is ``"mse"``); ST averages over its columns where
    EmbeddingGemma sums its three terms. ``"cosine"`` follows
    ``torch.nn.functional.cosine_similarity``: ``s . t / (max(|s|, eps) max(|t|, eps))``
    with ``eps = 1e-8``, differentiated as torch does (the clamp without gradient, the
    norm's derivative 0 at 0): an all-zero student row gets the finite gradient
    ``-t / (|t| eps N)`` (large: it pushes the row off zero) rather than NaN. ``"l2"``
    is differentiated as 0 at ``s_i = t_i`` (as torch's norm).

    With unit-norm embeddings ``"squared_l2"`` and ``"cosine"`` are proportional
    (``|s - t|^2 = 2 - 2 s . t``). The teacher's embeddings come with the batch
    (precomputed, or from a frozen model in the same step); no gradient reaches them.
    They must have the student's width: project one of them first otherwise
    (EmbedDistill learns a projection, as ST's ``projection_dim=``). Under
    ``gc_jax.losses.matryoshka`` pass the teacher among the ``argnums`` to truncate it
    with the student (a Matryoshka teacher's prefixes are embeddings too).

    Args:
      student: the student's embeddings, ``[rows, d]``.
      teacher: the teacher's embeddings of the same rows, ``[rows, d]``, split like
        ``student`` across devices.
      metric: ``"squared_l2"``, ``"mse"``, ``"l2"`` or ``"cosine"``.
      axis_name: the batch's axis inside ``shard_map``/``pmap`` (or a mesh axis under
        ``jit`` with ``jax.set_mesh``); None on one device or under ``jit`` over rows
        sharded with explicit axes. Both inputs must be each device's own rows:
        passed replicated (``in_specs=P()``) inside a typed ``shard_map`` it raises;
        under ``pmap`` or ``shard_map(check_vma=False)``, where that cannot be seen,
        every device would count the rows as its own (each device's gradient a share).

    Returns:
      The loss, a float32 scalar (float64 for float64 rows): the global mean on every
      device, with the gradient of this device's share.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import embedding_distillation
      >>> s, t = jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.array([[0.0, 1.0], [0.0, 1.0]])
      >>> float(embedding_distillation(s, t))  # (2 + 0) / 2
      1.0
      >>> float(embedding_distillation(s, t, metric="cosine"))  # (1 + 0) / 2
      0.5
      >>> float(embedding_distillation(s, t, metric="mse"))  # (2 + 0) / (2 * 2)
      0.5
      >>> round(float(embedding_distillation(s, t, metric="l2")), 4)  # (sqrt(2) + 0) / 2
      0.7071
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}.")
    student = _batch_terms.rows_of(student, "student")
    teacher = _batch_terms.rows_of(teacher, "teacher")
    if student.shape != teacher.shape:
        raise ValueError(
            f"student and teacher must have the same shape [rows, d], got {student.shape} "
            f"and {teacher.shape}; project the teacher's embeddings to the student's width "
            "(or truncate a Matryoshka teacher) before the loss."
        )
    acc = accumulation_dtype(student, teacher)

    def stats(_, s, t):
        s, t = s.astype(acc), jax.lax.stop_gradient(t).astype(acc)
        per_row = _distance(metric, s, t)
        return jnp.sum(per_row), jnp.asarray(len(s), acc)

    rows = {"student": student, "teacher": teacher}
    return _batch_terms.run(stats, lambda s: s[0] / s[1], rows, axis_name)


def _distance(metric: str, s: jax.Array, t: jax.Array) -> jax.Array:
    """Each row's distance from its teacher row, ``[rows]``."""
    if metric == "squared_l2":
        return jnp.sum(jnp.square(s - t), axis=1)
    if metric == "mse":
        return jnp.mean(jnp.square(s - t), axis=1)
    if metric == "l2":
        return _norm(s - t)
    clamp = lambda n: n + jax.lax.stop_gradient(jnp.maximum(n, COSINE_EPS) - n)
    unit_s, unit_t = s / clamp(_norm(s))[:, None], t / clamp(_norm(t))[:, None]
    return 1.0 - jnp.sum(unit_s * unit_t, axis=1)


def _norm(v: jax.Array) -> jax.Array:
    """Each row's Euclidean norm, differentiated as 0 where it is 0 (as torch's)."""
    squares = jnp.sum(jnp.square(v), axis=1)
    positive = squares > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, squares, 1.0)), 0.0)
