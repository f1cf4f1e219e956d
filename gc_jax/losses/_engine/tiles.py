"""A tile problem (:class:`Tiles`) and the pieces its loops share: blocks, loops, logits.

A :class:`Tiles` is one family's rows against one block of columns, as the engine
(``engine.Engine``) builds it and ``blockwise`` and ``sweeps`` loop over it. Rows are
read and written a block at a time (``dynamic_slice``), so the loops touch one block of
each batch-sized array per step. :class:`Firsts` reads rows ``0, k, 2k,
...`` of an array (the positive documents among ``k`` rows per query) in place,
without a strided copy. Narrow floats are moved on their bits on XLA:CPU
(``gc_jax._narrow``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gc_jax import _distributed, _narrow
from gc_jax.losses._engine.masks import Mask
from gc_jax.losses._engine.scores import Dot, Score
from gc_jax.losses._engine.strategies import Strategy

Scalar = jax.Array


class Tiles(NamedTuple):
    """One row-wise loss's tiles: rows ``x`` scored against columns ``ys``.

    Attributes:
      kind: the strategy (``strategies``), static.
      block: rows per tile on either side, static.
      x: the rows (of ``score``: an array, a view of this module, or MaxSim's tokens).
      ys: the columns.
      targets: the column of each row's target, ``[rows]``, or None (no target here).
      scale: the logits' multiplier, in the accumulation dtype.
      bias: added to every logit, likewise.
      mask: the pairs kept (``masks.Mask``), or None: every pair.
      score: how a tile is scored (``scores``), static.
    """

    kind: Strategy
    block: int
    x: Any
    ys: Any
    targets: jax.Array | None
    scale: Scalar
    bias: Scalar
    mask: Mask | None = None
    score: Score = Dot


@jax.tree_util.register_pytree_node_class
class Firsts:
    """Rows ``0, k, 2k, ...`` of ``array`` (``[n * k, ...]``), read and written in place.

    A pytree (``k`` is static), so it passes through loops and custom VJPs like the
    array it wraps; :func:`read` and :func:`write` take it where they take rows.
    """

    def __init__(self, array: Any, k: int):
        self.array, self.k = array, k

    def tree_flatten(self):
        return (self.array,), self.k

    @classmethod
    def tree_unflatten(cls, k, children):
        return cls(children[0], k)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.array.shape[0] // self.k, *self.array.shape[1:])

    @property
    def dtype(self) -> Any:
        return self.array.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def grouped(self, v: jax.Array | None = None) -> jax.Array:
        """``array`` (or ``v`` shaped like it) as ``[n, k, ...]``: a free reshape."""
        v = self.array if v is None else v
        return v.reshape(len(self), self.k, *v.shape[1:])

    def whole(self) -> jax.Array:
        """The rows as one array (a strided copy: for the dense form only)."""
        return self.array[:: self.k]


@jax.tree_util.register_pytree_node_class
class Repeated:
    """``repeat(array, k)``: row ``j`` is row ``j // k`` of ``array``, read without the copy.

    A query's id beside each of its ``k`` documents. A pytree like :class:`Firsts`.
    """

    def __init__(self, array: Any, k: int):
        self.array, self.k = array, k

    def tree_flatten(self):
        return (self.array,), self.k

    @classmethod
    def tree_unflatten(cls, k, children):
        return cls(children[0], k)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.array.shape[0] * self.k, *self.array.shape[1:])

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, start: jax.Array, size: int) -> jax.Array:
        """Rows ``start : start + size``: a slice of ``array`` around them, then a gather."""
        n = self.array.shape[0]
        span = min(n, size // self.k + 2)  # covers every row the block repeats
        base = jnp.minimum(start // self.k, n - span)
        around = jax.lax.dynamic_slice_in_dim(self.array, base, span)
        return around[(start + jnp.arange(size)) // self.k - base]

    def whole(self) -> jax.Array:
        """The repeated rows as one array (for the dense form only)."""
        return jnp.repeat(self.array, self.k, axis=0)


_VIEWS = (Firsts, Repeated)


def dense(v: Any) -> Any:
    """``v`` with every view in it (:class:`Firsts`, :class:`Repeated`) copied out whole."""
    return jax.tree.map(lambda a: a.whole() if _is_view(a) else a, v, is_leaf=_is_view)


def _is_view(v: Any) -> bool:
    return isinstance(v, _VIEWS)


def read(v: jax.Array | Firsts | Repeated, start: jax.Array, size: int) -> jax.Array:
    """Rows ``start : start + size`` of ``v``."""
    if isinstance(v, Repeated):
        return v.read(start, size)
    if isinstance(v, Firsts):  # the contiguous slab of their k-row groups, then every k-th
        slab = read(v.array, start * v.k, size * v.k)
        return slab.reshape(size, v.k, *slab.shape[1:])[:, 0]
    get = lambda v: jax.lax.dynamic_slice_in_dim(v, start, size)
    return _narrow.on_cpu_as_bits(get, v) if _narrow.is_narrow(v) else get(v)


def read_tree(tree: Any, start: jax.Array, size: int) -> Any:
    """Rows ``start : start + size`` of every per-row leaf of ``tree`` (scalars as they are)."""

    def one(v):
        scalar = not _is_view(v) and jnp.ndim(v) == 0
        return v if scalar else read(v, start, size)

    return jax.tree.map(one, tree, is_leaf=_is_view)


def write(buf: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """``buf`` with ``rows`` written from row ``start`` on (in place)."""
    put = lambda buf, rows: jax.lax.dynamic_update_slice_in_dim(buf, rows, start, 0)
    return _narrow.on_cpu_as_bits(put, buf, rows) if _narrow.is_narrow(buf) else put(buf, rows)


def around(buf: jax.Array | Firsts, start: jax.Array, size: int) -> jax.Array:
    """What adding to rows ``start : start + size`` of ``buf`` needs: their values (for
    :class:`Firsts`, the contiguous slab of their groups of ``k``, whose other rows stay)."""
    if isinstance(buf, Firsts):
        return read(buf.array, start * buf.k, size * buf.k)
    return read(buf, start, size)


def rows_in(buf: jax.Array | Firsts, context: jax.Array) -> jax.Array:
    """The rows' values, from :func:`around`'s ``context``."""
    if isinstance(buf, Firsts):
        return context.reshape(-1, buf.k, *context.shape[1:])[:, 0]
    return context


def update(buf: Any, rows: jax.Array, start: jax.Array, context: jax.Array) -> Any:
    """``buf`` with ``rows`` written from row ``start`` on, in place; for :class:`Firsts`
    their slab (``context``, from :func:`around`) is written back with them set."""
    if isinstance(buf, Firsts):
        grouped = context.reshape(rows.shape[0], buf.k, *context.shape[1:])
        slab = grouped.at[:, 0].set(rows).reshape(context.shape)
        return Firsts(write(buf.array, slab, start * buf.k), buf.k)
    return write(buf, rows, start)


def loop(body: Callable, steps: int, init: Any, *arrays: Any) -> Any:
    """``fori_loop`` of ``carry = body(i, carry, *arrays)``, reading blocks of ``arrays``.

    Under ``shard_map`` ``init`` must vary like the ``arrays`` it is computed with.
    ``arrays`` are carried through an optimisation barrier, so XLA cannot hoist work
    on them whole out of the loop (only blocks of them are meant to be touched).
    """

    def step(i, state):
        carry, arrays = state
        arrays = jax.lax.optimization_barrier(arrays)
        return body(i, carry, *arrays), arrays

    # Every array typed to vary like the others: on JAX 0.10 the barrier's results all
    # vary over every axis one of its operands varies over (a loop carry must not change).
    arrays = varying_like(arrays, *arrays)
    return jax.lax.fori_loop(0, steps, step, (init, arrays))[0]


def blocks(rows: int, size: int) -> int:
    """How many blocks of ``size`` rows cover ``rows`` rows."""
    return -(-rows // size)


def first(i: jax.Array, size: int, rows: int) -> jax.Array:
    """The first row of block ``i``: ``i * size``, but the last block ends at ``rows``.

    A last block that would run past the end starts earlier instead and overlaps the
    one before it (nothing is padded); its rows before ``i * size`` are masked where
    they would be counted twice.
    """
    return jnp.minimum(i * size, rows - size)


def logits(
    raw: jax.Array,
    targets: jax.Array | None,
    cols: tuple[jax.Array, jax.Array],
    scalars: tuple[Scalar, Scalar],
    pairs: tuple[jax.Array | None, Any] = (None, None),
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One tile's logits, valid pairs and targets, from its raw scores (``scores``).

    ``cols``: ``(start, own)``: ``raw`` scores rows against key rows ``start ...``, and
    columns before ``own`` belong to the previous block and are masked out (``valid``
    false, never a target). ``scalars``: ``(scale, bias)``. ``pairs``: ``(keep,
    boost)`` of a mask rule (``masks.Rule``), each None when it has none: ``keep``
    (``[rows, cols]``) drops more pairs and never drops a target; ``boost``: ``(pairs,
    alpha)``, pairs whose logits gain ``alpha * raw``, a bias through which ``raw`` is
    not differentiated (``dz`` reaches ``raw`` through ``scale`` alone). ``targets``
    None: no column is any row's target.
    """
    (start, own), (scale, bias), (keep, boost) = cols, scalars, pairs
    z = scale * raw + bias
    if boost is not None:
        boosted, alpha = boost
        z = z + jnp.where(boosted, alpha * jax.lax.stop_gradient(raw), 0)
    cols = start + jnp.arange(raw.shape[1])
    valid = (cols >= own)[None, :]
    if keep is not None:
        valid = valid & keep
    no_target = targets is None
    pos = jnp.zeros_like(valid) if no_target else valid & (cols[None, :] == targets[:, None])
    return z, valid, pos


def own_rows(start: jax.Array, size: int, own: jax.Array) -> jax.Array:
    """``[size, 1]``: whether each row of a block from ``start`` is at or after ``own``."""
    return (start + jnp.arange(size) >= own)[:, None]


def count(rows: Any) -> int:
    """How many rows ``rows`` (an array, a view, or a pytree of per-row leaves) holds."""
    return jax.tree.leaves(rows, is_leaf=_is_view)[0].shape[0]


def sizes(block: int, n: int, m: int) -> tuple[int, int]:
    """Rows per block on either side: ``block``, or fewer when a side is shorter."""
    return min(block, n), min(block, m)


def varying_like(tree: Any, *others: Any) -> Any:
    """Casts ``tree``'s leaves to vary over every ``shard_map`` axis ``others`` vary over.

    Loop carries must keep their types, and the custom VJP's cotangents must have the
    types of its inputs: a replicated scalar used with per-device rows is cast outside
    the custom VJP, and gets its (psummed) gradient through the cast.
    """
    return _distributed.vary_like(tree, *others)


def zeros(like: jax.Array, dtype: Any, *others: Any) -> jax.Array:
    """Zeros typed like ``like`` (shape, and mesh under explicit axes), varying like ``others``."""
    return varying_like(jnp.zeros_like(like, dtype), *others)


def scalar_zero(rows: Any, dtype: Any, *others: Any) -> jax.Array:
    """A zero scalar typed like ``rows``' first element, varying like ``rows`` and ``others``."""
    v = jax.tree.leaves(rows, is_leaf=_is_view)[0]
    v = v.array if isinstance(v, Firsts) else v
    return zeros(v[(0,) * v.ndim], dtype, rows, *others)


def row_zeros(x: Any, dtype: Any, *others: Any) -> jax.Array:
    """``[rows]`` zeros for the rows of ``x`` (a pytree of them), typed like them, varying
    like ``others``."""
    v = jax.tree.leaves(x, is_leaf=_is_view)[0]
    column = v.array[:: v.k] if isinstance(v, Firsts) else v
    column = column[(slice(None),) + (0,) * (column.ndim - 1)]
    return zeros(column, dtype, x, *others)
