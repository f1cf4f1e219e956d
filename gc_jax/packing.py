"""The encoder's side of a :class:`gc_jax.TokenPacking`: masks, positions and pooling.

A packed chunk holds several rows per *line*. An encoder is exact under packing when
every token attends only to its own row's tokens, counts its position within its
row, and pools each row on its own. Each function here takes the chunk the encoder
receives (a dict batch) and works both packed (the chunk has ``"segment_ids"``) and
unpacked (an ordinary batch: one row per line), so one encoder serves both, and
``gc_jax.testing`` can check it against the unpacked batch.

Examples:
  >>> import jax.numpy as jnp
  >>> from gc_jax import packing
  >>> chunk = {  # one line holding a row of 2 tokens, then a row of 3
  ...     "attention_mask": jnp.array([[1, 1, 1, 1, 1, 0]]),
  ...     "segment_ids": jnp.array([[1, 1, 2, 2, 2, 0]]),
  ...     "position_ids": jnp.array([[0, 1, 0, 1, 2, 0]]),
  ...     "segment_starts": jnp.array([[0, 2]]),
  ... }
  >>> packing.attention_mask(chunk)[0, 0].astype(int)  # [query, key]
  Array([[1, 1, 0, 0, 0, 0],
         [1, 1, 0, 0, 0, 0],
         [0, 0, 1, 1, 1, 0],
         [0, 0, 1, 1, 1, 0],
         [0, 0, 1, 1, 1, 0],
         [0, 0, 0, 0, 0, 0]], dtype=int32)
  >>> hidden = jnp.arange(6.0)[None, :, None]  # [lines, tokens, features]
  >>> packing.mean_pool(hidden, chunk)  # one row per slot: [lines * segments, features]
  Array([[0.5],
         [3. ]], dtype=float32)
  >>> packing.first_token(hidden, chunk)
  Array([[0.],
         [2.]], dtype=float32)
  >>> q = jnp.ones((1, 6, 2, 4))  # [lines, L, heads, head_dim]
  >>> packing.attention(q, q, q, chunk).shape  # each row attends to its own tokens only
  (1, 6, 2, 4)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from gc_jax._chunks import token_rows
from gc_jax._chunks.lines import POSITION_IDS, SEGMENT_IDS, SEGMENT_STARTS
from gc_jax._chunks.token_rows import MASK

__all__ = [
    "attention",
    "attention_mask",
    "first_token",
    "is_packed",
    "mean_pool",
    "positions",
    "segment_ids",
]

IMPLEMENTATIONS = ("xla", "blocked", "splash")
# The shares of a chunk's (query block, key block) pairs a "blocked" attention has a
# compiled branch for; more pairs than the largest share take the dense form.
_PAIR_SHARES = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4)


def is_packed(chunk: Any) -> bool:
    """Whether ``chunk`` is a packed chunk: a dict with ``"segment_ids"`` (False for an
    array or any other batch)."""
    return hasattr(chunk, "keys") and SEGMENT_IDS in chunk


def _shape(x: Any) -> str:
    return f"shape {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__


def _entry(chunk: Any, name: str, where: str, argument: str = "mask") -> jax.Array:
    """``chunk[name]``, or an error naming ``where`` and the chunk's keys (``argument``:
    the keyword that names the key, if any)."""
    if not hasattr(chunk, "keys"):
        raise TypeError(
            f"{where}(chunk=...) must be the dict batch the encoder receives (with its "
            f"{name!r}), got {type(chunk).__name__} ({_shape(chunk)})."
        )
    if name not in chunk:
        hint = f", or name the key with {argument}='...'" if argument else ""
        raise ValueError(
            f"{where}(chunk=...) has no {name!r} key (its keys: {sorted(chunk)}); pass the "
            f"chunk the encoder receives{hint}."
        )
    return jnp.asarray(chunk[name])


def _mask(chunk: Any, mask: str, where: str) -> jax.Array:
    """``chunk[mask]``, ``[lines, L]``, the packing keys checked against it."""
    keep = _entry(chunk, mask, where)
    if keep.ndim != 2:
        raise ValueError(f"{where}: chunk[{mask!r}] must be [lines, L], got {_shape(keep)}.")
    if is_packed(chunk) and jnp.shape(chunk[SEGMENT_IDS]) != keep.shape:
        raise ValueError(
            f"{where}: chunk[{SEGMENT_IDS!r}] has {_shape(chunk[SEGMENT_IDS])} and "
            f"chunk[{mask!r}] {_shape(keep)}; a packed chunk's keys are all [lines, L]: "
            "pass the chunk TokenPacking gives the encoder."
        )
    return keep


def _check_tokens(x: jax.Array, name: str, chunk: Any, mask: str, where: str) -> None:
    """``x`` is ``[lines, L, ...]`` of the chunk's tokens, or an error naming it."""
    lines, length = _mask(chunk, mask, where).shape
    if jnp.ndim(x) < 2 or jnp.shape(x)[:2] != (lines, length):
        raise ValueError(
            f"{where}: {name} has {_shape(x)} but the chunk holds {lines} lines of "
            f"{length} tokens (chunk[{mask!r}] is [{lines}, {length}]); pass {name} computed "
            f"from this chunk's tokens, [{lines}, {length}, ...]."
        )


