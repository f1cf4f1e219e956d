"""What a loss computes: its families of logits (a :class:`Spec`), and its dense form.

A *family* scores one side's rows against one side's columns: queries (``"x"``) or
each query's positive document (``"p"``, rows ``0, k, 2k, ...`` of ``y``, read in
place) against queries (``"x"``) or documents (``"y"``), with a :class:`masks.Rule`
saying which pairs it keeps. Row ``i`` of every family belongs to query ``i``.
Families of one *group* share one log-sum-exp; each group has its own target, and a
query's loss is the mean over groups of ``lse_g - target_g``. A :class:`Spec` carries
the strategy (``Softmax``; ``Sigmoid`` sums one family's pairwise terms instead) and
the score (``Dot``, or ``MaxSim`` over token vectors); SigLIP, MaxSim and InfoNCE with
ids alone are specs of one family (:func:`one`), whose logits may also take a bias.
:func:`dense` is every loss's dense form.

Two forms, the same values: :func:`dense` (whole logit matrices) and ``engine.Engine``
(tiles, a custom VJP, on one device or a ring of devices). The helpers here (the
engine's :class:`Inputs`, the rows and columns of a family, the cotangents of the
metadata) serve both. A loss's :class:`Metadata` lives here, beside the :class:`Inputs`
that carry it: it is what a spec's families read (their rules' ``masks.Meta`` per side,
their :class:`Targets` by :attr:`Family.target`), where ``masks`` keeps what one tile's
mask reads.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from gc_jax.losses._engine import blockwise as _blockwise
from gc_jax.losses._engine import tiles as _tiles
from gc_jax.losses._engine.masks import Meta, Rule
from gc_jax.losses._engine.scores import Dot, Score
from gc_jax.losses._engine.sides import Side, Sides, gathered, is_bank
from gc_jax.losses._engine.strategies import Sigmoid, Softmax, Strategy
from gc_jax.losses._engine.tiles import Firsts

Scalar = jax.Array
Target = Literal["first", "self"]


class Targets(NamedTuple):
    """Each row's target column, by :attr:`Family.target`: ``first`` (column
    ``i * k``, the query's positive document) and ``self`` (column ``i``)."""

    first: Any = None
    self: Any = None


class Metadata(NamedTuple):
    """A loss's metadata: its rows' and columns' :class:`Meta` by side (:class:`Sides`),
    and its families' :class:`Targets`."""

    cols: Sides
    rows: Sides
    targets: Targets = Targets()


class Family(NamedTuple):
    """One family of logits (static).

    Attributes:
      rows: ``"x"`` (queries) or ``"p"`` (each query's positive document).
      cols: ``"x"`` (queries) or ``"y"`` (documents); ``"bx"``, ``"by"``: a bank's
        (``_bank``): constants, so only the rows' gradient sweep runs on them.
      rule: the pairs kept, or None: every pair.
      group: the log-sum-exp it adds to.
      target: the name of the targets array in the metadata (the column of each
        row's positive), or None: no target in this family.
    """

    rows: Literal["x", "p"]
    cols: Side  # ``"x"``, ``"y"``, or a bank's ``"bx"``/``"by"`` (no gradient)
    rule: Rule | None
    group: int = 0
    target: Target | None = None


class Spec(NamedTuple):
    """The families of a loss (static): ``families[0]`` has rows ``"x"`` and a target.

    Attributes:
      families: the families of logits.
      groups: how many log-sum-exps (softmax) a query's loss averages.
      k: documents per query.
      kind: the strategy (``strategies``): :class:`Softmax` (InfoNCE, CLIP, GIST) or
        ``Sigmoid`` (SigLIP: one family, its sum of pairwise terms).
      score: how a tile is scored (``scores``): ``Dot`` or ``MaxSim``.
    """

    families: tuple[Family, ...]
    groups: int
    k: int
    kind: Strategy = Softmax
    score: Score = Dot


