"""Checking that gradient caching is exact for *your* model.

Gradient caching is exact when every row's representation depends only on that row
(and the chunk's key). Models with cross-example state (BatchNorm in training mode,
in-batch statistics, attention across the rows of a packed line) are not: their
chunks see different batches. Run :func:`assert_matches_full_batch` once on a small batch to
find out before training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from gc_jax import _validation, packing
from gc_jax._base import PyTree
from gc_jax._chunks import plan as _plan
from gc_jax._chunks.lines import SEGMENT_STARTS
from gc_jax._chunks.plan import ChunkSize

__all__ = [
    "assert_matches_full_batch",
    "full_batch_value_and_grad",
]


def _full_batch_reps(encode, params, x, chunk_size, rng, index):
    """Encodes the batch in one differentiable graph; with an rng, chunk by chunk with
    gc_jax's keys so dropout draws the same masks (without one, all rows at once)."""
    if rng is None:
        return encode(params, x, None)
    return _chunk_reps(encode, params, x, chunk_size, rng, index)


def _chunk_reps(encode, params, x, chunk_size, rng, index, trim=True):
    """The batch encoded in the chunks gc_jax cuts on one device (token chunks trimmed,
    unless not ``trim``), with their keys, differentiably (``Plan.reference``)."""
    name = f"inputs[{index}]"
    _, plan, key = _plan.make(x, chunk_size, rng=rng, index=index, name=name, one_device=True)
    return plan.reference(encode, params, x, key, trim)


def _probed(encode: Callable) -> Callable:
    """``encode``, also returning for each output row whether every output of its packed
    chunk is finite (its empty slots' too, which are not written; True where the chunk
    is not packed) and where its row starts in its line (0 where not packed)."""

    def probe(params, chunk, key):
        out = encode(params, chunk, key)
        leaves = jax.tree.leaves(out)
        n = leaves[0].shape[0]
        finite, start = jnp.bool_(True), jnp.zeros((n,), jnp.int32)
        if packing.is_packed(chunk) and chunk[SEGMENT_STARTS].size == n:
            finite = jnp.all(jnp.asarray([jnp.isfinite(leaf).all() for leaf in leaves]))
            start = chunk[SEGMENT_STARTS].reshape(-1).astype(jnp.int32)
        return out, jnp.broadcast_to(finite, (n,)), start

    return probe


def _rows_differ(got: PyTree, want: PyTree, rtol: float, atol: float) -> np.ndarray:
    """``bool[rows]``: the rows where any leaf of ``got`` is not close to ``want``'s."""
    differ = None
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        close = np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
        row = ~close.reshape(close.shape[0], -1).all(axis=1)
        differ = row if differ is None else differ | row
    return differ


def _named(rows: np.ndarray) -> str:
    """A few row numbers, for a message."""
    found = np.flatnonzero(rows).tolist()
    return ", ".join(map(str, found[:8])) + (", ..." if len(found) > 8 else "")


def _check_token_chunks(encoders, chunk_size, params, inputs, rtol, atol) -> None:
    """Raises if an input's encoder gives other outputs for its token-budget chunks
    trimmed to their bucket than at the padded length (same rows, no key), or for its
    packed chunks than for the batch unpacked, naming the packing rule it breaks where
    one is clear (NaN in empty slots, positions counted from the line's start). Outputs
    with a token axis are compared up to the bucket's length, where the cache holds
    them (past it the cache is zero and the loss must mask those tokens)."""
    n = len(inputs)
    encs = _validation.per_input(encoders, n, "encoders", lambda e, _: e)
    sizes = _validation.per_input(chunk_size, n, "chunk_size", _plan.check)
    for i, (e, x, s) in enumerate(zip(encs, inputs, sizes, strict=True)):
        if not _plan.by_tokens(s):  # only token budgets and packings trim rows
            continue
        both = jax.jit(lambda p, x, e=e, s=s, i=i: [
            _chunk_reps(_probed(e), p, x, s, None, i, trim) for trim in (True, False)
        ])  # fmt: skip
        (trimmed, finite, start), (padded, _, _) = both(params, x)
        if not np.all(finite) and all(np.isfinite(r).all() for r in jax.tree.leaves(trimmed)):
            raise AssertionError(_EMPTY_SLOTS.format(i=i))
        differ = _rows_differ(trimmed, padded, rtol, atol)
        if not differ.any():
            continue
        details = _chex_details(trimmed, padded, rtol, atol)
        later = np.asarray(start) > 0
        if later.any() and not (differ & ~later).any():
            raise AssertionError(_POSITIONS.format(i=i, rows=_named(differ), details=details))
        raise AssertionError(_plan.trimming_error(s, i, details))


def _chex_details(got: PyTree, want: PyTree, rtol: float, atol: float) -> str:
    """What ``chex.assert_trees_all_close`` says about ``got`` and ``want``."""
    try:
        chex.assert_trees_all_close(got, want, rtol=rtol, atol=atol)
    except AssertionError as err:
        return str(err)
    return ""