def _slots(chunk: Mapping, where: str) -> jax.Array:
    """A packed chunk's ``segment_starts``, ``int[lines, segments]``."""
    starts = _entry(chunk, SEGMENT_STARTS, where, argument="")
    if starts.ndim != 2 or starts.shape[0] != jnp.shape(chunk[SEGMENT_IDS])[0]:
        raise ValueError(
            f"{where}: chunk[{SEGMENT_STARTS!r}] must be [lines, segments] with the lines of "
            f"chunk[{SEGMENT_IDS!r}] ({_shape(chunk[SEGMENT_IDS])}), got {_shape(starts)}."
        )
    return starts


def attention_mask(chunk: Mapping, mask: str = MASK) -> jax.Array:
    """Which keys each query may attend to, ``bool[lines, 1, L, L]`` (heads axis 1).

    Packed: the keys of the query's own row that ``chunk[mask]`` keeps. Unpacked:
    ``chunk[mask]`` as ``[rows, 1, 1, L]``, which broadcasts the same way.
    """
    keep = _mask(chunk, mask, "packing.attention_mask") != 0
    if not is_packed(chunk):
        return keep[:, None, None, :]
    segment = chunk[SEGMENT_IDS]
    same = segment[:, :, None] == segment[:, None, :]
    return (same & keep[:, None, :] & (segment[:, None, :] > 0))[:, None]


def positions(chunk: Mapping, key: str = "input_ids") -> jax.Array:
    """Each token's position in its row, ``int32[lines, L]``: ``chunk["position_ids"]``
    where it has one, else ``arange(L)`` on every line (of ``chunk[key]``'s shape)."""
    if hasattr(chunk, "keys") and POSITION_IDS in chunk:
        return jnp.asarray(chunk[POSITION_IDS])
    tokens = _entry(chunk, key, "packing.positions", argument="key")
    if tokens.ndim < 2:
        raise ValueError(f"packing.positions: chunk[{key!r}] must be [lines, L], got "
                         f"{_shape(tokens)}.")  # fmt: skip
    return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape[:2])


def mean_pool(hidden: jax.Array, chunk: Mapping, mask: str = MASK) -> jax.Array:
    """The mean of ``hidden [lines, L, ...]`` over each row's kept tokens.

    Packed: ``[lines * segments, ...]``, one row per slot; an empty slot (a line with
    fewer rows) repeats the line's first row, so that no output is a zero vector
    (normalised, its gradient would be NaN). Unpacked: ``[rows, ...]``.
    """
    _check_tokens(hidden, "hidden", chunk, mask, "packing.mean_pool")
    keep = (jnp.asarray(chunk[mask]) != 0).astype(hidden.dtype)
    if not is_packed(chunk):
        keep = keep.reshape(*keep.shape, *[1] * (hidden.ndim - 2))
        return jnp.sum(hidden * keep, axis=1) / jnp.maximum(jnp.sum(keep, axis=1), 1)
    segment = jnp.asarray(chunk[SEGMENT_IDS])
    segments = _slots(chunk, "packing.mean_pool").shape[1]
    slots = segment[..., None] == jnp.arange(1, segments + 1)  # [lines, L, S]
    empty = ~jnp.any(slots, axis=1, keepdims=True)  # [lines, 1, S]
    slots = slots | (empty & (segment == 1)[..., None])  # an empty slot: the first row
    weights = slots.astype(hidden.dtype) * keep[..., None]
    flat = hidden.reshape(*hidden.shape[:2], -1)
    sums = jnp.einsum("lts,ltf->lsf", weights, flat)
    counts = jnp.maximum(jnp.sum(weights, axis=1), 1)[..., None]
    return (sums / counts).reshape(-1, *hidden.shape[2:])


