"""Losses over one or several families of logits, each query's row summed over all.

A *family* scores one side's rows against one side's columns: queries (``"x"``) or
each query's positive document (``"p"``, rows ``0, k, 2k, ...`` of ``y``, read in
place) against queries (``"x"``) or documents (``"y"``), with a :class:`_masks.Rule`
saying which pairs it keeps. Row ``i`` of every family belongs to query ``i``.
Families of one *group* share one log-sum-exp; each group has its own target, and a
query's loss is the mean over groups of ``lse_g - target_g``. A :class:`Spec` carries
the strategy (``Softmax``; ``Sigmoid`` sums one family's pairwise terms instead) and
the score (``Dot``, or ``MaxSim`` over token vectors); SigLIP, MaxSim and InfoNCE with
ids alone are specs of one family (:func:`one`), whose logits may also take a bias.

Three forms, the same values: :func:`dense` (whole logit matrices),
:func:`blockwise` (tiles, a custom VJP: :class:`Plan`; ``_ring_families`` runs the same
specs across devices). The blockwise backward adds each family's gradients into one buffer per
side (``_blockwise.backward(into=...)``): the first family writes its buffers over
copies of its inputs, the others add to them, so no batch-sized gradient is summed
outside the loops; a spec of one family writes them over copies of its inputs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gc_jax.losses._engine import blockwise as _blockwise
from gc_jax.losses._engine import sweeps as _sweeps
from gc_jax.losses._engine import tiles as _tiles
from gc_jax.losses._engine import vjp as _vjp
from gc_jax.losses._engine.masks import Mask, Meta, Metadata, Rule, Sides, Targets
from gc_jax.losses._engine.scores import Dot, Score
from gc_jax.losses._engine.strategies import Softmax, Strategy
from gc_jax.losses._engine.tiles import Firsts

Scalar = jax.Array


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

    rows: str
    cols: str  # or ``"bx"``/``"by"``: a bank's earlier queries/documents (no gradient)
    rule: Rule | None
    group: int = 0
    target: str | None = None


class Spec(NamedTuple):
    """The families of a loss (static): ``families[0]`` has rows ``"x"`` and a target.

    Attributes:
      families: the families of logits.
      groups: how many log-sum-exps (softmax) a query's loss averages.
      k: documents per query.
      kind: the strategy (``_strategies``): :class:`Softmax` (InfoNCE, CLIP, GIST) or
        ``Sigmoid`` (SigLIP: one family, its sum of pairwise terms).
      score: how a tile is scored (``_scores``): ``Dot`` or ``MaxSim``.
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


def one_meta(mask: Mask | None, targets: jax.Array) -> Metadata:
    """The metadata of :func:`one`'s family: ``mask``'s rows' and columns' (None: every
    pair is kept) and each row's target column."""
    targets = Targets(first=targets)
    if mask is None:
        return Metadata(Sides(), Sides(), targets)
    return Metadata(cols=Sides(y=mask.cols), rows=Sides(x=mask.rows), targets=targets)


def _rows_of(fam: Family, sides: Sides, k: int) -> Any:
    return sides.x if fam.rows == "x" else Firsts(sides.y, k)


def _cols_key(fam: Family, sides: Sides) -> str:
    """The side holding the family's columns: the gathered ones if any."""
    gathered = "c" + fam.cols
    return gathered if sides.of(gathered) is not None else fam.cols


def _mask(fam: Family, meta: Metadata) -> Mask | None:
    if fam.rule is None:
        return None
    return Mask(fam.rule, meta.rows.of(fam.rows), meta.cols.of(fam.cols))


def targets_of(fam: Family, meta: Metadata) -> jax.Array | None:
    """The family's targets (the column of each row's positive), or None."""
    return None if fam.target is None else getattr(meta.targets, fam.target)


