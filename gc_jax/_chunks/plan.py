"""The chunk plan: how one input's batch is cut into chunks, one protocol for every kind.

Three kinds of plan implement :class:`Plan`: chunks of rows
(``gc_jax._chunks.rows.ChunkPlan``, from an int ``chunk_size``), chunks cut by a
token budget (``gc_jax._chunks.budget.TokenPlan``, from a :class:`gc_jax.TokenBudget`)
and rows packed into lines (``gc_jax._chunks.lines.PackPlan``, from a
:class:`gc_jax.TokenPacking`): one module per kind, in ``gc_jax._chunks``. This
module is the one place that tells the kinds apart: it checks ``chunk_size``
(:func:`check`), says whether the data decides the number of chunks
(:func:`by_tokens`), and :func:`make` plans a batch: its layout across devices, its
plan and its dropout key. The passes, ``chunked_encoder``, ``GradCache``,
``gc_jax.testing`` and ``cachex`` call the protocol and never ask a plan's kind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax

from gc_jax import _keys, _layout, _validation
from gc_jax._base import AxisName, Encoder, PyTree
from gc_jax._chunks import budget, lines, rows
from gc_jax._chunks.budget import TokenBudget
from gc_jax._chunks.lines import TokenPacking

ChunkSize = int | TokenBudget | TokenPacking
"""What ``chunk_size`` takes: rows per chunk, a token budget, or a token packing."""


class Plan(Protocol):
    """How one input's batch is cut into chunks, and how a chunk is read and written.

    A *chunk index* is whatever the plan's loops hand out (a traced row-chunk number,
    None for the last chunk of rows, a bucket's turn); only the plan interprets it.

    Attributes:
      batch_size: total rows ``B`` of the batch.
      num_shards: contiguous shards of the rows in the array the program sees
        (devices under a sharded ``jit``; 1 otherwise).
      layout: how the rows lie across devices (``gc_jax._layout.Layout``).
      num_chunks: the number of chunks when it is known at trace time, else None (the
        data decides it).
      rows_hint: added to the error of an encoder that returns other than
        :meth:`rows_of` rows.
    """

    batch_size: int
    num_shards: int
    layout: _layout.Layout
    rows_hint: str

    @property
    def num_chunks(self) -> int | None: ...

    @property
    def keepable(self) -> int:
        """The most chunks pass 1 can keep the VJPs of (``keep=``): every chunk of rows;
        for token plans the chunks the last bucket can have."""

    def loops(self, keep: int) -> list[tuple[Callable[[Any], Any], Any]]:
        """The loops of the chunks not kept: ``(index of turn j, number of turns)``.
        ``keep``: how many chunks pass 1 encodes under ``jax.vjp`` and keeps (the
        tail, if any, and :meth:`kept`), in no loop here."""

    def has_tail(self, keep: int) -> bool:
        """Whether a last chunk (index None) is encoded on its own after the loops."""

    def kept(self, keep: int) -> tuple[Callable[[Any], Any], int]:
        """The kept chunks but the tail, ``(index of turn j, static turns)``."""

    def samples(self) -> list:
        """One chunk index per distinct chunk shape (for the outputs' shapes)."""

    def rows_of(self, index: Any) -> int:
        """Rows per shard of chunk ``index``."""

    def number(self, index: Any) -> Any:
        """Chunk ``index``'s number in the batch (its key is ``fold_in(key, number)``)."""

    def pack(self, batch: PyTree, wrt: tuple[bool, ...]) -> PyTree:
        """``batch`` as :meth:`take` reads it fastest (leaves ``wrt`` are differentiated)."""

    def take(self, tree: PyTree, index: Any) -> PyTree:
        """Chunk ``index`` of every leaf of a (packed) batch."""

    def put(self, buffer: PyTree, chunk: PyTree, index: Any) -> PyTree:
        """``buffer`` with ``chunk`` written into chunk ``index``'s rows, in place."""

    def take_cotangent(self, tree: PyTree, index: Any) -> PyTree:
        """Chunk ``index`` of a representation gradient (zero on rows it does not own)."""

    def same_outputs(self, shapes: list[PyTree], name: str) -> PyTree:
        """Checks that :meth:`samples`' chunks give outputs of one kind; returns one."""

    def reference(
        self, encode: Encoder, params: PyTree, batch: PyTree, key: Any, trim: bool = True
    ) -> PyTree:
        """The batch encoded chunk by chunk with the chunks' keys, differentiably (no
        cache): ``gc_jax.testing``'s reference. ``trim=False``: token chunks untrimmed."""


class Planned(NamedTuple):
    """A batch laid out across devices, its plan, and its chunks' key (None: no key)."""

    batch: PyTree
    plan: Plan
    key: jax.Array | None


def check(value: Any, name: str) -> ChunkSize:
    """A ``chunk_size``: a positive int (rows), a :class:`gc_jax.TokenBudget` or a
    :class:`gc_jax.TokenPacking`."""
    return value if by_tokens(value) else _validation.positive_int(value, name)


def check_all(value: Any) -> ChunkSize | tuple[ChunkSize, ...]:
    """``chunk_size`` checked once, up front: one (int or TokenBudget), or a tuple of them."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not value:
            raise ValueError(
                "chunk_size is an empty sequence; expected one positive int (or TokenBudget, "
                "TokenPacking) per input."
            )
        return tuple(check(v, f"chunk_size[{i}]") for i, v in enumerate(value))
    return check(value, "chunk_size")


class TooManyKept(ValueError):
    """``keep`` names more chunks than the batch has (``chunks``: how many it has)."""

    def __init__(self, message: str, chunks: int):
        super().__init__(message)
        self.chunks = chunks


def check_keep(keep: Any, name: str = "keep", allow_none: bool = False) -> int | None:
    """``keep``: a non-negative int (None too where ``allow_none``); its upper bound,
    the batch's chunks, is checked where the batch is planned."""
    if (keep is None and allow_none) or (
        isinstance(keep, int) and not isinstance(keep, bool) and keep >= 0
    ):
        return keep
    default = ", or keep=None for the default" if allow_none else ""
    raise ValueError(
        f"{name} must be a non-negative int (how many chunks pass 1 keeps the "
        f"activations of), got {keep!r}; write e.g. {name}=2{default}."
    )


def by_tokens(chunk_size: Any) -> bool:
    """Whether ``chunk_size`` cuts chunks by tokens (a budget or a packing): rows trimmed
    of padding, and a number of chunks the data decides (pass 2 then cannot be
    differentiated again)."""
    return isinstance(chunk_size, TokenBudget | TokenPacking)


def make(
    batch: PyTree,
    chunk_size: ChunkSize,
    *,
    axis_name: AxisName | None = None,
    batch_axis: AxisName | None = None,
    rng: jax.Array | None = None,
    index: int | None = None,
    name: str = "inputs",
    one_device: bool = False,
) -> Planned:
    """Plans input ``index``'s ``batch`` (named ``name`` in errors).

    The layout: inside ``pmap``/``shard_map`` (``axis_name`` given, or a batch that
    varies over a manual axis) the batch holds this device's rows; under plain ``jit``
    a batch sharded over the mesh (explicit axes, or auto axes named by
    ``batch_axis``) is cut so that every device encodes its rows of every chunk.

    The key: ``fold_in(rng, index)`` (``rng`` itself when ``index`` is None: the forms
    that encode one input), with the device index folded into ``rng`` first under
    ``axis_name``, so devices draw different dropout masks.

    ``one_device``: plan the batch as one device would see it, whatever its sharding
    (the reference of ``gc_jax.testing``).
    """
    size = _validation.leading_size(batch, name)
    layout = _layout.SINGLE
    if not one_device:
        batch, layout = _layout.layout_of(batch, axis_name, batch_axis, name)
    if isinstance(chunk_size, TokenPacking):
        plan = lines.make_plan(batch, chunk_size, name, layout)
    elif by_tokens(chunk_size):
        plan = budget.make_plan(batch, chunk_size, name, layout)
    else:
        plan = rows.make_plan(size, chunk_size, layout)
    if axis_name is not None:
        rng = _keys.device_key(rng, jax.lax.axis_index(axis_name))
    return Planned(batch, plan, rng if index is None else _keys.input_key(rng, index))


def trimming_error(chunk_size: ChunkSize, index: int, details: Any) -> str:
    """What ``gc_jax.testing`` says when input ``index``'s encoder gives other outputs
    for the chunks ``chunk_size`` (a budget or a packing) cuts than for the batch whole."""
    if isinstance(chunk_size, TokenPacking):
        return (
            f"encoders[{index}] gives other outputs for the TokenPacking's packed chunks of "
            f"inputs[{index}] than for the batch unpacked: a token must attend only to its "
            "own row (gc_jax.packing.attention_mask), count its position in its row "
            "(gc_jax.packing.positions) and each row be pooled on its own "
            "(gc_jax.packing.mean_pool or first_token), so gradient caching with this "
            f"packing is not exact. Details: {details}"
        )
    return (
        f"encoders[{index}] gives other outputs for the TokenBudget's chunks of "
        f"inputs[{index}] trimmed to their bucket's length than at the padded length: its "
        "output depends on trailing padding (e.g. a mean over every position, or a "
        "lengths= that undercounts the tokens it attends to), so gradient caching with "
        f"this budget is not exact. Details: {details}"
    )
