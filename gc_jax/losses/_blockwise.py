"""Row-wise contrastive losses computed tile by tile, never holding the full logit matrix.

Every query row ``i`` of ``x`` is scored against every row ``j`` of ``ys`` with logit
``z[i, j] = scale * x[i] @ ys[j] + bias``. The logits are visited in
``block_size x block_size`` tiles: a loop over blocks of queries, an inner one over
blocks of ``ys``, so memory is one tile plus ``O((n + m) * d)``, whatever ``n`` and
``m``. Nothing is padded: a last block that would run past the end starts earlier,
and the rows it shares with the block before are masked where they would count twice.

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
blocks. The second sweep writes ``dys`` over ``ys`` (each block is read just before it
is overwritten), so ``ys``'s buffer is reused when nothing else needs it. Gathering
``ys`` across devices happens outside, so its transpose (a reduce-scatter) is left
to JAX; the ring form (``_ring``) instead runs :func:`sweep` and the backward
once per block of ``ys`` that reaches the device.

*Precision*: tiles, per-row statistics and per-block gradients are computed in the
*accumulation dtype*, the inputs' dtype widened to at least float32 (the scalars'
dtype). ``x`` and ``ys`` are never cast whole: bfloat16 or float16 rows stay narrow,
each tile's product is accumulated in float32 (``preferred_element_type``), and the
gradients of ``x`` and ``ys`` come back in their own dtypes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gc_jax import _distributed, _narrow
from gc_jax.losses import _strategies
from gc_jax.losses._strategies import Rows, Strategy

Scalar = jax.Array


def _read(v: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """Rows ``start : start + size`` of ``v``."""
    read = lambda v: jax.lax.dynamic_slice_in_dim(v, start, size)
    return _narrow.on_cpu_as_bits(read, v) if _narrow.is_narrow(v) else read(v)


def _write(buf: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """``buf`` with ``rows`` written from row ``start`` on (in place)."""
    write = lambda buf, rows: jax.lax.dynamic_update_slice_in_dim(buf, rows, start, 0)
    return _narrow.on_cpu_as_bits(write, buf, rows) if _narrow.is_narrow(buf) else write(buf, rows)


def _loop(body: Callable, steps: int, init: Any, *arrays: jax.Array) -> Any:
    """``fori_loop`` of ``carry = body(i, carry, *arrays)``, reading blocks of ``arrays``.

    ``arrays`` are carried through an optimisation barrier, so XLA cannot hoist work
    on them whole out of the loop (only blocks of them are meant to be touched).
    """

    def step(i, state):
        carry, arrays = state
        arrays = jax.lax.optimization_barrier(arrays)
        return body(i, carry, *arrays), arrays

    return jax.lax.fori_loop(0, steps, step, (init, arrays))[0]


def _blocks(rows: int, size: int) -> int:
    return -(-rows // size)


def _first(i: jax.Array, size: int, rows: int) -> jax.Array:
    """The first row of block ``i``: ``i * size``, but the last block ends at ``rows``.

    A last block that would run past the end starts earlier instead and overlaps the
    one before it (nothing is padded); its rows before ``i * size`` are masked where
    they would be counted twice.
    """
    return jnp.minimum(i * size, rows - size)


def _tile(
    xq: jax.Array,
    yk: jax.Array,
    targets: jax.Array,
    start: jax.Array,
    own: jax.Array,
    scale: Scalar,
    bias: Scalar,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One tile: raw scores ``xq @ yk.T`` (in ``scale``'s dtype), logits, own columns, targets.

    ``yk`` holds rows ``start ...`` of ``ys``; columns before ``own`` belong to the
    previous block and are masked out (``valid`` false, never a target).
    """
    raw = jnp.matmul(xq, yk.T, preferred_element_type=scale.dtype)
    cols = start + jnp.arange(yk.shape[0])
    valid = (cols >= own)[None, :]
    return raw, scale * raw + bias, valid, valid & (cols[None, :] == targets[:, None])


def _own_rows(start: jax.Array, size: int, own: jax.Array) -> jax.Array:
    """``[size, 1]``: whether each row of a block from ``start`` is at or after ``own``."""
    return (start + jnp.arange(size) >= own)[:, None]


