"""Row-wise contrastive losses computed tile by tile, never holding the full logit matrix.

Every query row ``i`` of ``x`` is scored against every row ``j`` of ``ys`` with logit
``z[i, j] = scale * x[i] @ ys[j] + bias``. The logits are visited in
``block_size x block_size`` tiles: ``lax.map`` over blocks of queries, ``lax.scan``
over blocks of ``ys``, so memory is one tile plus ``O((n + m) * d)``, whatever ``n``
and ``m``. Rows are padded up to a whole number of blocks and padded columns masked.

*Online log-sum-exp* (softmax losses): a query row keeps a running maximum ``mx`` and
a running ``se = sum(exp(z - mx))``; a new tile with maximum ``mx'`` rescales
``se`` by ``exp(mx - mx')`` before adding its own terms, and after the last tile
``lse = mx + log(se)``, exactly and stably.

*Custom VJP*: letting autodiff differentiate the scan would save every tile. Instead
the forward saves only the inputs and one statistic per row (the LSE), and the
backward recomputes each tile's logits to form ``dz = g * dloss/dz`` (``softmax - 1
at the target`` for softmax, ``sigmoid(z) - label`` for sigmoid). It sweeps twice:
over query blocks for ``dx``, ``dscale = sum(dz * x @ ys.T)`` and ``dbias = sum(dz)``,
and over key blocks for ``dys``, so that no batch-sized gradient is carried across
blocks. Gathering ``ys`` across devices happens outside, so its transpose (a
reduce-scatter) is left to JAX.

*Precision*: tiles, per-row statistics and per-block gradients are computed in the
*accumulation dtype*, the inputs' dtype widened to at least float32 (the scalars'
dtype). ``x`` and ``ys`` are never cast whole: bfloat16 or float16 rows stay narrow,
each tile's product is accumulated in float32 (``preferred_element_type``), and the
gradients of ``x`` and ``ys`` come back in their own dtypes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from gc_jax import _distributed

Rows = tuple[jax.Array, ...]
Kind = type  # _Softmax or _Sigmoid: how a row's loss and its logit gradient are formed
Scalar = jax.Array


class _Softmax:
    """Per row: ``-log softmax(z)[target] = lse(z) - z[target]``."""

    @staticmethod
    def init(rows: int, dtype: Any) -> Rows:
        """Running max, running sum of ``exp(z - max)``, and the target's logit."""
        return (
            jnp.full((rows,), -jnp.inf, dtype),
            jnp.zeros((rows,), dtype),
            jnp.zeros((rows,), dtype),
        )

    @staticmethod
    def update(carry: Rows, z: jax.Array, valid: jax.Array, pos: jax.Array) -> Rows:
        mx, se, target = carry
        z_valid = jnp.where(valid, z, -jnp.inf)
        new_mx = jnp.maximum(mx, z_valid.max(axis=1))
        se = se * jnp.exp(mx - new_mx) + jnp.exp(z_valid - new_mx[:, None]).sum(axis=1)
        return new_mx, se, target + jnp.where(pos, z, 0).sum(axis=1)

    @staticmethod
    def finish(carry: Rows) -> tuple[jax.Array, jax.Array]:
        """The per-row losses and the statistic the backward needs (the LSE)."""
        mx, se, target = carry
        lse = mx + jnp.log(se)
        return lse - target, lse

    @staticmethod
    def dlogits(z: jax.Array, valid: jax.Array, pos: jax.Array, lse: jax.Array) -> jax.Array:
        return jnp.where(valid, jnp.exp(z - lse[:, None]), 0) - pos


class _Sigmoid:
    """Per row: ``sum_j -log sigmoid(label_ij * z_ij)``, label ``+1`` at the target only."""

    @staticmethod
    def init(rows: int, dtype: Any) -> Rows:
        return (jnp.zeros((rows,), dtype),)

    @staticmethod
    def update(carry: Rows, z: jax.Array, valid: jax.Array, pos: jax.Array) -> Rows:
        terms = jax.nn.softplus(jnp.where(pos, -z, z))  # -log sigmoid(label * z)
        return (carry[0] + jnp.where(valid, terms, 0).sum(axis=1),)

    @staticmethod
    def finish(carry: Rows) -> tuple[jax.Array, jax.Array]:
        return carry[0], carry[0]  # the backward needs no statistic

    @staticmethod
    def dlogits(z: jax.Array, valid: jax.Array, pos: jax.Array, _: jax.Array) -> jax.Array:
        return jnp.where(valid, jnp.where(pos, -jax.nn.sigmoid(-z), jax.nn.sigmoid(z)), 0)