def dense(spec: Spec, sides: Sides, scale: Scalar, meta: Metadata) -> jax.Array:
    """Per-query losses from whole logit matrices (the families' pairs masked out)."""
    groups = [[] for _ in range(spec.groups)]
    target = [0.0] * spec.groups
    for fam in spec.families:
        rows = _tiles.dense(_rows_of(fam, sides, spec.k))
        cols = sides.of(_cols_key(fam, sides))
        raw = jnp.matmul(rows, cols.T, preferred_element_type=scale.dtype)
        rm, cm = _tiles.dense(meta.rows.of(fam.rows)), _tiles.dense(meta.cols.of(fam.cols))
        at = (rm, cm, jnp.arange(raw.shape[0]), jnp.arange(raw.shape[1]))
        z, keep, boost = scale * raw, fam.rule.keep(*at), fam.rule.boost(*at)
        if boost is not None:
            z = z + jnp.where(boost[0], boost[1] * jax.lax.stop_gradient(raw), 0)
        groups[fam.group].append(z if keep is None else jnp.where(keep, z, -jnp.inf))
        targets = targets_of(fam, meta)
        if targets is not None:
            pos = jnp.arange(z.shape[1]) == targets[:, None]
            target[fam.group] = target[fam.group] + jnp.sum(jnp.where(pos, z, 0), axis=1)
    lse = [jax.nn.logsumexp(jnp.concatenate(g, axis=1), axis=1) for g in groups]
    return sum(a - b for a, b in zip(lse, target, strict=True)) / spec.groups


class Inputs(NamedTuple):
    """The inputs of a loss's families (a pytree): its rows and columns by side, the
    logits' multiplier, their metadata, and the bias added to every logit (None: 0)."""

    sides: Sides
    scale: Scalar
    meta: Metadata
    bias: Scalar | None = None


class Plan(NamedTuple):
    """The engine (``_vjp.Engine``) of ``spec``'s families on one device (or over the
    gathered columns), in tiles of ``block`` rows (static, hashable)."""

    spec: Spec
    block: int

    def forward(self, inputs: Inputs) -> tuple[jax.Array, tuple]:
        return forward(self.spec, self.block, inputs)

    def backward(self, inputs: Inputs, stats: tuple, g: jax.Array) -> Inputs:
        grads, (dscale, dbias), dalpha = backward(self.spec, self.block, inputs, stats, g)
        return Inputs(grads, dscale, alpha_cotangent(inputs.meta, dalpha), dbias)


def tiles_of(spec: Spec, block: int, fam: Family, inputs: Inputs) -> _blockwise.Tiles:
    """Family ``fam``'s tiles: its rows against its columns (the gathered ones if any)."""
    sides, scale, meta, bias = inputs
    rows, cols = _rows_of(fam, sides, spec.k), sides.of(_cols_key(fam, sides))
    bias = jnp.zeros((), scale.dtype) if bias is None else bias
    return _blockwise.Tiles(spec.kind, block, rows, cols, targets_of(fam, meta), scale, bias,
                            _mask(fam, meta), spec.score)  # fmt: skip


def mean(losses: tuple) -> jax.Array:
    """The mean of the groups' per-row losses (one group: its own, no arithmetic)."""
    return losses[0] if len(losses) == 1 else sum(losses) / len(losses)


def forward(spec: Spec, block: int, inputs: Inputs) -> tuple[jax.Array, tuple]:
    """Per-query losses and each group's statistic (its log-sum-exp), tile by tile."""
    sides, scale = inputs.sides, inputs.scale
    carries = [_blockwise.init(spec.kind, sides.x, sides.y, dtype=scale.dtype)] * spec.groups
    for fam in spec.families:
        tiles = tiles_of(spec, block, fam, inputs)
        carries[fam.group] = _blockwise.sweep(tiles, carries[fam.group])
    losses, stats = zip(*(spec.kind.finish(c) for c in carries), strict=True)
    return mean(losses), stats