def _sizes(block: int, x: jax.Array, ys: jax.Array) -> tuple[int, int]:
    return min(block, x.shape[0]), min(block, ys.shape[0])


def varying_like(tree: Any, *others: jax.Array) -> Any:
    """Casts ``tree``'s leaves to vary over every ``shard_map`` axis ``others`` vary over.

    Loop carries must keep their types, and the custom VJP's cotangents must have the
    types of its inputs: a replicated scalar used with per-device rows is cast outside
    the custom VJP, and gets its (psummed) gradient through the cast.
    """
    return _distributed.vary_like(tree, *others)


def _zeros(like: jax.Array, dtype: Any, *others: jax.Array) -> jax.Array:
    """Zeros typed like ``like`` (shape, and mesh under explicit axes), varying like ``others``."""
    return varying_like(jnp.zeros_like(like, dtype), *others)


def sweep(
    kind: Strategy,
    block: int,
    x: jax.Array,
    ys: jax.Array,
    targets: jax.Array,
    scale: Scalar,
    bias: Scalar,
    carry: Rows,
) -> Rows:
    """``carry`` (one running statistic per row of ``x``) updated with every tile of ``ys``.

    A loop over query blocks, an inner one over ``ys``'s blocks. The rows a last,
    overlapping query block shares with the block before keep the values that block
    gave them (they would otherwise count ``ys`` twice). ``_ring`` calls this
    once per block of ``ys`` that reaches the device.
    """
    bq, bk = _sizes(block, x, ys)
    n, m = len(x), len(ys)

    def query_block(i, carry, x, targets, ys):
        qs = _first(i, bq, n)
        xq, tq = _read(x, qs, bq), _read(targets, qs, bq)
        before = tuple(_read(c, qs, bq) for c in carry)

        def step(j, rows, ys):
            ks = _first(j, bk, m)
            _, z, valid, pos = _tile(xq, _read(ys, ks, bk), tq, ks, j * bk, scale, bias)
            return kind.update(rows, z, valid, pos)

        after = _loop(step, _blocks(m, bk), before, ys)
        own = _own_rows(qs, bq, i * bq)[:, 0]
        rows = (jnp.where(own, a, b) for a, b in zip(after, before, strict=True))
        return tuple(_write(c, r, qs) for c, r in zip(carry, rows, strict=True))

    return _loop(query_block, _blocks(n, bq), carry, x, targets, ys)


def init(kind: Strategy, x: jax.Array, *others: jax.Array, dtype: Any) -> Rows:
    """``kind.init`` for the rows of ``x``, typed to vary like ``x`` and ``others``."""
    return kind.init(_zeros(x[:, 0], dtype, x, *others))


def _forward(
    kind: Strategy,
    block: int,
    x: jax.Array,
    ys: jax.Array,
    targets: jax.Array,
    scale: Scalar,
    bias: Scalar,
) -> tuple[jax.Array, jax.Array]:
    """Per-row losses and statistics: one :func:`sweep` over all of ``ys``."""
    carry = init(kind, x, ys, dtype=scale.dtype)
    return kind.finish(sweep(kind, block, x, ys, targets, scale, bias, carry))