def first_token(hidden: jax.Array, chunk: Mapping) -> jax.Array:
    """Each row's first token of ``hidden [lines, L, ...]`` (e.g. ``[CLS]`` pooling).

    Packed: ``[lines * segments, ...]``, one row per slot (an empty slot: the line's
    first row's). Unpacked: ``hidden[:, 0]``. A row without tokens is packed alone in
    its line, so its first token is the unpacked row's too.
    """
    if not is_packed(chunk):
        return hidden[:, 0]
    starts = _slots(chunk, "packing.first_token")
    if jnp.ndim(hidden) < 2 or jnp.shape(hidden)[:2] != jnp.shape(chunk[SEGMENT_IDS]):
        lines, length = jnp.shape(chunk[SEGMENT_IDS])
        raise ValueError(
            f"packing.first_token: hidden has {_shape(hidden)} but the chunk holds {lines} "
            f"lines of {length} tokens (chunk[{SEGMENT_IDS!r}]); pass hidden computed from "
            f"this chunk's tokens, [{lines}, {length}, ...]."
        )
    at = starts.reshape(*starts.shape, *[1] * (hidden.ndim - 2))
    return jnp.take_along_axis(hidden, at, axis=1).reshape(-1, *hidden.shape[2:])


def segment_ids(chunk: Mapping, mask: str = MASK) -> tuple[jax.Array, jax.Array]:
    """Query and key segment ids, ``int32[lines, L]`` each: a query attends to the keys
    of its own id (the ids :func:`attention` and splash attention take).

    Packed: a row's tokens have its id (``k + 1``) as queries, and as keys where
    ``chunk[mask]`` keeps them (else 0); padding is 0 both ways. Unpacked: 1 on every
    query, and on the kept keys. A line without a kept key keeps every key (as a dense
    mask filled with a large negative does: a uniform mean), so no query is left
    without keys (:func:`attention` also gives such a line equal scores).
    """
    keep = _mask(chunk, mask, "packing.segment_ids") != 0
    if is_packed(chunk):
        query = jnp.asarray(chunk[SEGMENT_IDS], jnp.int32)
    else:
        query = jnp.ones(keep.shape, jnp.int32)
    key = jnp.where(keep | ~jnp.any(keep, axis=1, keepdims=True), query, 0)
    return query, key


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    chunk: Mapping,
    *,
    mask: str = MASK,
    implementation: str | None = None,
    block_size: int = 32,
) -> jax.Array:
    """Softmax attention in which each token sees only its own row's kept tokens.

    The same outputs as masking dense scores with :func:`attention_mask` at every
    token of a row (the tokens outside every row, a packed line's padding, get
    finite outputs of their own, which pooling ignores). The ``"blocked"`` form
    computes no score block that mixes rows: a packed line's attention then costs
    about the sum of its rows' squared lengths (in blocks), not the line's.

    Args:
      query, key, value: ``[lines, L, heads, head_dim]`` (as
        ``jax.nn.dot_product_attention``); the query is scaled by ``head_dim ** -0.5``.
      chunk: the chunk the encoder receives, packed or not.
      mask: the key of the token mask in ``chunk``.
      implementation: ``"xla"`` (dense scores, masked), ``"blocked"`` (only the
        ``block_size`` x ``block_size`` score blocks that pair a row with itself, and
        padding with its own block; a compiled branch per share of the blocks, chosen
        per chunk: the FLOPs follow the rows' lengths), ``"splash"`` (TPU only: Pallas
        splash attention with segment ids; fused, no ``L x L`` scores in memory, but
        every block of a line computed: splash skips only the blocks of its static
        mask, and segment ids are data) or None: splash on TPU where the shapes allow
        (``L`` a multiple of 128), else xla. On XLA:CPU ``"blocked"`` measured slower than
        ``"xla"`` at d = 128 (its gathers cost more than the blocks it skips:
        docs/benchmarks/token_budgets.md), so it is never chosen for you.
      block_size: the blocked form's block length: it divides ``L``, or ``L`` is at most
        one block (e.g. a short line length of a ``TokenPacking`` with ``buckets``),
        whose attention is the dense form's.

    Returns:
      ``[lines, L, heads, head_dim]``, the dtype of ``query``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gc_jax import packing
      >>> chunk = {"attention_mask": jnp.ones((1, 8), int),
      ...          "segment_ids": jnp.array([[1, 1, 1, 2, 2, 2, 2, 2]]),
      ...          "segment_starts": jnp.array([[0, 3]])}
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
      >>> dense = packing.attention(q, k, v, chunk, implementation="xla")
      >>> blocked = packing.attention(q, k, v, chunk, implementation="blocked", block_size=4)
      >>> bool(jnp.allclose(dense, blocked, atol=1e-6))
      True
    """
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(f"packing.attention implementation: got {implementation!r}; "
                         f"write one of {IMPLEMENTATIONS} or None (by backend)")  # fmt: skip
    if query.ndim != 4 or key.shape != query.shape or value.shape[:3] != query.shape[:3]:
        raise ValueError("packing.attention: query, key and value must be [lines, L, heads, "
                         f"head_dim]; got {query.shape}, {key.shape}, {value.shape}")  # fmt: skip
    _check_tokens(query, "query", chunk, mask, "packing.attention")
    block_size = token_rows.positive_int(block_size, "packing.attention(block_size=...)")
    ids = segment_ids(chunk, mask)
    # A line without a kept key: equal scores (a uniform mean), as a dense mask filled
    # with a large negative gives, and no gradient to the queries and keys.
    empty = ~jnp.any(jnp.asarray(chunk[mask]) != 0, axis=1)[:, None, None, None]
    query = jnp.where(empty, jnp.zeros((), query.dtype), query)
    length = query.shape[1]
    dense = implementation == "xla" or (implementation is None and length % 128)
    if dense or (implementation == "blocked" and length <= block_size):  # one block: dense
        return _dense(query, key, value, *ids)
    if implementation == "blocked":
        if length % block_size:
            raise ValueError(
                f"packing.attention block_size: got {block_size}, which does not divide "
                f"L = {length} into blocks; write a divisor of {length}, or pack into line "
                f"lengths that are multiples of it (TokenPacking.for_lengths(..., "
                f"multiple={block_size}))."
            )
        return _blocked(query, key, value, *ids, block_size)
    if implementation == "splash":
        return jax.lax.platform_dependent(query, key, value, *ids, tpu=_splash,
                                          default=_splash_off_tpu)  # fmt: skip
    return jax.lax.platform_dependent(query, key, value, *ids, tpu=_splash, default=_dense)