def backward(spec, block, inputs, stats, g) -> tuple[Sides, tuple, Any]:
    """Cotangents of the sides, of ``(scale, bias)`` (the bias's None without one) and
    of the hardness strength (None without hardness), every family's added into one
    buffer per side."""
    sides = inputs.sides
    g = g / spec.groups
    grads, dscale, dbias, dalpha = Sides(), None, None, None
    for fam in spec.families:
        tiles, stat = tiles_of(spec, block, fam, inputs), (stats[fam.group], g)
        cols_key = _cols_key(fam, sides)
        if fam.cols.startswith("b"):  # a bank: the rows' sweep alone, no column gradient
            grads, (ds, db, *da) = _add_rows(fam, (tiles, *stat), grads, sides)
        elif len(spec.families) == 1:  # written over copies of x and y: no zeros needed
            dx, dcols, ds, db, *da = _blockwise.backward(tiles, *stat)
            grads = grads.put("x", dx).put(cols_key, dcols)
        else:
            grads, (ds, db, *da) = _add_family(fam, (tiles, *stat), grads, sides, cols_key)
        dscale, dbias = _plus(dscale, ds), _plus(dbias, db)
        dalpha = add_alpha(dalpha, da)
    dbias = None if inputs.bias is None else dbias
    return cotangents(spec.score, sides, grads), (dscale, dbias), dalpha


def _plus(total: Any, more: jax.Array) -> jax.Array:
    return more if total is None else total + more


def cotangents(score: Any, sides: Sides, grads: Sides) -> Sides:
    """The cotangent of ``sides`` from the gradients of each side's ``score.leaf``."""
    pairs = zip(sides, grads, strict=True)
    return Sides(*(None if d is None else _blockwise.cotangent(score, v, d) for v, d in pairs))


def add_alpha(dalpha: Any, more: list) -> Any:
    """``dalpha`` plus one family's (``more``: empty without hardness); None: none yet."""
    if not more:
        return dalpha
    return more[0] if dalpha is None else dalpha + more[0]


def alpha_cotangent(meta: dict, dalpha: Any) -> Any:
    """The cotangent of ``meta``: None, but the hardness strength's ``dalpha``.

    The strength sits in both rows' metadata (queries' and positives'); only the
    queries' families boost logits, so its whole gradient goes there."""
    if dalpha is None:
        return None
    cotangent = jax.tree.map(lambda _: None, meta)
    x = cotangent.rows.x._replace(alpha=dalpha.astype(meta.rows.x.alpha.dtype))
    return cotangent._replace(rows=cotangent.rows._replace(x=x))


def _add_family(fam, args, grads, sides, cols_key):
    """Adds one family's gradients into ``grads`` (a buffer per side, zeros if new);
    returns ``grads`` and the scalars' (``_sweeps.Sweeps.query_sweep``)."""
    for key in ("y" if fam.rows == "p" else "x", cols_key):
        if grads.of(key) is None:
            grads = grads.put(key, _zeros_of(sides.of(key), *sides))
    row_key = "x" if fam.rows == "x" else "y"
    row_buf = grads.of(row_key) if fam.rows == "x" else Firsts(grads.of(row_key), fam.rule.k)
    same = row_key == cols_key  # rows and columns are rows of one array
    row_buf, col_buf, *scalars = _blockwise.backward(
        *args, into=(row_buf, None if same else grads.of(cols_key))
    )
    grads = grads.put(row_key, row_buf.array if isinstance(row_buf, Firsts) else row_buf)
    if not same:
        grads = grads.put(cols_key, col_buf)
    return grads, scalars


def _add_rows(fam, args, grads, sides):
    """Adds one family's rows' gradients into ``grads``: its columns are constants."""
    row_key = "x" if fam.rows == "x" else "y"
    if grads.of(row_key) is None:
        grads = grads.put(row_key, _zeros_of(sides.of(row_key), *sides))
    buf = grads.of(row_key) if fam.rows == "x" else Firsts(grads.of(row_key), fam.rule.k)
    buf, *scalars = _sweeps.Sweeps(*args).query_sweep(buf, add=True)
    grads = grads.put(row_key, buf.array if isinstance(buf, Firsts) else buf)
    return grads, scalars


