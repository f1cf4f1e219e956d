"""Which (row, column) pairs a loss keeps: a static :class:`Rule` and per-row metadata.

A rule is applied to a tile (or, in the dense form, to the whole logit matrix) from
the metadata of its rows and columns (:class:`Meta`: per-row arrays read block by
block with the rows, on the ring travelling with their block, plus scalars).

Rows (always one per query ``i``; its row is the query itself or its positive
document): ``offset`` (the global index of this device's first query), and with the
options ``pid`` (the id of the query's positive document), ``qid`` (the query's id),
``g`` (the guide's representation of the row), ``t`` (the guide's score of the
query's positive pair) and ``margin``.

Columns (queries or documents): ``offset`` (the global index of the first column
here), ``pid`` (a document's id; for a query column, its positive's), ``qid`` (a
query's id; for a document column, its query's, counted only on positives), ``g``,
and for a bank's columns (``_bank``) ``live`` (whether the entry is filled yet).
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp


class Meta(NamedTuple):
    """One side's metadata (see above); None where the loss does not use it.

    The fields are in alphabetical order: a pytree's leaves in the order of the dicts
    it replaced (sorted keys), so the compiled programs did not change."""

    alpha: Any = None
    g: Any = None
    live: Any = None
    margin: Any = None
    offset: Any = None
    pid: Any = None
    qid: Any = None
    t: Any = None


def _equal(a: jax.Array, b: jax.Array) -> jax.Array:
    """``[rows, cols]``: whether row ``i`` of ``a`` equals row ``j`` of ``b`` (ids ``[., w]``)."""
    eq = [a[:, None, w] == b[None, :, w] for w in range(a.shape[1])]  # no reduce: fused
    return functools.reduce(jnp.logical_and, eq)


def _or(a: jax.Array | None, b: jax.Array) -> jax.Array:
    return b if a is None else a | b


class Rule(NamedTuple):
    """The pairs of one family of logits a loss keeps (static, hashable).

    Attributes:
      exclude: pairs that are not in the family: ``"self"`` (column ``i`` of row
        ``i``: a query against itself), ``"owner"`` (row ``i``'s own ``k``
        documents) or ``"negatives"`` (every column but the queries' positives), or None.
      protect: the pair that is never dropped by ids or the guide (the positive
        pair): ``"self"`` (column ``i``) or ``"first"`` (column ``i * k``), or None.
      docs: the columns are documents (``k`` per query; a query id counts only on
        the first, the positive).
      k: documents per query.
      guide: ``"absolute"`` or ``"relative"`` margins on the guide's scores, or None.
      hardness: which negatives get ``alpha * sg(score)`` added to their logits
        (sentence-transformers' ``hardness_mode``): ``"hard_negatives"`` (the row's own
        hard negatives), ``"in_batch_negatives"`` (the other rows' documents) or
        ``"all_negatives"`` (every document but the positive); or None.
      bank: the columns are a bank's earlier rows (``_bank``): none is a row's own
        (no ``exclude`` but ``"negatives"``, no ``protect``), every one is another
        query's for ``hardness``, and those not ``live`` are dropped.
    """

    exclude: Literal["self", "owner", "negatives"] | None = None
    protect: Literal["self", "first"] | None = None
    docs: bool = False
    k: int = 1
    guide: Literal["absolute", "relative"] | None = None
    hardness: Literal["hard_negatives", "in_batch_negatives", "all_negatives"] | None = None
    bank: bool = False

    def for_bank(self) -> Rule:
        """This rule for the same rows against a bank's columns of the same side."""
        hardness = None if self.hardness == "hard_negatives" else self.hardness
        exclude = "negatives" if self.exclude == "negatives" else None
        return self._replace(exclude=exclude, protect=None, guide=None, hardness=hardness,
                             bank=True)  # fmt: skip

    def keep(self, rm: Meta, cm: Meta, rows: jax.Array, cols: jax.Array) -> jax.Array | None:
        """``[rows, cols]``: the pairs kept, from the rows' and columns' metadata.

        ``rows``, ``cols``: positions of the tile's rows and columns in the arrays
        the metadata's ``offset`` refers to. None: every pair is kept.
        """
        gi, gj = (rm.offset + rows)[:, None], (cm.offset + cols)[None, :]
        drop = self._dropped(rm, cm, gj)
        if drop is not None and self.protect is not None:
            drop = drop & (gj != (gi * self.k if self.protect == "first" else gi))
        keep = None if drop is None else ~drop
        if self.exclude is not None:
            other = {"self": lambda: gj != gi, "owner": lambda: gj // self.k != gi,
                     "negatives": lambda: gj % self.k == 0}[self.exclude]()  # fmt: skip
            keep = other if keep is None else keep & other
        if self.bank:
            keep = cm.live[None, :] if keep is None else keep & cm.live[None, :]
        return None if keep is None else jax.lax.optimization_barrier(keep)

    def boost(self, rm: Meta, cm: Meta, rows: jax.Array, cols: jax.Array) -> tuple | None:
        """``([rows, cols] pairs, alpha)``: the pairs whose logits gain ``alpha * score``
        (before any pair is dropped), or None. Arguments as for :meth:`keep`."""
        if self.hardness is None:
            return None
        if self.bank:  # every entry is an earlier query's: none is hard, all in batch
            return jnp.ones((len(rows), len(cols)), bool), rm.alpha
        gi, gj = (rm.offset + rows)[:, None], (cm.offset + cols)[None, :]
        own, positive = gj // self.k == gi, gj == gi * self.k
        pairs = {"hard_negatives": own & ~positive, "in_batch_negatives": ~own,
                 "all_negatives": ~positive}[self.hardness]  # fmt: skip
        return pairs, rm.alpha

    def _dropped(self, rm: Meta, cm: Meta, gj: jax.Array) -> jax.Array | None:
        """The false negatives: pairs the ids or the guide drop (or None)."""
        drop = None
        if rm.pid is not None:
            drop = _equal(rm.pid, cm.pid)
        if rm.qid is not None:
            same = _equal(rm.qid, cm.qid)
            drop = _or(drop, same & (gj % self.k == 0) if self.docs else same)
        if self.guide is not None:
            acc = jnp.promote_types(jnp.result_type(rm.g, cm.g), jnp.float32)
            scores = jnp.matmul(rm.g, cm.g.T, preferred_element_type=acc)
            t, margin = rm.t, rm.margin
            bar = t - margin if self.guide == "absolute" else t - jnp.abs(t) * margin
            # One boolean tile, materialised: else each consumer recomputes it from the
            # scores, which then stay live beside the logits (a fourth float tile).
            drop = jax.lax.optimization_barrier(_or(drop, scores > bar[:, None]))
        return drop


class Mask(NamedTuple):
    """The pairs a loss keeps: a :class:`Rule` and the :class:`Meta` of its rows and
    columns."""

    rule: Rule
    rows: Meta
    cols: Meta
