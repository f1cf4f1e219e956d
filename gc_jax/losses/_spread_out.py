"""The spread-out (global orthogonal) regulariser of a batch's embeddings."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses import _batch_terms
from gc_jax.losses._engine.precision import accumulation_dtype

VARIANTS = ("second_moment", "gor")


def spread_out_regularizer(
    x: jax.Array,
    *,
    variant: str = "second_moment",
    mean_weight: float | None = 1.0,
    second_moment_weight: float | None = 1.0,
    axis_name: AxisName | None = None,
) -> jax.Array:
    """The spread-out regulariser: pushes the batch's embeddings apart, towards orthogonal.

    Zhang, Yu, Kumar and Chang, "Learning Spread-out Local Feature Descriptors" (ICCV
    2017) observe that two points drawn uniformly on the unit sphere of ``R^d`` have an
    inner product of mean 0 and second moment ``1/d``, and match these moments over
    non-matching pairs. Over the ``N`` rows of the (global) batch, every pair ``i != j``
    non-matching::

      M1 = mean_{i != j} x_i . x_j
      M2 = mean_{i != j} (x_i . x_j)^2

      "second_moment" (default):  L = M2
      "gor":                      L = mean_weight * M1^2
                                      + second_moment_weight * max(0, M2 - 1/d)

    ``"gor"`` is Zhang et al.'s global orthogonal regularisation (GOR): the first
    moment squared plus a hinge on the second (confirmed against the authors' code,
    ``ColumbiaDVMM/Spread-out_Local_Feature_Descriptor``, where ``M1`` and ``M2`` are
    means over the batch's (anchor, non-matching) pairs), and sentence-transformers
    6.2's ``GlobalOrthogonalRegularizationLoss`` on one column, its term weights under
    its names (``None`` or 0 leaves a term out, as there; one must stay). EmbeddingGemma
    (Schechter Vera et al., 2025, arXiv 2509.20354) adds a spread-out term "based on
    GOR"; sentence-transformers reads it as ``mean_weight=0`` (the hinged second
    moment alone), summed over the queries and the positives. ``"second_moment"`` is
    ``M2`` without the hinge: the same gradient while ``M2 > 1/d``, and it keeps
    pushing below. With unit-norm rows both are dimensionless; ``x`` is used as given
    (normalise first for sentence-transformers' default cosine similarity).

    Computed, when the global batch has more rows than dimensions (``N > d``), from
    its Gram matrix ``G = sum_i x_i x_i^T`` (``d x d``), never from the ``N x N``
    similarities: ``sum_{i != j} (x_i . x_j)^2 = |G|_F^2 - sum_i |x_i|^4`` and
    ``sum_{i != j} x_i . x_j = |sum_i x_i|^2 - sum_i |x_i|^2``. Memory is ``d^2``
    whatever the batch (2.25 MiB of float32 at ``d = 768``), so the term needs no
    ``block_size`` or ring: across devices one ``psum`` of each device's ``G`` gives the
    global term exactly. With ``N > d`` rows cannot all be nearly orthogonal
    (``M2 >= (N/d - 1) / (N - 1)`` for unit rows), so the difference keeps float32's
    relative precision. With ``N <= d`` the pairs' products are summed directly
    (``N^2 d`` operations and ``N^2`` memory, at most the Gram form's ``N d^2`` and
    ``d^2``; across devices each device pairs its rows with every device's, gathered
    once: ``N d <= d^2`` values): exact for nearly orthogonal rows too, where the Gram
    form's difference would cancel. Use it on dense embeddings, not on
    vocabulary-sized rows (``d^2`` would be 3.5 GiB at 30,522).

    Args:
      x: the embeddings, ``[rows, d]`` (at least 2 rows in the global batch).
      variant: ``"second_moment"`` (``M2``) or ``"gor"``.
      mean_weight: ``"gor"``'s weight of ``M1^2`` (default 1; 0 or None: left out).
      second_moment_weight: ``"gor"``'s weight of ``max(0, M2 - 1/d)`` (default 1;
        0 or None: left out).
      axis_name: the batch's axis inside ``shard_map``/``pmap`` (or a mesh axis under
        ``jit`` with ``jax.set_mesh``); None on one device or under ``jit`` over rows
        sharded with explicit axes. ``x`` must be each device's own rows: passed
        replicated (``in_specs=P()``) inside a typed ``shard_map`` it raises; under
        ``pmap`` or ``shard_map(check_vma=False)``, where that cannot be seen, every
        device would count the rows as its own: the term of the batch repeated once
        per device (its copies' pairs included), each device's gradient a share.

    Returns:
      The regulariser, a float32 scalar (float64 for float64 rows): the global value on
      every device, with the gradient of this device's share.

    Raises:
      ValueError: on a global batch of one row (no pairs: the means would be NaN), an
        unknown ``variant``, or weights that are not non-negative numbers (or that
        ``"second_moment"`` does not take).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gc_jax.losses import spread_out_regularizer
      >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
      >>> naive = jnp.mean(jnp.array([0.0, 0.6, 0.8]) ** 2)  # the 3 pairs' products, squared
      >>> bool(jnp.isclose(spread_out_regularizer(x), naive))
      True
      >>> float(spread_out_regularizer(jnp.eye(4)))  # orthogonal rows: 0
      0.0
      >>> float(spread_out_regularizer(x, variant="gor", mean_weight=0.0))  # M2 = 1/3 < 1/d
      0.0
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}.")
    weights = _check_weights(variant, mean_weight, second_moment_weight)
    x = _batch_terms.rows_of(x, "x")
    acc = accumulation_dtype(x)
    dim = x.shape[1]

    def stats(axes, x):
        rows = len(x) * (1 if axes is None else jax.lax.axis_size(axes))
        return _pair_sums(axes, x, acc) if rows <= dim else _gram_sums(x, acc)

    def term(s):
        squares, products = _from_gram(s) if "gram" in s else (s["squares"], s["products"])
        pairs = s["rows"] * (s["rows"] - 1)
        m2 = squares / pairs
        if weights is None:
            return m2
        first, second = weights
        m1 = products / pairs
        return first * jnp.square(m1) + second * jax.nn.relu(m2 - 1.0 / dim)

    return _batch_terms.run(stats, term, {"x": x}, axis_name, min_rows=2)