def backward(
    kind: Strategy,
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
    each block's ``dy`` over the query blocks. A block's gradient is accumulated in
    ``scale``'s dtype and written in its input's dtype: no batch-sized array ever
    exists in a dtype wider than the inputs'.
    """
    bq, bk = _sizes(block, x, ys)
    n, m = len(x), len(ys)
    nq, nk = _blocks(n, bq), _blocks(m, bk)
    acc = scale.dtype
    queries = (x, targets, stat, g)

    def read_queries(queries, i):
        qs = _first(i, bq, n)
        return tuple(_read(v, qs, bq) for v in queries), _own_rows(qs, bq, i * bq), qs

    def tile_grad(query, yk, ks, own):
        """A tile's raw scores and ``dz``: a block of queries against keys from ``ks``."""
        xq, tq, sq, gq = query
        raw, z, valid, pos = _tile(xq, yk, tq, ks, own, scale, bias)
        return raw, gq[:, None] * kind.dlogits(z, valid, pos, sq)

    def query_block(i, carry, ys, *queries):
        query, own, qs = read_queries(queries, i)

        def step(j, carry, ys):
            dxq, dscale, dbias = carry
            ks = _first(j, bk, m)
            yk = _read(ys, ks, bk)
            raw, dz = tile_grad(query, yk, ks, j * bk)
            dxq = dxq + jnp.matmul(dz, yk, preferred_element_type=acc)
            dz = jnp.where(own, dz, 0)  # rows of the previous block: summed there
            return dxq, dscale + (dz * raw).sum(), dbias + dz.sum()

        dx, *scalars = carry
        dxq, *scalars = _loop(step, nk, (_zeros(query[0], acc, x, ys), *scalars), ys)
        return _write(dx, (scale * dxq).astype(x.dtype), qs), *scalars

    def key_grad(j, dy, queries):
        """``dy`` of key block ``j`` (``[bk, d]``, zero in rows of the block before)."""
        ks = _first(j, bk, m)
        yk = _read(dy, ks, bk)  # the rows of ``ys`` this block owns are still there

        def step(i, dyk, *queries):
            query, own, _ = read_queries(queries, i)
            _, dz = tile_grad(query, yk, ks, j * bk)
            dz = jnp.where(own, dz, 0)
            return dyk + jnp.matmul(dz.T, query[0], preferred_element_type=acc)

        return (scale * _loop(step, nq, _zeros(yk, acc, x, ys), *queries)).astype(ys.dtype)

    def key_block(j, dy, zero, *queries):
        j = j + zero  # ``zero`` is 0 and orders this sweep after the first (see below)
        return _write(dy, key_grad(j, dy, queries), j * bk)

    # Every row of dx and dy is written, so their buffers start as x and ys (zeros
    # would be one batch-sized broadcast, shared and copied by both). dx needs every
    # row of ys; then dy is written *over* ys, block by block (a last, overlapping
    # block reads rows already holding dy only in columns it masks). The second sweep's
    # block index depends on the first sweep's result, so it provably runs after it
    # and XLA updates ys's buffer in place: the loss backward holds three batch-sized
    # arrays (x, dx, ys/dy), not four.
    zero = _zeros(ys[0, 0], acc, x, ys)
    init = (varying_like(x, x, ys), zero, zero)
    dx, dscale, dbias = _loop(query_block, nq, init, ys, *queries)
    dy = _loop(key_block, m // bk, varying_like(ys, x, ys), _zero_after(dscale), *queries)
    if m % bk:  # the last block overlaps the one before: only its own rows are written
        own = m % bk
        last = key_grad(nk - 1, dy, queries)[bk - own :]
        dy = _narrow.update_in_place(lambda dy: _write(dy, last, m - own), dy)
    return dx, dy, dscale, dbias


def _zero_after(dep: Scalar) -> jax.Array:
    """The integer 0, computed from ``dep``: whatever uses it runs after ``dep`` is known.

    ``dep > inf`` is never true (NaN included), but the compiler cannot fold it. An
    optimisation barrier would not do: XLA:CPU removes barriers before it decides
    which buffers may be updated in place.
    """
    return jnp.where(dep > jnp.inf, 1, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rowwise(kind, block, x, ys, targets, scale, bias):
    """Per-row losses; the forward saves the inputs and one statistic per row."""
    return _forward(kind, block, x, ys, targets, scale, bias)[0]


def _rowwise_fwd(kind, block, x, ys, targets, scale, bias):
    loss, stat = _forward(kind, block, x, ys, targets, scale, bias)
    return loss, (x, ys, targets, scale, bias, stat)


def _rowwise_bwd(kind, block, res, g):
    x, ys, targets, scale, bias, stat = res
    dx, dys, dscale, dbias = backward(kind, block, x, ys, targets, scale, bias, stat, g)
    return dx, dys, None, dscale, dbias


_rowwise.defvjp(_rowwise_fwd, _rowwise_bwd)


def accumulation_dtype(*values: Any) -> jnp.dtype:
    """The dtype losses are computed in: the values' common dtype, at least float32."""
    return jnp.promote_types(jnp.result_type(*values), jnp.float32)


def call(
    kind: Strategy,
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
    scale, bias = varying_like((jnp.asarray(scale, acc), jnp.asarray(bias, acc)), x, ys)
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
    return call(_strategies.Softmax, x, ys, targets, scale, 0.0, block_size)


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
    return call(_strategies.Sigmoid, x, ys, targets, scale, bias, block_size)