def _zeros_of(v: jax.Array, *others: Any) -> jax.Array:
    """Zeros like ``v``, broadcast from a zero computed from ``v`` itself.

    A constant zero would be one broadcast, shared by every side's buffer of that
    shape and copied into each (a batch-sized temporary); this one is ``v``'s own.
    """
    zero = jnp.where(v[0, 0] > jnp.inf, 1, 0).astype(v.dtype)  # never true, NaN included
    return _tiles.varying_like(jnp.full_like(v, zero), *others)


def blockwise(spec: Spec, block: int, inputs: Inputs) -> jax.Array:
    """Per-query losses, tile by tile (a custom VJP).

    ``inputs.sides``: ``x`` (this device's queries), ``y`` (their documents) and, in
    the gather form, ``cx``/``cy``: the columns gathered from every device (else None:
    the columns are ``x`` and ``y`` themselves). The scalars are cast to the
    accumulation dtype, varying like the rows.
    """
    sides, scale, meta, bias = inputs
    arrays = [v for v in sides if v is not None]
    scalars = (scale,) if bias is None else (scale, bias)
    leaves = [spec.score.leaf(v) for v in arrays]
    acc = _blockwise.accumulation_dtype(*leaves, *scalars)
    scale, bias = _tiles.varying_like(tuple(_cast(v, acc) for v in (scale, bias)), *arrays)
    if meta.rows.x is not None and meta.rows.x.alpha is not None:  # differentiated like scale
        meta = vary_alpha(meta, *arrays)
    return _vjp.rowwise(Plan(spec, block), Inputs(sides, scale, meta, bias))


def _cast(v: Any, dtype: Any) -> Any:
    return None if v is None else jnp.asarray(v, dtype)


def vary_alpha(meta: Metadata, *arrays: Any) -> Metadata:
    """``meta`` with the hardness strength cast to vary like ``arrays`` (its cotangent,
    summed over this device's rows, is then summed over devices as ``scale``'s is)."""
    alpha = _tiles.varying_like(meta.rows.x.alpha, *arrays)
    rows = jax.tree.map(lambda m: m._replace(alpha=alpha), meta.rows, is_leaf=_is_meta)
    return meta._replace(rows=rows)


def _is_meta(v: Any) -> bool:
    return isinstance(v, Meta)


def one_family(kind: Strategy, x: Any, ys: Any, scalars: tuple, block: int) -> jax.Array:
    """Per-row losses of one family of logits, rows ``x`` against columns ``ys``, each
    row ``i``'s target column ``i`` (:func:`one`), blockwise; ``scalars``: ``(scale, bias)``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gc_jax.losses._engine.strategies import Sigmoid
      >>> x, ys = jnp.eye(3), jnp.eye(3)[::-1]
      >>> dense = -jax.nn.log_softmax(2.0 * x @ ys.T)[jnp.arange(3), jnp.arange(3)]
      >>> bool(jnp.allclose(one_family(Softmax, x, ys, (2.0, 0.0), block=2), dense))
      True
      >>> labels = 2 * jnp.eye(3) - 1
      >>> dense = -jax.nn.log_sigmoid(labels * (5.0 * x @ x.T - 1.0)).sum(1)
      >>> rows = one_family(Sigmoid, x, x, (5.0, -1.0), block=2)
      >>> bool(jnp.allclose(rows, dense))
      True
    """
    meta = one_meta(None, jnp.arange(len(x)))
    inputs = Inputs(Sides(x=x, y=ys), scalars[0], meta, scalars[1])
    return blockwise(one(kind), block, inputs)
