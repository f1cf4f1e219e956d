"""Cached sparse (SPLADE-style) encoders: pooling, FLOPS and L1 regularisers, schedules.

A SPLADE encoder's representation of a text is a vocabulary-sized vector of
non-negative weights. Its regularisers are functions of the *whole batch* (the
FLOPS regulariser squares a mean over the batch), so with gradient caching they are
exact: the loss receives every row's cached ``[rows, vocab]`` weights at once.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from gc_jax._base import AxisName
from gc_jax.losses import _batch_terms
from gc_jax.losses._engine.precision import accumulation_dtype

Schedule = Callable[[jax.Array], jax.Array]
KINDS = ("flops", "l1")
POOLING = ("max", "sum")
ACTIVATIONS = ("relu", "log1p_relu")


def splade_pool(
    logits: jax.Array,
    mask: jax.Array | None = None,
    *,
    pooling_strategy: str = "max",
    activation_function: str = "relu",
    dtype: DTypeLike | None = jnp.bfloat16,
) -> jax.Array:
    """SPLADE's pooling of masked-LM logits into one vocabulary-sized weight vector.

    ``w_j = max over tokens t of mask_t * log(1 + relu(logits_tj))`` (SPLADE v2,
    Formal et al., 2021): every weight is non-negative, and a vocabulary entry that no
    token's logit makes positive is exactly 0. Padding tokens (``mask`` false) count as
    0, so a row with no tokens is the zero vector. sentence-transformers 6.2's
    ``SpladePooling`` options, under its names: ``pooling_strategy="sum"`` sums over
    the tokens instead (SPLADE v1); ``activation_function="log1p_relu"`` applies
    ``log1p`` twice, ``log(1 + log(1 + relu(logits)))`` (OpenSearch's SPLADE models,
    arXiv 2504.14839).

    Where tokens tie exactly for an entry's maximum, ``jnp.max`` splits the gradient
    equally among them (``torch.max`` gives it all to one): the same sum, spread
    differently over the tied tokens. Entries whose maximum is 0 get no gradient either
    way (``relu``'s derivative at 0 is 0).

    Computed in at least float32, then cast to ``dtype``: bfloat16 by default, so the
    encoder returns (and gc_jax caches) bfloat16 rows, half the memory of float32 for
    vocabulary-sized rows. It rounds every weight to 8 significant bits; the losses
    accumulate their dot products in float32 (see ``docs/recipes.md`` for what that
    costs in exactness). Pass ``dtype=None`` to keep the logits' dtype.

    Args:
      logits: the masked-LM head's logits, ``[..., tokens, vocab]``.
      mask: which tokens count, ``[..., tokens]`` (bool or 0/1), or None (all).
      pooling_strategy: ``"max"`` (default; SPLADE v2 and later) or ``"sum"`` (SPLADE
        v1) over the tokens.
      activation_function: ``"relu"`` (default: ``log1p(relu(logits))``) or
        ``"log1p_relu"`` (``log1p(log1p(relu(logits)))``).
      dtype: the representation's dtype (default bfloat16), or None.

    Returns:
      The weights, ``[..., vocab]``, non-negative.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import splade_pool
      >>> logits = jnp.array([[[2.0, -1.0, 0.0], [0.5, 3.0, -2.0], [9.0, 9.0, 9.0]]])
      >>> mask = jnp.array([[True, True, False]])
      >>> w = splade_pool(logits, mask, dtype=None)
      >>> [round(float(v), 3) for v in w[0]]  # log 3, log 4, 0: the padding's 9s are ignored
      [1.099, 1.386, 0.0]
      >>> w = splade_pool(logits, mask, pooling_strategy="sum", dtype=None)
      >>> [round(float(v), 3) for v in w[0]]  # log 3 + log 1.5, log 4, 0
      [1.504, 1.386, 0.0]
      >>> splade_pool(logits).dtype
      dtype(bfloat16)
    """
    if getattr(logits, "ndim", 0) < 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            "logits must be a float [..., tokens, vocab] array (a masked-LM head's output), "
            f"got {getattr(logits, 'shape', type(logits).__name__)}."
        )
    _check_choice(pooling_strategy, "pooling_strategy", POOLING)
    _check_choice(activation_function, "activation_function", ACTIVATIONS)
    wide = logits.astype(accumulation_dtype(logits))
    weights = jnp.log1p(jax.nn.relu(wide))
    if activation_function == "log1p_relu":
        weights = jnp.log1p(weights)
    if mask is not None:
        if getattr(mask, "shape", None) != logits.shape[:-1]:
            raise ValueError(
                f"mask must have the logits' shape without the vocabulary axis, "
                f"{logits.shape[:-1]}, got {getattr(mask, 'shape', mask)}."
            )
        weights = jnp.where(jnp.asarray(mask, bool)[..., None], weights, 0.0)
    pool = jnp.max if pooling_strategy == "max" else jnp.sum
    pooled = pool(weights, axis=-2)
    return pooled if dtype is None else pooled.astype(dtype)


def _check_choice(value: object, name: str, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


def _check_threshold(threshold: object, name: str) -> float | None:
    """``None``, or a non-negative count of non-zeros (a Python int or float)."""
    if threshold is None:
        return None
    ok = isinstance(threshold, numbers.Real) and not isinstance(threshold, bool)
    if not ok or not threshold >= 0:  # also refuses NaN
        raise ValueError(
            f"{name} must be None or a non-negative number of non-zero entries (rows with "
            f"at most that many are left out of the regulariser), got {threshold!r}; "
            f"e.g. {name}=3 (sentence-transformers' FlopsLoss threshold)."
        )
    return float(threshold)


def flops_regularizer(
    w: jax.Array, *, threshold: float | None = None, axis_name: AxisName | None = None
) -> jax.Array:
    """SPLADE's FLOPS regulariser: ``sum_j (mean_i |w_ij|)^2`` over the global batch.

    Paria et al. (2020), used by SPLADE (Formal et al., 2021) for queries and documents
    separately: the square of each vocabulary entry's mean weight over the batch, summed
    over the vocabulary. It approximates the expected number of floating-point
    operations of an inverted-index lookup, and it pushes down entries that are active
    for many texts more than rare ones. The mean is over the *whole* batch (every
    device's rows): the term is exact only when the loss sees the whole batch, as it
    does in gc_jax. Across devices each device sums its rows' ``|w|`` and one ``psum``
    of a vocabulary-sized vector adds them up (nothing row-sized is gathered).

    With ``threshold`` (sentence-transformers' ``FlopsLoss(threshold=)``, "l0
    masking", arXiv 2504.14839), rows with at most ``threshold`` non-zero entries
    are left out of the sums, and the means still divide by every row of the batch.

    Conventions: this takes ``|w|``, as Paria et al. and naver/splade; ST's
    ``FlopsLoss`` takes ``w``: the same on SPLADE's non-negative weights, gradients
    included (JAX differentiates ``|w|`` as 1 at ``w = 0``).

    Args:
      w: the representations, ``[rows, vocab]`` (any float dtype; summed in float32).
      threshold: None (every row counts), or rows with at most this many non-zero
        entries are left out.
      axis_name: the batch's axis inside ``shard_map``/``pmap`` (or a mesh axis under
        ``jit`` with ``jax.set_mesh``); None on one device or under ``jit`` over rows
        sharded with explicit axes (read from their types). ``w`` must be each
        device's own rows: passed replicated (``in_specs=P()``) inside a typed
        ``shard_map`` it raises; under ``pmap`` or ``shard_map(check_vma=False)``,
        where that cannot be seen, every device would count the rows as its own: the
        term of the batch repeated once per device, each device's gradient a share.

    Returns:
      The regulariser, a float32 scalar (the global value on every device, with the
      gradient of this device's share, as the other ``gc_jax.losses``).

    Raises:
      ValueError: on a batch of no rows (the mean would be NaN), or ``w`` replicated
        inside a typed ``shard_map`` with ``axis_name``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import flops_regularizer
      >>> w = jnp.array([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]])
      >>> float(flops_regularizer(w))  # (4/2)^2 + 0^2 + (2/2)^2
      5.0
      >>> float(flops_regularizer(w, threshold=1))  # row 2 left out: (1/2)^2 + (2/2)^2
      1.25
    """
    return _flops(w, threshold, axis_name)


def _flops(w, threshold, axis_name, names=("w", "threshold")):
    """:func:`flops_regularizer`; ``names``: the arguments' names, for the errors."""
    w = _batch_terms.rows_of(w, names[0])
    threshold = _check_threshold(threshold, names[1])
    acc = accumulation_dtype(w)

    def stats(_, w):
        kept = jnp.abs(w)
        if threshold is not None:
            active = jnp.sum(w != 0, axis=1) > threshold
            kept = jnp.where(active[:, None], kept, jnp.zeros((), w.dtype))
        return jnp.sum(kept, axis=0, dtype=acc), jnp.asarray(len(w), acc)

    term = lambda s: jnp.sum(jnp.square(s[0] / s[1]))
    return _batch_terms.run(stats, term, {names[0]: w}, axis_name)


def l1_regularizer(w: jax.Array, *, axis_name: AxisName | None = None) -> jax.Array:
    """The L1 regulariser: ``mean_i sum_j |w_ij|`` over the global batch.

    Each row's total weight, averaged over the batch (every device's rows). Unlike
    FLOPS it does not depend on how the batch's weights are spread over the vocabulary
    (Efficient SPLADE, Lassance and Clinchant, 2022, use it on queries). JAX
    differentiates ``|w|`` as 1 at ``w = 0`` (torch as 0); through SPLADE's ``relu``
    no gradient reaches the encoder from a zero weight either way.

    Args:
      w: the representations, ``[rows, vocab]``.
      axis_name: as :func:`flops_regularizer`.

    Returns:
      The regulariser, a float32 scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import l1_regularizer
      >>> float(l1_regularizer(jnp.array([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]])))
      3.0
    """
    return _l1(w, axis_name)


def _l1(w, axis_name, name="w"):
    w = _batch_terms.rows_of(w, name)
    acc = accumulation_dtype(w)
    stats = lambda _, w: (jnp.sum(jnp.abs(w), dtype=acc), jnp.asarray(len(w), acc))
    return _batch_terms.run(stats, lambda s: s[0] / s[1], {name: w}, axis_name)


def quadratic_warmup(peak_value: float, warmup_steps: int) -> Schedule:
    """SPLADE's schedule of a regulariser's weight: ``peak * min(1, step / warmup_steps)^2``.

    SPLADE (Formal et al., 2021) raises the FLOPS weights quadratically from 0 over the
    first steps (50,000 in SPLADE v2), so that the representations first learn to rank,
    then to be sparse. An optax-style schedule: a function of the step count (an int
    or a traced integer, e.g. ``state.step``), usable wherever optax takes one. Any
    optax schedule works as a weight too (``optax.linear_schedule``,
    ``optax.constant_schedule``); none of optax's gives this curve
    (``optax.polynomial_schedule(power=2)`` is ``peak * (1 - (1 - t/T)^2)``, steep first).

    Args:
      peak_value: the weight from ``warmup_steps`` on.
      warmup_steps: steps to reach it (positive).

    Returns:
      ``schedule(step) -> weight``, float32.

    Examples:
      >>> from gc_jax.losses import quadratic_warmup
      >>> schedule = quadratic_warmup(1e-3, warmup_steps=100)
      >>> [round(float(schedule(t)), 6) for t in (0, 10, 50, 100, 1000)]
      [0.0, 1e-05, 0.00025, 0.001, 0.001]
    """
    if not isinstance(warmup_steps, numbers.Integral) or warmup_steps <= 0:
        raise ValueError(f"warmup_steps must be a positive int, got {warmup_steps!r}.")

    def schedule(step: jax.Array) -> jax.Array:
        frac = jnp.minimum(jnp.asarray(step, jnp.float32) / warmup_steps, 1.0)
        return peak_value * jnp.square(frac)

    return schedule


def sparse_regularizer(
    queries: jax.Array,
    docs: jax.Array,
    *,
    query_weight: float | Schedule,
    doc_weight: float | Schedule,
    step: jax.Array | int | None = None,
    query_kind: str = "flops",
    doc_kind: str = "flops",
    query_threshold: float | None = None,
    doc_threshold: float | None = None,
    axis_name: AxisName | None = None,
) -> jax.Array:
    """SPLADE's regularisation of both sides: ``lq(step) * R_q(queries) + ld(step) * R_d(docs)``.

    Each side has its own weight (a number, or a schedule of the step such as
    :func:`quadratic_warmup` or any optax schedule) and its own regulariser,
    ``"flops"`` (:func:`flops_regularizer`) or ``"l1"`` (:func:`l1_regularizer`).
    SPLADE v2 uses FLOPS on both with ``lq = 3e-4`` and ``ld = 1e-4`` (for instance),
    each warmed up quadratically. ``docs`` are every document row (positives and hard
    negatives), as SPLADE regularises them.

    Args:
      queries: ``[rows, vocab]``.
      docs: ``[rows', vocab]``.
      query_weight: the queries' weight, a number or ``schedule(step)``.
      doc_weight: the documents' weight, a number or ``schedule(step)``.
      step: the step count, for weights given as schedules (e.g. ``state.step``
        passed to the loss as a keyword of the train step).
      query_kind: ``"flops"`` or ``"l1"``.
      doc_kind: ``"flops"`` or ``"l1"``.
      query_threshold: with ``query_kind="flops"``, :func:`flops_regularizer`'s
        ``threshold`` for the queries (sentence-transformers'
        ``query_regularizer_threshold``), or None.
      doc_threshold: the same for the documents (``document_regularizer_threshold``).
      axis_name: as :func:`flops_regularizer`.

    Returns:
      The weighted sum, a float32 scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import quadratic_warmup, sparse_regularizer
      >>> q, d = jnp.array([[1.0, 0.0]]), jnp.array([[0.0, 2.0], [0.0, 2.0]])
      >>> reg = sparse_regularizer(q, d, query_weight=0.5, doc_weight=quadratic_warmup(1.0, 10),
      ...                          step=5, query_kind="l1")
      >>> float(reg)  # 0.5 * 1 + 0.25 * 4
      1.5
    """
    terms = []
    for name, rows, rows_name, weight, kind, threshold in (
        ("query", queries, "queries", query_weight, query_kind, query_threshold),
        ("doc", docs, "docs", doc_weight, doc_kind, doc_threshold),
    ):
        if kind not in KINDS:
            raise ValueError(f"{name}_kind must be one of {KINDS}, got {kind!r}.")
        if threshold is not None and kind != "flops":
            raise ValueError(
                f"{name}_threshold={threshold!r} applies to the FLOPS regulariser (rows with "
                f"at most that many non-zeros left out), got {name}_kind={kind!r}: pass "
                f"{name}_kind='flops', or leave {name}_threshold out."
            )
        if callable(weight):
            if step is None:
                raise ValueError(
                    f"{name}_weight is a schedule: pass step= (the step count, e.g. "
                    "state.step as a keyword of the train step), or a number as the weight."
                )
            weight = weight(step)
        if kind == "flops":
            reg = _flops(rows, threshold, axis_name, names=(rows_name, f"{name}_threshold"))
        else:
            reg = _l1(rows, axis_name, name=rows_name)
        terms.append(weight * reg)
    return terms[0] + terms[1]
