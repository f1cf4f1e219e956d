"""The options of :func:`contrastive_loss`: checked, then as families (plain InfoNCE is one).

``directions`` and ``partition_mode`` (as sentence-transformers' 6.2
``MultipleNegativesRankingLoss`` names them), false-negative ids (``query_ids``,
``doc_ids``) and a guide's filtering (``guide``, ``margin_strategy``, ``margin``, as
its ``GISTEmbedLoss``). :func:`spec` turns them into families of logits
(``_families``); :func:`metadata` gives the tiles the per-row arrays their rules read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gc_jax import _narrow
from gc_jax.losses._engine.families import Family, Metadata, Spec, Targets, one
from gc_jax.losses._engine.masks import Meta, Rule
from gc_jax.losses._engine.scores import Dot, Score
from gc_jax.losses._engine.sides import Sides, banked
from gc_jax.losses._engine.strategies import Strategy
from gc_jax.losses._engine.tiles import Firsts, Repeated

DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
PARTITION_MODES = ("joint", "per_direction")
MARGIN_STRATEGIES = ("absolute", "relative")
HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")


class Options(NamedTuple):
    """The checked options (directions static; ids and guide arrays or None)."""

    directions: tuple[str, ...] = ("query_to_doc",)
    partition_mode: str = "joint"
    query_ids: jax.Array | None = None
    doc_ids: jax.Array | None = None
    guide: tuple[jax.Array, jax.Array] | None = None
    margin_strategy: str = "absolute"
    margin: Any = 0.0
    hardness_mode: str | None = None
    hardness_strength: Any = 0.0
    bank: Any = None  # a ``_bank.Bank``

    def per_row(self) -> PerRow:
        """The per-row arrays of these options (what travels with the rows)."""
        return PerRow(self.bank, self.doc_ids, self.guide, self.query_ids)

    def with_rows(self, rows: PerRow) -> Options:
        """These options with their per-row arrays ``rows`` (e.g. one device's)."""
        return self._replace(**rows._asdict())

    def map_arrays(self, f) -> Options:
        """These options with ``f`` applied to every per-row array (ids, the guide's, the
        bank's rows; not the bank's count, a scalar)."""
        apply = lambda v: None if v is None else jax.tree.map(f, v)
        bank = self.bank
        if bank is not None:
            bank = apply(bank._replace(count=None))._replace(count=bank.count)
        return self._replace(
            query_ids=apply(self.query_ids),
            doc_ids=apply(self.doc_ids),
            guide=apply(self.guide),
            bank=bank,
        )


class PerRow(NamedTuple):
    """The options' arrays split like the rows (None where absent), passed with the rows
    to a loss's per-device body. Alphabetical: a pytree's leaves in the order of the
    dicts it replaced, so the compiled programs did not change."""

    bank: Any = None  # a ``_bank.Bank``, its count None (it travels as a scalar)
    doc_ids: jax.Array | None = None
    guide: tuple[jax.Array, jax.Array] | None = None
    query_ids: jax.Array | None = None


def check_directions(directions: Any, partition_mode: Any) -> tuple[str, ...]:
    """The directions, in the canonical order; raises on unknown or unsupported ones."""
    if isinstance(directions, str) or not isinstance(directions, tuple | list):
        raise TypeError(
            f"directions must be a tuple of direction names, got {directions!r}: e.g. "
            "directions=('query_to_doc', 'query_to_query', 'doc_to_query', 'doc_to_doc') "
            "(GTE's improved contrastive loss)."
        )
    unknown = [d for d in directions if d not in DIRECTIONS]
    if unknown or len(set(directions)) != len(directions) or not directions:
        raise ValueError(
            f"directions must be distinct names among {DIRECTIONS}, got {tuple(directions)!r}."
        )
    if "query_to_doc" not in directions:
        raise ValueError(
            f"directions must include 'query_to_doc' (it holds the positive pair), got "
            f"{tuple(directions)!r}."
        )
    if partition_mode not in PARTITION_MODES:
        raise ValueError(
            f"partition_mode must be one of {PARTITION_MODES}, got {partition_mode!r}."
        )
    same_type = sorted(set(directions) & {"query_to_query", "doc_to_doc"})
    if partition_mode == "per_direction" and same_type:
        raise ValueError(
            f"partition_mode='per_direction' needs the positive pair in every direction's "
            f"candidates, and {same_type} have none (as in sentence-transformers): use "
            "partition_mode='joint' with them."
        )
    return tuple(d for d in DIRECTIONS if d in directions)


def check_ids(ids: Any, rows: int, name: str, side: str) -> jax.Array | None:
    """``ids`` as ``[rows, w]`` integers (``[rows]`` becomes ``[rows, 1]``), or None."""
    if ids is None:
        return None
    dtype = getattr(ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        got = dtype if dtype is not None else type(ids).__name__
        raise TypeError(
            f"{name} must be an integer array (an id per row of {side}; e.g. "
            f"gc_jax.losses.text_ids of its tokens), got {got}."
        )
    shape = tuple(ids.shape)
    if len(shape) not in (1, 2) or shape[0] != rows:
        raise ValueError(
            f"{name} must hold one id per row of {side}: shape ({rows},) or ({rows}, w), "
            f"got {shape} (across devices: this device's rows, split like {side})."
        )
    return ids if len(shape) == 2 else ids.reshape(rows, 1)


def check_guide(guide: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """The guide's ``(queries, documents)`` representations, checked against ``x``, ``y``."""
    if guide is None:
        return None
    if not isinstance(guide, tuple | list) or len(guide) != 2:
        raise TypeError(
            "guide must be a pair (guide_x, guide_y): the guide model's representations "
            f"of the rows of x and of y, got {type(guide).__name__}."
        )
    for i, (g, v, side) in enumerate(zip(guide, (x, y), ("x", "y"), strict=True)):
        shape, dtype = getattr(g, "shape", None), getattr(g, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"guide[{i}] must be a float array, got {dtype or type(g).__name__}.")
        if len(shape) != 2 or shape[0] != v.shape[0]:
            raise ValueError(
                f"guide[{i}] must be the guide's representations of the rows of {side}, "
                f"[{v.shape[0]}, guide_dim], got shape {tuple(shape)} for {side} of shape "
                f"{tuple(v.shape)}: encode the same batch with the guide (across devices: "
                f"this device's rows, split like {side})."
            )
    if guide[0].shape[1] != guide[1].shape[1]:
        raise ValueError(
            f"guide[0] and guide[1] must have one dim, got {guide[0].shape} and {guide[1].shape}."
        )
    return tuple(jax.lax.stop_gradient(g) for g in guide)


def real_scalar(value: Any, name: str) -> float | None:
    """``value``'s float if it is known now (a Python or NumPy number, or a concrete
    ``jax.Array``), None if it is traced; raises unless a real scalar."""
    if isinstance(value, bool) or np.ndim(value) != 0:
        raise TypeError(f"{name} must be a real scalar, got {value!r}.")
    dtype = getattr(value, "dtype", None)
    real = lambda t: jnp.issubdtype(t, jnp.floating) or jnp.issubdtype(t, jnp.integer)
    if dtype is not None and not real(dtype):
        raise TypeError(f"{name} must be a real scalar, got one of dtype {dtype}.")
    if isinstance(value, jax.core.Tracer):
        return None
    value = np.asarray(value)  # NumPy's own ops: a concrete Array inside jit stays concrete
    if not np.isreal(value):
        raise TypeError(f"{name} must be a real scalar, got {value!r}.")
    return float(value.real)


def check_margin(margin: Any, strategy: Any, guide: Any) -> Any:
    """The guide's margin (a real scalar, no gradient); raises if set without a guide.

    It only moves the guide's thresholds, whose comparisons have a zero derivative:
    ``stop_gradient`` says so. A traced margin without a guide raises (its value,
    unknown here, decides whether it was set): pass a Python float.
    """
    if strategy not in MARGIN_STRATEGIES:
        raise ValueError(f"margin_strategy must be one of {MARGIN_STRATEGIES}, got {strategy!r}.")
    value = real_scalar(margin, "margin")
    if guide is None and value is None:
        raise TypeError(
            "margin is traced, and without a guide it must be 0 (a traced value cannot be "
            "checked): pass guide=(guide_x, guide_y) too, or a Python float margin."
        )
    if guide is None and (strategy != "absolute" or value != 0):
        raise ValueError(
            "margin and margin_strategy filter negatives by a guide's scores: pass "
            "guide=(guide_x, guide_y) too, or leave them at their defaults."
        )
    return jax.lax.stop_gradient(jnp.asarray(margin, float))  # float64 under x64


def check_hardness(mode: Any, strength: Any) -> Any:
    """The hardness strength (a real scalar, differentiable); raises on a mode it does
    not know, a negative strength, or one set without a mode.

    A concrete ``jax.Array`` is checked as a float is; a traced one is not checked for
    ``>= 0``, and raises without a mode (its value would decide whether it is ignored).
    """
    if mode is not None and mode not in HARDNESS_MODES:
        raise ValueError(f"hardness_mode must be None or one of {HARDNESS_MODES}, got {mode!r}.")
    value = real_scalar(strength, "hardness_strength")
    if value is None and mode is None:
        raise TypeError(
            "hardness_strength is traced and hardness_mode is None, which ignores it: pass "
            f"hardness_mode= too, one of {HARDNESS_MODES}, or a Python float strength."
        )
    if value is not None and value < 0:
        raise ValueError(f"hardness_strength must be >= 0, got {strength!r}.")
    if mode is None and value != 0:
        raise ValueError(
            f"hardness_strength={strength!r} weights the negatives hardness_mode names: "
            f"pass hardness_mode= too, one of {HARDNESS_MODES}."
        )
    return jnp.asarray(strength, float)


def spec(options: Options, k: int) -> Spec:
    """The families of logits for ``options``: one per direction, ``query_to_doc`` first."""
    joint = options.partition_mode == "joint"
    guide = None if options.guide is None else options.margin_strategy
    rule = lambda **kw: Rule(k=k, guide=guide, **kw)
    make = {
        "query_to_doc": Family(
            "x", "y", rule(protect="first", docs=True, hardness=options.hardness_mode), 0, "first"
        ),
        "query_to_query": Family("x", "x", rule(exclude="self")),
        "doc_to_query": Family(
            "p", "x", rule(protect="self"), 0 if joint else 1, None if joint else "self"
        ),
        "doc_to_doc": Family("p", "y", rule(exclude="owner", docs=True)),
        # GISTEmbedLoss' own blocks (``gist_loss``): self pairs are left to the guide,
        # and its positive-positive block holds no hard negative.
        "gist_query_to_query": Family("x", "x", rule()),
        "gist_doc_to_doc": Family("p", "y", rule(exclude="negatives", docs=True)),
    }
    families = tuple(make[d] for d in options.directions)
    if options.bank is not None:  # each direction's columns, and their bank's earlier ones
        bank = tuple(
            f._replace(cols=banked(f.cols), rule=f.rule.for_bank(), target=None) for f in families
        )
        families += bank
    return Spec(families, 1 if joint else len(options.directions), k)


def thresholds(guide: tuple[jax.Array, jax.Array], k: int) -> jax.Array:
    """``[n]``: the guide's score of each query's positive pair (in at least float32).

    Narrow floats: a product and a sum, which XLA fuses into one pass (a dot product
    would be given float32 copies of both sides first). Else a dot product of each
    query with its ``k`` documents (``[n, k]``, small), the first kept: no copy of the
    strided positives.
    """
    gx, gy = guide
    acc = jnp.promote_types(jnp.result_type(gx, gy), jnp.float32)
    grouped = Firsts(gy, k).grouped()
    if _narrow.is_narrow(gx) or _narrow.is_narrow(gy):
        return jnp.sum(gx.astype(acc) * grouped[:, 0].astype(acc), axis=-1)
    return jnp.einsum("nd,nkd->nk", gx, grouped, preferred_element_type=acc)[:, 0]


def metadata(
    options: Options,
    spec: Spec,
    offset: Any,
    col_offset: Any,
    cols: Options | None = None,
) -> Metadata:
    """What the tiles' rules read, for this device's rows and the columns they meet.

    ``offset``: the global index of this device's first query; ``cols``: the options
    whose ids and guide are the columns' (gathered in the gather form; default:
    ``options``), their first query's global index ``col_offset``.
    """
    cols = options if cols is None else cols
    k, qid, pid, guide = spec.k, options.query_ids, options.doc_ids, options.guide
    alpha = None if options.hardness_mode is None else options.hardness_strength
    row = Meta(offset=offset, pid=None if pid is None else Firsts(pid, k), qid=qid, alpha=alpha)
    rows = Sides(x=row, p=row)
    if guide is not None:
        row = row._replace(t=thresholds(guide, k), margin=options.margin)
        rows = Sides(x=row._replace(g=guide[0]), p=row._replace(g=Firsts(guide[1], k)))
    col_x, col_y = id_columns(cols.query_ids, cols.doc_ids, col_offset, k)
    if cols.guide is not None:
        col_x, col_y = col_x._replace(g=cols.guide[0]), col_y._replace(g=cols.guide[1])
    scored = {f.cols for f in spec.families}
    used = lambda side, meta: meta if side in scored else None
    return Metadata(cols=Sides(x=used("x", col_x), y=used("y", col_y)), rows=rows)


def id_columns(
    query_ids: Any, doc_ids: Any, offset: Any, k: int, live: Any = None
) -> tuple[Meta, Meta]:
    """The columns' metadata from their ids: the queries' (side ``x``) and the documents'
    (``y``, ``k`` per query), the first query's global index ``offset``; ``live``: which
    queries' columns are filled (a bank's; None: all). The one id-column builder: this
    step's columns (:func:`metadata`) and a bank's (``_bank.with_columns``)."""
    col_x = Meta(offset=offset, live=live)
    col_y = Meta(offset=offset * k, live=None if live is None else jnp.repeat(live, k))
    if doc_ids is not None:
        col_x = col_x._replace(pid=Firsts(doc_ids, k))
        col_y = col_y._replace(pid=doc_ids)
    if query_ids is not None:
        col_x = col_x._replace(qid=query_ids)
        col_y = col_y._replace(qid=Repeated(query_ids, k) if k > 1 else query_ids)
    return col_x, col_y


def one_spec(kind: Strategy, options: Options, k: int = 1, score: Score = Dot) -> Spec:
    """The spec of the losses of one family of logits (``sigmoid_loss``, ``maxsim_loss``):
    queries against documents, the pairs the ids of ``options`` match dropped as
    ``query_to_doc``'s are (none without ids)."""
    ids = options.query_ids is not None or options.doc_ids is not None
    return one(kind, score, Rule(protect="first", docs=True, k=k) if ids else None, k)


def targets(spec: Spec, offset: Any, n: int) -> Targets:
    """Each family's target columns, indexing the columns as :func:`metadata` numbers them
    (``offset``: the global index of this device's first query)."""
    index = offset + jnp.arange(n)
    used = {f.target for f in spec.families}
    return Targets(first=index * spec.k if "first" in used else None,
                   self=index if "self" in used else None)  # fmt: skip
