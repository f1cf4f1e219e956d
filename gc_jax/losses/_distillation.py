"""Embedding distillation: match a frozen teacher's embeddings, row by row."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses import _batch_terms

METRICS = ("squared_l2", "cosine")


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
      "cosine":                L = mean_i (1 - s_i . t_i / (|s_i| |t_i|))

    With unit-norm embeddings the two are proportional (``|s - t|^2 = 2 - 2 s . t``).
    The teacher's embeddings come with the batch (precomputed, or from a frozen model
    in the same step); no gradient reaches them. They must have the student's width:
    project one of them first otherwise (EmbedDistill learns a projection). Under
    ``gc_jax.losses.matryoshka`` pass the teacher among the ``argnums`` to truncate it
    with the student (a Matryoshka teacher's prefixes are embeddings too).

    Args:
      student: the student's embeddings, ``[rows, d]``.
      teacher: the teacher's embeddings of the same rows, ``[rows, d]``, split like
        ``student`` across devices.
      metric: ``"squared_l2"`` or ``"cosine"``.
      axis_name: the batch's axis inside ``shard_map``/``pmap`` (or a mesh axis under
        ``jit`` with ``jax.set_mesh``); None on one device or under ``jit`` over rows
        sharded with explicit axes.

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
    acc = _batch_terms.accumulation_dtype(student, teacher)

    def stats(s, t):
        s, t = s.astype(acc), jax.lax.stop_gradient(t).astype(acc)
        if metric == "squared_l2":
            per_row = jnp.sum(jnp.square(s - t), axis=1)
        else:
            dots = jnp.sum(s * t, axis=1)
            norms = jnp.linalg.norm(s, axis=1) * jnp.linalg.norm(t, axis=1)
            per_row = 1.0 - dots / jnp.maximum(norms, 1e-12)
        return jnp.sum(per_row), jnp.asarray(len(s), acc)

    return _batch_terms.run(stats, lambda s: s[0] / s[1], (student, teacher), axis_name)