def _check_weights(variant: str, mean_weight, second_moment_weight):
    """``"gor"``'s ``(mean_weight, second_moment_weight)`` as floats (None as 0), checked;
    None for ``"second_moment"``, which takes neither."""
    given = {"mean_weight": mean_weight, "second_moment_weight": second_moment_weight}
    if variant == "second_moment":
        for name, value in given.items():
            if not (isinstance(value, numbers.Real) and value == 1.0):
                raise ValueError(
                    f"{name}={value!r} weighs a term of variant='gor' (M1^2 and the hinge "
                    f"max(0, M2 - 1/d)); variant='second_moment' is M2 alone: pass "
                    f"variant='gor' (sentence-transformers' GOR), or scale the result."
                )
        return None
    checked = []
    for name, value in given.items():
        value = 0.0 if value is None else value
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not ok or not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"{name} must be a non-negative number (0 or None leaves its term out), "
                f"got {value!r}; e.g. {name}=1.0 (sentence-transformers' default)."
            )
        checked.append(float(value))
    if not any(checked):
        raise ValueError(
            f"mean_weight={mean_weight!r} and second_moment_weight={second_moment_weight!r} "
            "leave variant='gor' no term: give one of them a positive weight."
        )
    return tuple(checked)


def _gram_sums(x: jax.Array, acc) -> dict[str, jax.Array]:
    """This device's ``d x d`` Gram matrix and row sums (for any number of rows)."""
    norms = jnp.sum(jnp.square(x.astype(acc)), axis=1)
    return {
        "gram": jnp.matmul(x.T, x, preferred_element_type=acc),
        "sum": jnp.sum(x, axis=0, dtype=acc),
        "norm2": jnp.sum(norms),
        "norm4": jnp.sum(jnp.square(norms)),
        "rows": jnp.asarray(len(x), acc),
    }


def _from_gram(s: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The global batch's sums over its pairs ``i != j`` of ``(x_i . x_j)^2`` and of
    ``x_i . x_j``, from its Gram matrix and row sums."""
    squares = jnp.sum(jnp.square(s["gram"])) - s["norm4"]
    return squares, jnp.sum(jnp.square(s["sum"])) - s["norm2"]


def _pair_sums(axes, x: jax.Array, acc) -> dict[str, jax.Array]:
    """The same sums over this device's rows' pairs with every other row, directly.

    Each pair ``(i, j)`` is counted on ``i``'s device and on ``j``'s, so the sums over
    the devices are the sums over ordered pairs; the other rows enter without gradient,
    and each sum is differentiated twice over (its value once, its gradient twice): a
    pair's other half reaches ``x_i`` from ``j``'s device.
    """
    others, first = _batch_terms.gathered(axes, x)
    products = jnp.matmul(x, others.T, preferred_element_type=acc)  # [rows, global rows]
    self_pair = jnp.arange(others.shape[0])[None, :] == (first + jnp.arange(len(x)))[:, None]
    products = jnp.where(self_pair, jnp.zeros((), acc), products)
    twice = lambda s: 2 * s - jax.lax.stop_gradient(s)
    return {
        "squares": twice(jnp.sum(jnp.square(products))),
        "products": twice(jnp.sum(products)),
        "rows": jnp.asarray(len(x), acc),
    }