_EMPTY_SLOTS = (
    "encoders[{i}] returns NaN or infinite values for the empty slots of the "
    "TokenPacking's packed chunks of inputs[{i}] (slots of a line that holds fewer rows "
    "than segments), though every row's own output is finite: its own pooling leaves a "
    "slot without tokens a zero vector and then normalises it (0 / 0); an empty slot's "
    "output is not written, but its zero gradient times that NaN makes the step's "
    "gradients NaN. Pool with gc_jax.packing.mean_pool or first_token, "
    "which fill an empty slot with the line's first row, or give empty slots a nonzero "
    "vector before normalising."
)
_POSITIONS = (
    "encoders[{i}] gives other outputs for the TokenPacking's packed chunks of "
    "inputs[{i}] than for the batch unpacked in rows {rows}, each placed after the start "
    "of its line, while the rows that start a line match and no row's output depends on "
    "the other rows: the encoder counts positions from the line's start (e.g. "
    "jnp.arange(L) for position embeddings) instead of from each row's start, so "
    "gradient caching with this packing is not exact. Read each token's position in its "
    "row with gc_jax.packing.positions(chunk) (the chunk's 'position_ids'; arange on an "
    "unpacked batch). Details: {details}"
)


def _check_rows_apart(encoders, chunk_size, params, inputs, rng, rtol, atol) -> None:
    """Raises if a row's output changes when other rows of the batch change.

    Each input is planned once; then rows are replaced by their neighbour's (row
    ``r + 1``'s) in the *same* chunks, with the same keys and (token chunks) the same
    lengths and places, so that a row-independent encoder, dropout included, gives
    its kept rows the same outputs. The replaced rows are those with bit ``k`` of
    their index set, then clear, for every ``k``: every two rows are apart once.
    """
    n = len(inputs)
    encs = _validation.per_input(encoders, n, "encoders", lambda e, _: e)
    sizes = _validation.per_input(chunk_size, n, "chunk_size", _plan.check)
    for i, (e, x, s) in enumerate(zip(encs, inputs, sizes, strict=True)):
        changed, packed = _moved_rows(e, s, i, params, x, rng, rtol, atol)
        if changed is not None:
            raise AssertionError(_mixed_rows(chunk_size, i, changed, packed))


def _moved_rows(encode, chunk_size, i, params, x, rng, rtol, atol):
    """``(rows, packed)``: the kept rows of input ``i`` whose outputs moved in the first
    trial where any did (None if none did), and whether its chunks are packed."""
    packed = []

    def probe(p, chunk, key):
        packed.append(packing.is_packed(chunk))
        return encode(p, chunk, key)

    def encoded(p, x, other, key):
        name = f"inputs[{i}]"
        _, plan, key = _plan.make(x, chunk_size, rng=key, index=i, name=name, one_device=True)
        return plan.reference(probe, p, other, key)

    run = jax.jit(encoded)
    want = run(params, x, x, rng)
    moved = jax.tree.map(lambda a: jnp.roll(a, -1, axis=0), x)
    for kept in _splits(_validation.leading_size(x, f"inputs[{i}]")):
        keep = lambda a, b, k=kept: jnp.where(k.reshape(-1, *[1] * (a.ndim - 1)), a, b)
        got = run(params, x, jax.tree.map(keep, x, moved), rng)
        changed = _rows_differ(got, want, rtol, atol) & kept
        if changed.any():
            return changed, any(packed)
    return None, any(packed)


def _splits(rows: int) -> list[np.ndarray]:
    """The rows kept in each trial: bit ``k`` of the row's index clear, then set."""
    index = np.arange(rows)
    bits = range(max(int(rows - 1).bit_length(), 0))
    return [(index >> k & 1) == side for k in bits for side in (0, 1)]


def _mixed_rows(chunk_size, i: int, changed: np.ndarray, packed: bool) -> str:
    """The error of an encoder whose rows depend on each other."""
    fix = (
        "With a TokenPacking, a row shares its line with other rows: a token must attend "
        "only to its own row's tokens (mask attention with gc_jax.packing."
        "attention_mask(chunk)), and each row be pooled on its own (gc_jax.packing."
        "mean_pool or first_token); nothing may mix the rows of a chunk (BatchNorm in "
        "training mode, statistics over the batch axis)."
        if packed
        else "Replace BatchNorm in training mode by LayerNorm or GroupNorm (or run it on "
        "running statistics), and compute no statistics over the batch axis (such as "
        "x - x.mean(0))."
    )
    return (
        f"gradient caching with chunk_size={chunk_size} differs from the full batch. Does "
        f"the model mix rows of a batch? encoders[{i}] does: the outputs of rows "
        f"{_named(changed)} of inputs[{i}] change when other rows change (each row kept in "
        "its chunk, with its key), so its rows depend on each other and a chunk sees "
        f"other rows than the full batch (whenever a batch is cut in more than one). {fix}"
    )


