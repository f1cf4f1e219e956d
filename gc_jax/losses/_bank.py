"""A bank of earlier steps' representations, extra negatives without gradient: :class:`Bank`.

ContAccum (Kim et al., NAACL 2024) and MoCo keep the last ``steps`` steps' query and
document representations and score the current batch against them too: the current
batch stays exact (gradient-cached), the bank only widens the partition function.
:func:`init_bank` and :func:`update_bank` are pure and jittable (optax style); the
loss reads the bank through ``contrastive_loss(..., bank=)``.

The arrays keep the batch's rows first (``[n, steps, ...]``), so a bank made from a
batch split across devices is split like it: each device's rows stay on it, and the
update writes one slot of every device's own rows. Flattened row-major, a bank
query's documents stay ``k`` consecutive columns (its positive first), which is what
the masks' ``k``-structure reads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gc_jax.losses import _options
from gc_jax.losses._engine.families import Metadata
from gc_jax.losses._engine.sides import Sides


class Bank(NamedTuple):
    """The last ``steps`` steps' representations (and ids), a pytree for the train state.

    Attributes:
      queries: ``[n, steps, d]``: slot ``s`` holds one step's queries.
      docs: ``[n, steps, k, d]``: that step's documents, ``k`` per query (positive first).
      query_ids: ``[n, steps, w]`` integers, or None (a bank without ids).
      doc_ids: ``[n, steps, k, w]`` integers, or None.
      count: steps written so far (an ``int32`` scalar); slot ``count % steps`` is
        written next, and the slots ``>= count`` are empty (masked out).
    """

    queries: jax.Array
    docs: jax.Array
    query_ids: jax.Array | None
    doc_ids: jax.Array | None
    count: jax.Array

    @property
    def steps(self) -> int:
        """How many steps the bank holds when full."""
        return self.queries.shape[1]

    @property
    def k(self) -> int:
        """Documents per query."""
        return self.docs.shape[2]


def _shape(v: Any, name: str) -> tuple[tuple[int, ...], Any]:
    shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{name} must be an array or jax.ShapeDtypeStruct (its shape and dtype), got "
            f"{type(v).__name__}."
        )
    return tuple(shape), dtype


def _ids_like(ids: Any, rows: int, steps: int, name: str, k: int | None = None):
    if ids is None:
        return None
    shape, dtype = _shape(ids, name)
    if not jnp.issubdtype(dtype, jnp.integer) or len(shape) not in (1, 2) or shape[0] != rows:
        raise ValueError(
            f"{name} must be integer ids, one per row ({rows},) or ({rows}, w), got {dtype} "
            f"of shape {shape}."
        )
    w = shape[1] if len(shape) == 2 else 1
    groups = (rows, steps, w) if k is None else (rows // k, steps, k, w)
    return jnp.zeros(groups, dtype)


def _placement(v: Any) -> tuple[Any, Any]:
    """Where the bank's rows and its count go: split like ``v``'s rows (a placed array or
    a ``ShapeDtypeStruct`` with a ``NamedSharding``) and replicated; else (None, None)."""
    if isinstance(v, jax.core.Tracer):
        return None, None
    s = getattr(v, "sharding", None)
    if not isinstance(s, NamedSharding) or not s.spec or s.spec[0] is None:
        return None, None
    return NamedSharding(s.mesh, P(s.spec[0])), NamedSharding(s.mesh, P())


def init_bank(
    steps: int,
    queries: Any,
    docs: Any,
    *,
    query_ids: Any = None,
    doc_ids: Any = None,
    dtype: Any = None,
) -> Bank:
    """An empty bank for ``steps`` steps of batches shaped like ``queries`` and ``docs``.

    Args:
      steps: how many earlier steps the bank holds (ContAccum's and MoCo's queue).
      queries: one step's queries, ``[n, d]``, or a ``jax.ShapeDtypeStruct`` (shape
        and dtype are read; under ``shard_map`` this device's rows).
      docs: one step's documents, ``[n * k, d]`` (each query's positive, then its
        hard negatives), or its ``ShapeDtypeStruct``.
      query_ids: one step's query ids (or their ``ShapeDtypeStruct``), when the loss
        masks false negatives by ids; else None.
      doc_ids: one step's document ids, likewise.
      dtype: the bank's float dtype (default: the queries'). ``bfloat16`` halves it.

    Returns:
      A :class:`Bank` of zeros with ``count = 0`` (every slot empty). When ``queries``
      is split across devices (an array, or a ``ShapeDtypeStruct`` with a
      ``NamedSharding``), the bank's arrays are split like its rows and ``count`` is
      replicated; else place them so yourself (rows first: ``P("data")``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gc_jax.losses import init_bank
      >>> bank = init_bank(4, jax.ShapeDtypeStruct((8, 16), jnp.float32), jnp.zeros((16, 16)))
      >>> bank.queries.shape, bank.docs.shape, bank.steps, bank.k, int(bank.count)
      ((8, 4, 16), (8, 4, 2, 16), 4, 2, 0)
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int (steps the bank holds), got {steps!r}.")
    (n, d), qdtype = _shape(queries, "queries")
    (m, e), _ = _shape(docs, "docs")
    if d != e or m % n:
        raise ValueError(
            f"docs must be [n * k, d] for queries [n, d], got queries {(n, d)} and docs {(m, e)}."
        )
    k, dtype = m // n, qdtype if dtype is None else dtype
    bank = Bank(
        jnp.zeros((n, steps, d), dtype),
        jnp.zeros((n, steps, k, d), dtype),
        _ids_like(query_ids, n, steps, "query_ids"),
        _ids_like(doc_ids, m, steps, "doc_ids", k),
        jnp.zeros((), jnp.int32),
    )
    rows, replicated = _placement(queries)
    if rows is None:
        return bank
    placed = jax.device_put(bank._replace(count=None), rows)
    return placed._replace(count=jax.device_put(bank.count, replicated))


def update_bank(
    bank: Bank,
    queries: jax.Array,
    docs: jax.Array,
    *,
    query_ids: jax.Array | None = None,
    doc_ids: jax.Array | None = None,
) -> Bank:
    """``bank`` with this step's rows written over its oldest slot (no gradient).

    Pure and jittable: call it in the step, e.g. in the loss, returning the new bank
    as its aux (see :doc:`/recipes`). Under ``shard_map`` each device writes its own
    rows; under ``jit`` over a sharded batch the bank stays sharded like it.

    Args:
      bank: the bank (:func:`init_bank`).
      queries: this step's queries, ``[n, d]``.
      docs: this step's documents, ``[n * k, d]``.
      query_ids: this step's query ids; required when the bank holds query ids.
      doc_ids: this step's document ids; required when the bank holds document ids.

    Returns:
      The updated bank, ``count + 1``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gc_jax.losses import init_bank, update_bank
      >>> q, d = jnp.ones((2, 3)), jnp.ones((2, 3))
      >>> bank = update_bank(update_bank(init_bank(2, q, d), q, d), 2 * q, 2 * d)
      >>> bank.queries[0, :, 0].tolist(), int(bank.count)
      ([1.0, 2.0], 2)
    """
    n, steps, d = bank.queries.shape
    k = bank.k
    if queries.shape != (n, d) or docs.shape != (n * k, d):
        raise ValueError(
            f"the bank holds queries [{n}, {d}] and docs [{n * k}, {d}] per step, got "
            f"queries {queries.shape} and docs {docs.shape}."
        )
    slot = bank.count % steps
    put = lambda buf, rows: buf.at[:, slot].set(jax.lax.stop_gradient(rows).astype(buf.dtype))
    new = bank._replace(
        queries=put(bank.queries, queries),
        docs=put(bank.docs, docs.reshape(n, k, d)),
        count=bank.count + 1,
    )
    for field, ids, shape in (("query_ids", query_ids, (n, -1)), ("doc_ids", doc_ids, (n, k, -1))):
        held = getattr(bank, field)
        if held is not None and ids is None:
            raise ValueError(f"the bank holds {field}: pass {field}= to update_bank too.")
        if held is not None:
            new = new._replace(**{field: put(held, ids.reshape(shape))})
    return new


def check_bank(bank: Any, x: jax.Array, y: jax.Array, k: int, options: Any) -> Bank | None:
    """``bank`` checked against this device's ``x`` and ``y`` and the loss's ids (or None)."""
    if bank is None:
        return None
    if not isinstance(bank, Bank):
        raise TypeError(
            f"bank must be a gc_jax.losses.Bank (from init_bank), got {type(bank).__name__}."
        )
    d = x.shape[1]
    if bank.queries.shape[-1] != d or bank.k != k or len(bank.queries) != len(x):
        raise ValueError(
            f"bank holds rows [{len(bank.queries)} queries, {bank.k} docs each, dim "
            f"{bank.queries.shape[-1]}] per step, and the loss got {len(x)} queries with {k} "
            f"docs each of dim {d}: make the bank with init_bank(steps, queries, docs) of "
            "this batch's shapes (across devices: split like the batch)."
        )
    for field in ("query_ids", "doc_ids"):
        if getattr(options, field) is not None and getattr(bank, field) is None:
            raise ValueError(
                f"{field} masks false negatives, and the bank holds no {field} to mask its "
                f"entries by: make it with init_bank(..., {field}=) and pass {field}= to "
                "update_bank."
            )
    if options.guide is not None:
        raise ValueError(
            "guide= and bank= do not combine: the bank holds no guide representations."
        )
    stop = jax.lax.stop_gradient
    return bank._replace(queries=stop(bank.queries), docs=stop(bank.docs))


def columns(bank: Bank) -> tuple[jax.Array, jax.Array]:
    """The bank's columns: queries ``[n * steps, d]`` and documents ``[n * steps * k, d]``
    (the sides ``bx`` and ``by`` of a loss)."""
    d = bank.queries.shape[-1]
    return bank.queries.reshape(-1, d), bank.docs.reshape(-1, d)


def with_columns(bank: Bank, sides: Sides, meta: Metadata, offset: Any, options: Any):
    """``(sides, meta)`` with the bank's columns as the sides ``bx`` and ``by``, and their
    metadata (``_options.id_columns``): offsets, which slots are filled, the ids the loss
    masks by.

    ``offset``: the global index of the first query row of ``bank`` (0 gathered);
    ``options``: the loss's ``_options.Options`` (whether it masks by query ids, by
    document ids).
    """
    bx, by = columns(bank)
    n, steps, _ = bank.queries.shape
    k = bank.k
    live = jnp.broadcast_to(jnp.arange(steps) < bank.count, (n, steps)).reshape(-1)
    pid = None if options.doc_ids is None else bank.doc_ids.reshape(n * steps * k, -1)
    qid = None if options.query_ids is None else bank.query_ids.reshape(n * steps, -1)
    mx, my = _options.id_columns(qid, pid, offset * steps, k, live)
    return sides._replace(bx=bx, by=by), meta._replace(cols=meta.cols._replace(bx=mx, by=my))