def one(kind: Strategy, score: Score = Dot, rule: Rule | None = None, k: int = 1) -> Spec:
    """The spec of one family of logits: queries ``x`` against the documents ``y``, each
    query's target its document ``i * k`` (``meta.targets.first``), pairs kept by
    ``rule`` (None: every pair). SigLIP, MaxSim and InfoNCE with ids alone are these."""
    return Spec((Family("x", "y", rule, 0, "first"),), 1, k, kind, score)


def rows_of(fam: Family, sides: Sides, k: int) -> Any:
    return sides.x if fam.rows == "x" else Firsts(sides.y, k)


def cols_key(fam: Family, sides: Sides) -> str:
    """The side holding the family's columns: the gathered ones if any."""
    if is_bank(fam.cols):
        return fam.cols
    cols = gathered(fam.cols)
    return cols if sides.of(cols) is not None else fam.cols


def targets_of(fam: Family, meta: Metadata) -> jax.Array | None:
    """The family's targets (the column of each row's positive), or None."""
    return None if fam.target is None else getattr(meta.targets, fam.target)


def dense(spec: Spec, sides: Sides, scalars: tuple, meta: Metadata) -> jax.Array:
    """Per-query losses from whole logit matrices (the families' pairs masked out).

    ``scalars``: ``(scale, bias)`` in the accumulation dtype (the bias None: none).
    """
    groups = [[] for _ in range(spec.groups)]
    target = [0.0] * spec.groups
    for fam in spec.families:
        z, keep, targets = _dense_logits(spec, fam, sides, scalars, meta)
        if spec.kind is Sigmoid:  # a sum of pairwise terms, one family
            return _sigmoid_rows(z, keep, targets)
        groups[fam.group].append(z if keep is None else jnp.where(keep, z, -jnp.inf))
        if targets is not None:
            pos = jnp.arange(z.shape[1]) == targets[:, None]
            target[fam.group] = target[fam.group] + jnp.sum(jnp.where(pos, z, 0), axis=1)
    lse = [jax.nn.logsumexp(jnp.concatenate(g, axis=1), axis=1) for g in groups]
    return sum(a - b for a, b in zip(lse, target, strict=True)) / spec.groups


def _dense_logits(spec: Spec, fam: Family, sides: Sides, scalars: tuple, meta: Metadata):
    """Family ``fam``'s whole ``[rows, cols]`` logits, the pairs it keeps (None: all) and
    its targets (None: none)."""
    (scale, bias), score = scalars, spec.score
    rows, cols = _tiles.dense(rows_of(fam, sides, spec.k)), sides.of(cols_key(fam, sides))
    hard = fam.rule is not None and fam.rule.hardness is not None  # boosts read raw scores
    raw = score.raw(rows, cols, scale.dtype)[0] if hard else None
    z = scale * raw if hard else _scaled(spec, rows, cols, scale)
    z = z if bias is None else z + bias
    if fam.rule is None:
        return z, None, targets_of(fam, meta)
    rm, cm = _tiles.dense(meta.rows.of(fam.rows)), _tiles.dense(meta.cols.of(fam.cols))
    at = (rm, cm, jnp.arange(_tiles.count(rows)), jnp.arange(_tiles.count(cols)))
    keep, boost = fam.rule.keep(*at), fam.rule.boost(*at)
    if boost is not None:
        z = z + jnp.where(boost[0], boost[1] * jax.lax.stop_gradient(raw), 0)
    return z, keep, targets_of(fam, meta)