def full_batch_value_and_grad(
    loss_fn: Callable[..., Any],
    encoders: Callable | Sequence[Callable],
    chunk_size: ChunkSize | Sequence[ChunkSize],
    *,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """The plain ``jax.value_and_grad`` that ``cached_value_and_grad`` must equal.

    Same arguments and returned signature as ``gc_jax.cached_value_and_grad``
    (single device), but every representation stays in one autodiff graph, so it
    needs the whole batch's activations in memory. ``chunk_size`` is only used to
    hand each chunk the same dropout key as gc_jax does.

    Without ``rng``, every input is encoded whole, at its padded length: with a
    :class:`gc_jax.TokenBudget`, this also checks that trimming a chunk to its
    bucket's length does not change the encoder's outputs (with a
    :class:`gc_jax.TokenPacking`, that packing does not). With ``rng``, each row is
    encoded in the chunk, trimmed as gc_jax cuts it, with that chunk's key, so that
    dropout draws the same masks (every chunk the budget could cut is encoded: meant
    for small batches); encoded in gc_jax's chunks, it cannot see rows that depend on
    each other, which :func:`assert_matches_full_batch` checks on its own.

    Examples:
      >>> import jax.numpy as jnp, gc_jax
      >>> encode = lambda w, x, key: x @ w
      >>> loss = lambda w, q, d: gc_jax.losses.contrastive_loss(q, d)
      >>> ref = gc_jax.testing.full_batch_value_and_grad(loss, encode, 2)
      >>> value, grads = ref(jnp.eye(3), jnp.eye(3), jnp.eye(3))
      >>> grads.shape
      (3, 3)
    """

    def value_and_grad_fn(params, *inputs, rng=None, **loss_kwargs):
        n = len(inputs)
        encs = _validation.per_input(encoders, n, "encoders", lambda e, _: e)
        sizes = _validation.per_input(chunk_size, n, "chunk_size", _plan.check)

        def total(p):
            reps = [
                _full_batch_reps(e, p, x, s, rng, i)
                for i, (e, x, s) in enumerate(zip(encs, inputs, sizes, strict=True))
            ]
            return loss_fn(p, *reps, **loss_kwargs)

        return jax.value_and_grad(total, has_aux=has_aux)(params)

    return value_and_grad_fn


def assert_matches_full_batch(
    loss_fn: Callable[..., Any],
    encoders: Callable | Sequence[Callable],
    chunk_size: ChunkSize | Sequence[ChunkSize],
    params: PyTree,
    *inputs: PyTree,
    rng: jax.Array | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **loss_kwargs: Any,
) -> None:
    """Asserts that gradient caching gives the full-batch loss and gradients.

    Use it once on a small batch of real data with your real model: it fails for
    models whose rows interact (e.g. BatchNorm in training mode), with ``rng`` too.
    It checks, in turn:

    * that no row's output changes when other rows change (rows replaced by their
      neighbours in the same chunks, with the same keys, so dropout is replayed):
      the full-batch reference with ``rng`` is encoded in gc_jax's chunks to draw the
      same dropout masks, so it cannot see rows that depend on each other;
    * with a ``TokenBudget`` or ``TokenPacking``, that the trimmed or packed chunks
      give the padded, unpacked batch's outputs (no key), naming a packing encoder's
      NaN empty slots or positions counted from the line's start;
    * the loss and gradients against :func:`full_batch_value_and_grad`.

    Args:
      loss_fn, encoders, chunk_size: as ``gc_jax.cached_value_and_grad``.
      params: the parameters.
      *inputs: a small batch of each input.
      rng: the dropout key (None: encoders run deterministically).
      rtol, atol: the tolerances of every comparison.
      **loss_kwargs: passed to ``loss_fn``.

    Raises:
      AssertionError: naming the mistake where one is found (rows that depend on
        each other, a packing rule broken), else the loss or parameter leaves that
        differ.

    Examples:
      >>> import jax, jax.numpy as jnp, gc_jax
      >>> encode = lambda w, x, key: jnp.tanh(x @ w)
      >>> batch_norm = lambda w, x, key: encode(w, x, key) - encode(w, x, key).mean(0)
      >>> loss = lambda w, q, d: gc_jax.losses.contrastive_loss(q, d)
      >>> x = jax.random.normal(jax.random.key(0), (8, 3))
      >>> gc_jax.testing.assert_matches_full_batch(loss, encode, 2, jnp.eye(3), x, x)
      >>> gc_jax.testing.assert_matches_full_batch(loss, batch_norm, 2, jnp.eye(3), x, x)
      Traceback (most recent call last):
      AssertionError: ...
    """
    from gc_jax._value_and_grad import cached_value_and_grad

    args = (loss_fn, encoders, chunk_size)
    cached = jax.jit(cached_value_and_grad(*args))(params, *inputs, rng=rng, **loss_kwargs)
    _check_rows_apart(encoders, chunk_size, params, inputs, rng, rtol, atol)
    _check_token_chunks(encoders, chunk_size, params, inputs, rtol, atol)
    full = jax.jit(full_batch_value_and_grad(*args))(params, *inputs, rng=rng, **loss_kwargs)
    try:
        chex.assert_trees_all_close(cached, full, rtol=rtol, atol=atol)
    except AssertionError as e:
        raise AssertionError(
            f"gradient caching with chunk_size={chunk_size} differs from the full batch. "
            "Does the model mix rows of a batch (BatchNorm, in-batch statistics)? "
            f"Details: {e}"
        ) from e