def _blocks(v: jax.Array, size: int) -> jax.Array:
    """``v``'s rows padded to a multiple of ``size`` and stacked as ``[-1, size, ...]``."""
    pad = -v.shape[0] % size
    v = jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1))
    return v.reshape(-1, size, *v.shape[1:])


def _unblock(v: jax.Array, rows: int) -> jax.Array:
    return v.reshape(-1, *v.shape[2:])[:rows]


def _tile(
    xq: jax.Array,
    yk: jax.Array,
    targets: jax.Array,
    start: jax.Array,
    m: int,
    scale: Scalar,
    bias: Scalar,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One tile: raw scores ``xq @ yk.T`` (in ``scale``'s dtype), logits, real columns, targets."""
    raw = jnp.matmul(xq, yk.T, preferred_element_type=scale.dtype)
    cols = start + jnp.arange(yk.shape[0])
    return raw, scale * raw + bias, (cols < m)[None, :], cols[None, :] == targets[:, None]


def _sizes(block: int, x: jax.Array, ys: jax.Array) -> tuple[int, int]:
    return min(block, x.shape[0]), min(block, ys.shape[0])


def _varying_like(tree: Any, *others: jax.Array) -> Any:
    """Casts ``tree``'s leaves to vary over every ``shard_map`` axis ``others`` vary over.

    Scan carries must keep their types, and the custom VJP's cotangents must have the
    types of its inputs: a replicated scalar used with per-device rows is cast outside
    the custom VJP, and gets its (psummed) gradient through the cast.
    """
    vma = frozenset().union(*map(_distributed.varying_axes, others))

    def cast(v):
        missing = tuple(vma - set(_distributed.varying_axes(v)))
        return jax.lax.pcast(v, missing, to="varying") if missing else v

    return jax.tree.map(cast, tree)


def _zeros(shape: tuple, dtype: Any, *like: jax.Array) -> jax.Array:
    return _varying_like(jnp.zeros(shape, dtype), *like)


def _forward(
    kind: Kind,
    block: int,
    x: jax.Array,
    ys: jax.Array,
    targets: jax.Array,
    scale: Scalar,
    bias: Scalar,
) -> tuple[jax.Array, jax.Array]:
    """Per-row losses and statistics: ``lax.map`` over query blocks, ``scan`` over ``ys``."""
    bq, bk = _sizes(block, x, ys)
    keys = (_blocks(ys, bk), jnp.arange(-(-ys.shape[0] // bk)) * bk)

    def query_block(args):
        xq, tq = args

        def step(carry, key):
            yk, start = key
            _, z, valid, pos = _tile(xq, yk, tq, start, ys.shape[0], scale, bias)
            return kind.update(carry, z, valid, pos), None

        init = _varying_like(kind.init(bq, scale.dtype), x, ys)
        return kind.finish(jax.lax.scan(step, init, keys)[0])

    loss, stat = jax.lax.map(query_block, (_blocks(x, bq), _blocks(targets, bq)))
    return _unblock(loss, x.shape[0]), _unblock(stat, x.shape[0])


def _backward(
    kind: Kind,
    block: int,
    x: jax.Array,
    ys: jax.Array,
    targets: jax.Array,
    scale: Scalar,
    bias: Scalar,
    stat: jax.Array,
    g: jax.Array,
) -> tuple[jax.Array, jax.Array, Scalar, Scalar]:
    """Cotangents of ``x, ys, scale, bias`` for per-row cotangents ``g``, tile by tile.

    Two sweeps recompute every tile's ``dz``: one over query blocks sums each block's
    ``dx`` (and the scalars' gradients) over the key blocks, one over key blocks sums
    each block's ``dy`` over the query blocks. Each block's gradient is accumulated in
    ``scale``'s dtype and written in its input's dtype, so no batch-sized array ever
    exists in a wider dtype than the inputs'.
    """
    bq, bk = _sizes(block, x, ys)
    m, acc = ys.shape[0], scale.dtype
    queries = tuple(_blocks(v, bq) for v in (x, targets, stat, g))
    keys = (_blocks(ys, bk), jnp.arange(-(-m // bk)) * bk)

    def dlogits(xq, tq, sq, gq, yk, start):
        raw, z, valid, pos = _tile(xq, yk, tq, start, m, scale, bias)
        return raw, gq[:, None] * kind.dlogits(z, valid, pos, sq)

    def query_block(scalars, query):
        def step(carry, key):
            dxq, dscale, dbias = carry
            raw, dz = dlogits(*query, *key)
            dxq = dxq + jnp.matmul(dz, key[0], preferred_element_type=acc)
            return (dxq, dscale + (dz * raw).sum(), dbias + dz.sum()), None

        init = (_zeros((bq, x.shape[1]), acc, x, ys), *scalars)
        dxq, *scalars = jax.lax.scan(step, init, keys)[0]
        return tuple(scalars), (scale * dxq).astype(x.dtype)

    def key_block(key):
        def step(dyk, query):
            _, dz = dlogits(*query, *key)
            return dyk + jnp.matmul(dz.T, query[0], preferred_element_type=acc), None

        dyk = jax.lax.scan(step, _zeros((bk, ys.shape[1]), acc, x, ys), queries)[0]
        return (scale * dyk).astype(ys.dtype)

    zero = _zeros((), acc, x, ys)
    (dscale, dbias), dx = jax.lax.scan(query_block, (zero, zero), queries)
    dys = jax.lax.map(key_block, keys)
    return _unblock(dx, x.shape[0]), _unblock(dys, m), dscale, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rowwise(kind, block, x, ys, targets, scale, bias):
    """Per-row losses; the forward saves the inputs and one statistic per row."""
    return _forward(kind, block, x, ys, targets, scale, bias)[0]


def _rowwise_fwd(kind, block, x, ys, targets, scale, bias):
    loss, stat = _forward(kind, block, x, ys, targets, scale, bias)
    return loss, (x, ys, targets, scale, bias, stat)


def _rowwise_bwd(kind, block, res, g):
    x, ys, targets, scale, bias, stat = res
    dx, dys, dscale, dbias = _backward(kind, block, x, ys, targets, scale, bias, stat, g)
    return dx, dys, None, dscale, dbias


_rowwise.defvjp(_rowwise_fwd, _rowwise_bwd)


def accumulation_dtype(*values: Any) -> jnp.dtype:
    """The dtype losses are computed in: the values' common dtype, at least float32."""
    return jnp.promote_types(jnp.result_type(*values), jnp.float32)


def _call(
    kind: Kind,
    x: jax.Array,
    ys: jax.Array,
    targets: jax.Array,
    scale: float | jax.Array,
    bias: float | jax.Array,
    block_size: int,
) -> jax.Array:
    """Casts the scalars to the accumulation dtype, varying like the rows, then runs.

    ``x`` and ``ys`` keep their dtypes: only tiles are computed in the wider dtype.
    """
    acc = accumulation_dtype(x, ys, scale, bias)
    scale, bias = _varying_like((jnp.asarray(scale, acc), jnp.asarray(bias, acc)), x, ys)
    return _rowwise(kind, block_size, x, ys, targets, scale, bias)


def softmax_cross_entropy(
    x: jax.Array,
    ys: jax.Array,
    targets: jax.Array,
    scale: float | jax.Array,
    block_size: int,
) -> jax.Array:
    """Per-row ``-log softmax(scale * x @ ys.T)[i, targets[i]]``, blockwise.

    Args:
      x: queries, ``[n, d]``.
      ys: candidates, ``[m, d]``.
      targets: the index into ``ys`` of each query's positive, ``[n]`` ints.
      scale: logit multiplier (scalar, differentiable).
      block_size: rows per tile on either side.

    Returns:
      The per-query losses, ``[n]``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> x, ys = jnp.eye(3), jnp.eye(3)[::-1]
      >>> t = jnp.array([2, 1, 0])
      >>> dense = -jax.nn.log_softmax(2.0 * x @ ys.T)[jnp.arange(3), t]
      >>> bool(jnp.allclose(softmax_cross_entropy(x, ys, t, 2.0, block_size=2), dense))
      True
    """
    return _call(_Softmax, x, ys, targets, scale, 0.0, block_size)


def sigmoid_rows(
    x: jax.Array,
    ys: jax.Array,
    targets: jax.Array,
    scale: float | jax.Array,
    bias: float | jax.Array,
    block_size: int,
) -> jax.Array:
    """Per-row ``sum_j -log sigmoid(label_ij * (scale * x[i] @ ys[j] + bias))``, blockwise.

    ``label_ij`` is ``+1`` where ``j == targets[i]`` and ``-1`` elsewhere.

    Args:
      x: ``[n, d]``.
      ys: ``[m, d]``.
      targets: the index into ``ys`` of each row's positive, ``[n]`` ints.
      scale: logit multiplier (scalar, differentiable).
      bias: added to every logit (scalar, differentiable).
      block_size: rows per tile on either side.

    Returns:
      The per-row sums, ``[n]``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.eye(3)
      >>> labels = 2 * jnp.eye(3) - 1
      >>> dense = -jax.nn.log_sigmoid(labels * (5.0 * x @ x.T - 1.0)).sum(1)
      >>> rows = sigmoid_rows(x, x, jnp.arange(3), 5.0, -1.0, block_size=2)
      >>> bool(jnp.allclose(rows, dense))
      True
    """
    return _call(_Sigmoid, x, ys, targets, scale, bias, block_size)
