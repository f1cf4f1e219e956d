"""Multi-vector late interaction (ColBERT's MaxSim) with InfoNCE: :func:`maxsim_loss`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gc_jax._base import AxisName
from gc_jax.losses import _common, _docs, _options
from gc_jax.losses._engine.precision import accumulation_dtype
from gc_jax.losses._engine.scores import MaxSim, Side
from gc_jax.losses._engine.strategies import Softmax


@_docs.shared_docs
def maxsim_loss(
    q: jax.Array,
    d: jax.Array,
    *,
    q_mask: jax.Array | None = None,
    d_mask: jax.Array | None = None,
    temperature: float | jax.Array = 1.0,
    docs_per_query: int | None = None,
    reduction: str = "mean",
    block_size: int | None = None,
    axis_name: AxisName | None = None,
    method: str = "auto",
) -> jax.Array:
    """InfoNCE over ColBERT-style MaxSim scores of multi-vector queries and documents.

    Each row is a set of token vectors: ``q`` is ``[n, T, dim]``, ``d`` is
    ``[n * k, S, dim]``, with ``k`` documents per query (its positive first, then its
    hard negatives, as in :func:`contrastive_loss`). The score of query ``i`` and
    document ``j`` sums, over the query's tokens, the best match among the document's
    tokens (masked tokens take no part; a document with no token scores -1e9, out of
    every softmax, as in sentence-transformers)::

      s(i, j) = sum_{t : q_mask[i, t]} max_{u : d_mask[j, u]} q[i, t] . d[j, u]
      loss_i  = logsumexp_j s(i, j) / temperature - s(i, i * k) / temperature

    the sum over ``j`` running over every document of the global batch. The gradient
    of a max goes to the document token holding it (split evenly between ties, as
    ``jnp.max`` differentiates).

    With ``block_size`` the ``[B, B]`` scores are never held: a ``block_size x
    block_size`` tile of them, from ``block_size**2 x T x S`` token similarities, is
    computed at a time, forward and backward (a custom VJP recomputes the tiles), so
    memory grows with ``B * T * dim`` plus one tile. Without it the dense form holds the
    ``[B, B, T, S]`` similarities: for small batches and tests only. Across devices
    the ring form passes the documents' blocks (tokens and masks) around the devices.

    Args:
      q: query token vectors, ``[n, T, dim]`` (normalise them yourself, as ColBERT does).
      d: document token vectors, ``[n * k, S, dim]``.
      q_mask: which query tokens count, ``[n, T]`` bool or integer (nonzero: a token),
        e.g. the attention mask; None: every token.
      d_mask: which document tokens count, ``[n * k, S]``, likewise.
      temperature: logits are ``s(i, j) / temperature``; may be a traced parameter.
      docs_per_query: ``k``, the documents per query (default ``len(d) // len(q)``);
        required when ``k > 1`` under ``pmap`` and ``shard_map(check_vma=False)``
        (see :func:`contrastive_loss`).
      {shared args}

    Returns:
      {shared returns}

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gc_jax.losses import maxsim_loss
      >>> q = jnp.sin(jnp.arange(96.0)).reshape(4, 3, 8)   # 4 queries of 3 tokens
      >>> d = jnp.cos(jnp.arange(160.0)).reshape(4, 5, 8)  # 4 documents of 5 tokens
      >>> q_mask = jnp.array([[1, 1, 0]] * 4)              # the last query token is padding
      >>> dense = maxsim_loss(q, d, q_mask=q_mask, temperature=0.5)
      >>> blockwise = jax.jit(maxsim_loss, static_argnames="block_size")
      >>> got = blockwise(q, d, q_mask=q_mask, temperature=0.5, block_size=3)
      >>> bool(jnp.allclose(got, dense))
      True

      The score written out: the dense loss is InfoNCE of these logits.

      >>> sims = jnp.einsum("itc,jsc->ijts", q, d)
      >>> s = jnp.where(q_mask[:, None, :], sims.max(-1), 0).sum(-1)
      >>> want = jnp.mean(jax.nn.logsumexp(s / 0.5, 1) - jnp.diag(s) / 0.5)
      >>> bool(jnp.allclose(dense, want))
      True

      bfloat16 token vectors: a float32 loss, bfloat16 gradients.

      >>> grad = jax.grad(maxsim_loss)(q.astype(jnp.bfloat16), d)
      >>> grad.dtype
      dtype(bfloat16)
    """
    block_size, method = _common.check_options(reduction, block_size, method)
    _check_tokens(q, d)
    _options.real_scalar(temperature, "temperature")
    k = _common.docs_per_query(len(q), len(d), docs_per_query, axis_name, names=("q", "d"))
    x = Side(q, _mask(q_mask, q, "q_mask", "q"))
    y = Side(d, _mask(d_mask, d, "d_mask", "d"))

    def local(x, y, temperature, *, per_row, axis_name, ring):
        acc = accumulation_dtype(x.tokens, y.tokens, temperature)
        scale = jnp.asarray(1.0 / temperature, acc)
        spec = _options.one_spec(Softmax, _options.Options(), k, MaxSim)
        where = _common.Where(block_size, axis_name, ring)
        losses = _common.dispatch(spec, x, y, (scale, None), where)
        rows = len(x.tokens) * _common.num_devices(axis_name)
        return _common.reduce(losses, rows, reduction, axis_name)

    kw = {"reduction": reduction, "method": method, "axis_name": axis_name}
    return _common.run(local, x, y, (temperature,), sides=tuple(y), **kw)


def _check_tokens(q: Any, d: Any) -> int:
    """Checks ``q`` and ``d`` are ``[rows, tokens, dim]`` alike; returns ``k``."""
    for name, v in (("q", q), ("d", d)):
        if getattr(v, "ndim", None) != 3:
            raise ValueError(
                f"{name} must be a 3-D [rows, tokens, dim] array of token vectors, got shape "
                f"{getattr(v, 'shape', v)}; for one vector per row use contrastive_loss."
            )
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{name} must hold floats, got {v.dtype}.")
    if q.shape[2] != d.shape[2]:
        raise ValueError(
            f"q and d must have the same token dim (axis 2), got q: {q.shape} and d: {d.shape}."
        )
    if d.shape[0] % q.shape[0]:
        raise ValueError(
            f"len(d) must be a multiple of len(q) (k documents per query: its positive, then "
            f"hard negatives), got len(q)={q.shape[0]}, len(d)={d.shape[0]}."
        )
    return d.shape[0] // q.shape[0]


def _mask(mask: Any, tokens: jax.Array, name: str, of: str) -> jax.Array:
    """``mask`` as bool ``[rows, tokens]`` (None: every token), checked against ``tokens``."""
    if mask is None:
        return jnp.ones_like(tokens[..., 0], bool)  # typed like the tokens (mesh, vma)
    if getattr(mask, "shape", None) != tokens.shape[:2]:
        raise ValueError(
            f"{name} must be a [rows, tokens] mask of {of}'s tokens, shape {tokens.shape[:2]}, "
            f"got shape {getattr(mask, 'shape', mask)}."
        )
    dtype = jnp.asarray(mask).dtype
    if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(
            f"{name} must be bool or integer (nonzero: a token), got {dtype}; pass e.g. the "
            f"attention mask, or {name}.astype(bool) for a float 0/1 mask."
        )
    return jnp.asarray(mask) != 0