def _scaled(spec: Spec, rows: Any, cols: Any, scale: Scalar) -> jax.Array:
    """``scale`` times the whole ``[rows, cols]`` scores, accumulated in ``scale``'s dtype.

    Sigmoid's rows of one vector already in that dtype are scaled before the product,
    on ``[rows, dim]``, so the compiler need not keep the unscaled product as a second
    ``[rows, cols]`` buffer (XLA:CPU does; see docs/benchmarks/memory.md, "The dense
    loss's third B x B buffer"). The softmax forms scale the product: scaled rows would
    save that buffer there too, but add ops to their programs. Narrow rows are never
    rounded again by the scale: it multiplies the accumulated product.
    """
    if spec.kind is Sigmoid and spec.score is Dot and rows.dtype == scale.dtype:
        return jnp.matmul(rows * scale, cols.T, preferred_element_type=scale.dtype)
    return scale * spec.score.raw(rows, cols, scale.dtype)[0]


def _sigmoid_rows(z: jax.Array, keep: Any, targets: jax.Array) -> jax.Array:
    """Per-row sums of the sigmoid's terms ``-log sigmoid(label * z)`` over the kept
    pairs of whole logits ``z``, ``label`` ``+1`` at each row's target, ``-1`` elsewhere."""
    positive = jnp.arange(z.shape[1]) == targets[:, None]
    labels = jnp.where(positive, 1.0, -1.0).astype(z.dtype)
    terms = -jax.nn.log_sigmoid(labels * z)
    return jnp.sum(terms if keep is None else jnp.where(keep, terms, 0), axis=1)


class Inputs(NamedTuple):
    """The inputs of a loss's families (a pytree): its rows and columns by side, the
    logits' multiplier, their metadata, and the bias added to every logit (None: 0)."""

    sides: Sides
    scale: Scalar
    meta: Metadata
    bias: Scalar | None = None


def mean(losses: tuple) -> jax.Array:
    """The mean of the groups' per-row losses (one group: its own, no arithmetic)."""
    return losses[0] if len(losses) == 1 else sum(losses) / len(losses)


def cotangents(score: Any, sides: Sides, grads: Sides) -> Sides:
    """The cotangent of ``sides`` from the gradients of each side's ``score.leaf``."""
    pairs = zip(sides, grads, strict=True)
    return Sides(*(None if d is None else _blockwise.cotangent(score, v, d) for v, d in pairs))


def add_alpha(dalpha: Any, more: list) -> Any:
    """``dalpha`` plus one family's (``more``: empty without hardness); None: none yet."""
    if not more:
        return dalpha
    return more[0] if dalpha is None else dalpha + more[0]


def alpha_cotangent(meta: Metadata, dalpha: Any) -> Metadata | None:
    """The cotangent of ``meta``: None, but the hardness strength's ``dalpha``.

    The strength sits in both rows' metadata (queries' and positives'); only the
    queries' families boost logits, so its whole gradient goes there."""
    if dalpha is None:
        return None
    cotangent = jax.tree.map(lambda _: None, meta)
    x = cotangent.rows.x._replace(alpha=dalpha.astype(meta.rows.x.alpha.dtype))
    return cotangent._replace(rows=cotangent.rows._replace(x=x))


def zeros_of(v: jax.Array, *others: Any) -> jax.Array:
    """Zeros like ``v``, broadcast from a zero computed from ``v`` itself.

    A constant zero would be one broadcast, shared by every side's buffer of that
    shape and copied into each (a batch-sized temporary); this one is ``v``'s own.
    """
    zero = jnp.where(v[0, 0] > jnp.inf, 1, 0).astype(v.dtype)  # never true, NaN included
    return _tiles.varying_like(jnp.full_like(v, zero), *others)


def with_alpha(meta: Metadata, alpha: Any) -> Metadata:
    """``meta`` with the hardness strength ``alpha`` in every row's metadata (``alpha``
    varying like the rows: its cotangent, summed over this device's rows, is then
    summed over devices as ``scale``'s is)."""
    rows = jax.tree.map(lambda m: m._replace(alpha=alpha), meta.rows, is_leaf=_is_meta)
    return meta._replace(rows=rows)


def _is_meta(v: Any) -> bool:
    return isinstance(v, Meta)