def _dense(query, key, value, query_ids, key_ids):
    keep = (query_ids[:, :, None] == key_ids[:, None, :])[:, None]  # [lines, 1, q, k]
    scale = jnp.asarray(query.shape[-1] ** -0.5, query.dtype)
    scores = jnp.einsum("lqhd,lkhd->lhqk", query * scale, key)
    scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
    weights = jax.nn.softmax(jnp.where(keep, scores, -jnp.inf), axis=-1)
    return jnp.einsum("lhqk,lkhd->lqhd", weights.astype(value.dtype), value)


def _blocked(query, key, value, query_ids, key_ids, block):
    """Only the score blocks whose queries and keys share a segment, gathered into a
    list of at most a share of all the chunk's blocks (a branch per share)."""
    pairs = _pairs(query_ids, key_ids, block)
    caps = _caps(pairs.size)
    branches = [lambda *a, cap=cap: _block_pairs(*a, block=block, cap=cap) for cap in caps] + [
        lambda q, k, v, qi, ki, pairs: _dense(q, k, v, qi, ki)
    ]
    which = jnp.searchsorted(jnp.asarray(caps), jnp.sum(pairs))
    return jax.lax.switch(which, branches, query, key, value, query_ids, key_ids, pairs)


def _pairs(query_ids: jax.Array, key_ids: jax.Array, block: int) -> jax.Array:
    """Which (query block, key block) pairs of each line to compute, ``bool[lines, n, n]``
    (``n = L // block``): those holding a query and a key of one row, and the diagonal.

    Padding (segment 0) attends only within its own block: its outputs are finite (each
    padding query is a key of its block) and reach no row's token, so a line's padding
    costs its diagonal blocks, not every pair of them.
    """
    lines, length = query_ids.shape
    has = lambda ids: jax.nn.one_hot(  # segment ids are below L + 1; 0 (padding) dropped
        jnp.minimum(ids, length) - 1, length, dtype=jnp.bfloat16
    ).reshape(lines, length // block, block, -1).max(2)  # fmt: skip
    same = jnp.einsum("lis,ljs->lij", has(query_ids), has(key_ids),
                      preferred_element_type=jnp.float32) > 0  # fmt: skip
    return same | jnp.eye(length // block, dtype=bool)


def _caps(total: int) -> list[int]:
    """The most block pairs each of the blocked form's branches computes (the last
    branch, past every cap, is the dense form)."""
    return [max(1, int(total * share)) for share in _PAIR_SHARES]


def _block_pairs(query, key, value, query_ids, key_ids, pairs, *, block, cap):
    lines, length, heads, dim = query.shape
    n = length // block
    (flat,) = jnp.nonzero(pairs.reshape(-1), size=cap, fill_value=pairs.size)
    valid = flat < pairs.size
    flat = jnp.where(valid, flat, 0)
    q_block = flat // n  # line * n + query block
    k_block = (flat // (n * n)) * n + flat % n
    blocks = lambda x: x.reshape(lines * n, block, *x.shape[2:])
    qb = blocks(query)[q_block] * jnp.asarray(dim**-0.5, query.dtype)
    kb, vb = blocks(key)[k_block], blocks(value)[k_block]
    same = blocks(query_ids)[q_block][:, :, None] == blocks(key_ids)[k_block][:, None, :]
    same = (same & valid[:, None, None])[:, None]  # [pairs, 1, queries, keys]
    scores = jnp.einsum("pqhd,pkhd->phqk", qb, kb)
    scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
    scores = jnp.where(same, scores, -jnp.inf)
    out_blocks = jnp.where(valid, q_block, lines * n)  # an unused pair: a block dropped
    top = jax.ops.segment_max(jnp.max(scores, -1), out_blocks, lines * n + 1,
                              indices_are_sorted=True)  # fmt: skip
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0))
    weights = jnp.where(same, jnp.exp(scores - top[out_blocks][..., None]), 0)
    total = jax.ops.segment_sum(jnp.sum(weights, -1), out_blocks, lines * n + 1,
                                indices_are_sorted=True)  # fmt: skip
    context = jnp.einsum("phqk,pkhd->pqhd", weights.astype(value.dtype), vb)
    context = jax.ops.segment_sum(context, out_blocks, lines * n + 1, indices_are_sorted=True)
    norm = jnp.swapaxes(jnp.maximum(total[:-1], jnp.finfo(total.dtype).tiny), 1, 2)
    out = context[:-1] / norm[..., None].astype(context.dtype)
    return out.reshape(lines, length, heads, dim).astype(query.dtype)


def _splash(query, key, value, query_ids, key_ids):
    """Pallas splash attention (TPU) over each line, with the segment ids."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib,
    )

    _, length, heads, dim = query.shape
    full = mask_lib.MultiHeadMask([mask_lib.FullMask((length, length))] * heads)
    kernel = kernel_lib.make_splash_mha(full, head_shards=1, q_seq_shards=1)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [lines, heads, L, dim]
    scaled = query * jnp.asarray(dim**-0.5, query.dtype)

    def line(q, k, v, qi, ki):
        return kernel(q, k, v, segment_ids=kernel_lib.SegmentIds(q=qi, kv=ki))

    out = jax.vmap(line)(heads_first(scaled), heads_first(key), heads_first(value),
                         query_ids, key_ids)  # fmt: skip
    return heads_first(out).astype(query.dtype)


# implementation="splash" compiled for another platform than TPU: Pallas's own error
# ("Only interpret mode is supported on CPU backend") does not say what to write. The
# platform is known only when the program is lowered (a CPU host compiles for TPU
# devices with jax.experimental.topologies), so the branch platform_dependent lowers
# off TPU passes the query through a primitive whose lowering raises.
_SPLASH_TPU_ONLY = (
    "packing.attention(implementation='splash'): splash attention is a Pallas TPU kernel, "
    "and this program is compiled for {platforms}; write implementation=None (splash on "
    "TPU where L is a multiple of 128, else 'xla') or implementation='xla'."
)


def _refuse_off_tpu(ctx: Any = None, *args: Any, **params: Any) -> None:
    platforms = getattr(getattr(ctx, "module_context", None), "platforms", None)
    platforms = platforms or [jax.default_backend()]  # not lowered: run where it stands
    raise ValueError(_SPLASH_TPU_ONLY.format(platforms=", ".join(platforms)))


_OFF_TPU = Primitive("gc_jax_splash_off_tpu")  # identity, lowered nowhere
_OFF_TPU.def_impl(lambda x: _refuse_off_tpu())
_OFF_TPU.def_abstract_eval(lambda x: x)
mlir.register_lowering(_OFF_TPU, _refuse_off_tpu)
batching.primitive_batchers[_OFF_TPU] = lambda args, dims: (_OFF_TPU.bind(*args), dims[0])


@jax.custom_vjp
def _off_tpu(x: jax.Array) -> jax.Array:
    return _OFF_TPU.bind(x)


_off_tpu.defvjp(lambda x: (_OFF_TPU.bind(x), None), lambda _, ct: (_OFF_TPU.bind(ct),))


def _splash_off_tpu(query, key, value, query_ids, key_ids):
    """``implementation="splash"`` lowered for another platform: a ValueError saying so."""
    return _dense(_off_tpu(query), key, value, query_ids, key_ids)
