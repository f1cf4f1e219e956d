"""The gradient cache: exact large-batch gradients with one chunk's activations live.

``cached_value_and_grad`` is ``jax.value_and_grad`` for a contrastive loss over
encoded batches, computed in three steps:

1. *Pass 1*: every input is encoded chunk by chunk in a loop; only the
   representations are kept, written in place into the cache (a ``fori_loop``
   rather than ``lax.map``, whose stacked outputs would need a second copy).
2. The loss and its gradient with respect to the cached representations (and the
   parameters the loss itself uses, e.g. a temperature).
3. *Pass 2*: every chunk is encoded again under ``jax.vjp`` and its slice of the
   representation gradient is pulled back to the parameters, accumulated in the
   carry of the loop (never stacked per chunk).

The passes themselves are in ``gc_jax._passes`` (shared with ``chunked_encoder``).
When the batch has three chunks or more, its very last chunk (of the last input) is
encoded under ``jax.vjp`` already in pass 1 and its activations stay live until pass
2, saving one forward without ever holding two chunks' activations. When every input
is a single chunk, every input's VJP is kept: that is plain full-batch training, with
nothing re-encoded.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from gc_jax import (
    _distributed,
    _first_order,
    _layout,
    _loss_scale,
    _passes,
    _validation,
)
from gc_jax._base import AxisName, Encoder, EncoderView, PyTree
from gc_jax._chunks import plan as _plan
from gc_jax._chunks.plan import ChunkSize

# Keywords of the returned function; a loss keyword of the same name could never be passed.
_OWN_KEYWORDS = ("rng", "loss_scale")


def _check_loss_keywords(loss_fn: Callable[..., Any]) -> None:
    try:
        names = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return
    for name in _OWN_KEYWORDS:
        if name in names and names[name].kind != inspect.Parameter.POSITIONAL_ONLY:
            raise TypeError(
                f"loss_fn has a parameter named {name!r}, but {name}= is a keyword of the "
                f"function cached_value_and_grad returns (rng: the encoders' dropout key; "
                f"loss_scale: float16 loss scaling), so it would never reach the loss. "
                f"Rename the loss's parameter (e.g. loss_{name}) and pass loss_{name}=..."
            )


def _check_named_axes(axis_name: Any) -> None:
    """Raises inside ``pmap``/``shard_map(check_vma=False)`` over an axis not in ``axis_name``.

    There the values carry no varying type, so gc_jax cannot see whether the batch
    is split over the axis; if it is, each device would silently train on its own
    rows' negatives. (With ``check_vma=True`` the inputs' types say it, and
    ``_distributed.check_loss_axes`` decides.)
    """
    untyped = _distributed.untyped_manual_axes(axis_name)
    if untyped:
        fix = untyped[0] if len(untyped) == 1 else untyped
        raise ValueError(
            f"cached_value_and_grad runs inside pmap or shard_map(check_vma=False) over "
            f"mesh axes {list(untyped)} that axis_name={axis_name!r} does not name. If the "
            "batch is split over them, each device would train on its own rows' negatives "
            "only: a wrong loss and gradient, silently. Pass axis_name="
            f"{fix!r} here and to the loss (e.g. gc_jax.losses.contrastive_loss(q, d, "
            f"axis_name={fix!r})). If every device holds the whole batch (e.g. a "
            "model-parallel axis), use jax.shard_map with check_vma=True (the default), "
            "where gc_jax reads that from the inputs' types."
        )


def _check_differentiable(cache: PyTree, inp: _passes.Input, i: int) -> None:
    """Raises if input ``i``'s encoder returns no floating-point output at all."""
    leaves = jax.tree.leaves(cache)
    if not any(_passes.is_inexact(x) for x in leaves):
        dtypes = sorted({str(x.dtype) for x in leaves})
        raise ValueError(
            f"{inp.name} returns no floating-point output for inputs[{i}] (dtypes {dtypes}), "
            "so there is nothing to differentiate: the loss would see only integers and "
            "every gradient would be zero. Return the float representations (embeddings) "
            "from the encoder; pass integer data the loss needs (ids, labels, masks) as a "
            "loss keyword argument, or next to a float output."
        )


def _check_loss_call(loss_fn: Callable[..., Any], num_inputs: int, kwargs: dict) -> None:
    """Raises if ``loss_fn`` cannot be called as ``loss_fn(params, *reps, **kwargs)``."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return
    try:
        signature.bind(None, *[None] * num_inputs, **kwargs)
        return
    except TypeError as e:
        error = e
    hint = ""
    with contextlib.suppress(TypeError):
        signature.bind(*[None] * num_inputs, **kwargs)
        hint = (
            " It takes the representations alone, but params come first: write "
            "loss_fn=lambda params, *reps: your_loss(*reps), or give it a params argument."
        )
    raise TypeError(
        f"loss_fn{signature} is called as loss_fn(params, *reps, **loss_kwargs) with "
        f"{num_inputs} representation(s) and keywords {sorted(kwargs)}, and cannot be "
        f"({error}).{hint}"
    )


def _encoders(
    encoders: Encoder | Sequence[Encoder], chunk_size: Any
) -> Encoder | tuple[Encoder, ...]:
    """``encoders`` checked callable (a chunk size given in their place is named)."""
    if isinstance(encoders, Sequence):
        encoders = tuple(
            _validation.callable_arg(e, f"encoders[{i}]") for i, e in enumerate(encoders)
        )
        if not encoders:
            raise ValueError("encoders is an empty sequence; expected one encoder per input.")
        return encoders
    swapped = ("chunk_size", chunk_size, "cached_value_and_grad(loss_fn, encode, chunk_size)")
    return _validation.callable_arg(encoders, "encoders", swapped_with=swapped)


def _split_inexact(tree: PyTree) -> tuple[list, Callable[[list], PyTree]]:
    """The float leaves of ``tree`` and a function putting new ones back in their place."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = [_passes.is_inexact(x) for x in leaves]

    def join(floats):
        it = iter(floats)
        return treedef.unflatten([next(it) if m else x for x, m in zip(leaves, mask, strict=True)])

    return [x for x, m in zip(leaves, mask, strict=True) if m], join


def _loss_and_rep_grads(loss_fn, has_aux, params, reps, scale, axis_name, inputs, kwargs):
    """Loss, aux, the loss-side parameter gradient and the representation gradients.

    The gradient is taken of ``scale * loss`` (float16 loss scaling scales the
    cotangents where they are made) with respect to the float leaves of ``reps``;
    integer or boolean outputs (ids, masks) are passed to the loss as they are.
    """
    floats, join = _split_inexact(reps)
    p_floats, p_join = _split_inexact(params)

    def loss_of(p_floats, floats):
        out = loss_fn(p_join(p_floats), *join(floats), **kwargs)
        loss, aux = _validation.scalar_loss(out, has_aux)
        scaled = loss if scale is None else loss * jnp.asarray(scale, loss.dtype)
        return scaled, (loss, aux)

    loss_axes = _distributed.collective_axes(jax.make_jaxpr(loss_of)(p_floats, floats))
    _distributed.check_loss_axes(loss_axes, axis_name, _distributed.varying_axes_of(inputs))
    grad_fn = jax.value_and_grad(loss_of, (0, 1), has_aux=True)
    (_, (loss, aux)), (acc, rep_floats) = grad_fn(p_floats, floats)
    # Integer leaves of params get no gradient: zeros of their dtype, which optimizers
    # add to them harmlessly (``jax.grad(allow_int=True)`` would give float0).
    acc = _split_inexact(jax.tree.map(jnp.zeros_like, params))[1](acc)
    return loss, aux, acc, join(rep_floats)


def cached_value_and_grad(
    loss_fn: Callable[..., Any],
    encoders: Encoder | Sequence[Encoder],
    chunk_size: ChunkSize | Sequence[ChunkSize],
    *,
    has_aux: bool = False,
    axis_name: AxisName | None = None,
    batch_axis: AxisName | None = None,
    cache_dtype: DTypeLike | None = None,
    encoder_view: EncoderView = "auto",
    keep: int | None = None,
) -> Callable[..., Any]:
    """Like ``jax.value_and_grad`` of a loss over encoded batches, with chunked memory.

    Args:
      loss_fn: ``loss_fn(params, *reps, **loss_kwargs)`` returning a scalar loss, or
        ``(loss, aux)`` with ``has_aux``. ``reps[i]`` are the representations of the
        whole ``inputs[i]`` batch. Under ``axis_name`` the loss must be the *global*
        loss on every device, with the gradient of this device's share (the
        ``gc_jax.losses`` do this; see ``gc_jax.global_loss`` for your own).
      encoders: ``encode(params, chunk, key) -> reps``, one for all inputs (tied
        weights) or one per input. ``reps`` is an array or pytree of arrays with one
        row per row of ``chunk``.
      chunk_size: rows encoded at once, for all inputs or one per input. Under
        ``pmap``/``shard_map`` it counts rows per device; under ``jit`` with a sharded
        batch (explicit mesh axes, or ``batch_axis``) it also counts rows per device:
        every device encodes its own ``chunk_size`` rows of every chunk at once. A
        :class:`gc_jax.TokenBudget` or :class:`gc_jax.TokenPacking` counts tokens
        instead (batches of padded token sequences).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      axis_name: the data-parallel axis under ``pmap``/``shard_map``, or None.
      batch_axis: under plain ``jit`` with *auto* mesh axes, the mesh axes the batch
        is sharded over (the mesh set with ``jax.set_mesh``), so that every device
        encodes its rows of every chunk at once. Not needed under explicit axes,
        where the sharding is read from the array types.
      cache_dtype: dtype of the cached (float) representations, hence of the loss
        inputs and of the representation gradient; default: the encoder's own output
        dtype, which loses nothing (the loss sees exactly what it would see in
        full-batch training) and keeps a bfloat16 encoder's batch-sized memory at
        half of float32. A narrower dtype saves memory at the cost of rounding the
        representations; a wider one only costs memory. It must be a real float
        dtype (a ``TypeError`` otherwise).
      encoder_view: under ``jit`` over a batch split across devices, whether each
        device encodes its own rows as plain local arrays (``"local"``: data
        parallel; an embedding lookup needs no annotation) or the chunk spans the
        devices as a sharded global array (``"global"``: the encoder's own sharding
        annotations apply, e.g. FSDP). ``"auto"`` (default): local where that is
        known to be right (replicated weights, no annotation naming the batch axes),
        else global. The gradients are the same; see :doc:`/scaling_out`.
      keep: how many chunks pass 1 encodes under ``jax.vjp`` and keeps the
        activations of, so that pass 2 re-encodes only the others: the batch's last
        ``keep`` chunks (the last input's first), from 0 (every chunk re-encoded) to
        every chunk (nothing re-encoded: the memory of the full batch). Each kept chunk
        holds its activations from pass 1 to pass 2: more memory, one forward less.
        With a token budget or packing, the last bucket's last ``keep`` chunks (at most
        the chunks it can have). None (default): the batch's last chunk where it has
        three chunks or more, every chunk where each input is one.
        ``gc_jax.plan_step`` picks the chunk size and ``keep`` that fit a memory
        budget fastest; see :doc:`/chunk_size`.

    Returns:
      ``f(params, *inputs, rng=None, loss_scale=None, **loss_kwargs) -> (loss, grads)``
      (or ``((loss, aux), grads)``). ``loss_scale`` multiplies the loss gradient
      before pass 2 and divides the result after (float16 loss scaling); the
      returned gradients are unscaled. A traced ``loss_scale`` that turns out not
      finite and positive gives a NaN loss and NaN gradients. ``params`` may hold
      integer leaves: their gradient is zeros of their dtype. Chunk ``c`` of input
      ``i`` is encoded with key ``fold_in(fold_in(rng, i), c)`` in both passes
      (``None`` if ``rng`` is None), so dropout is replayed exactly; under
      ``axis_name`` the device index is folded into ``rng`` first, so devices draw
      different masks; under ``jit`` over a sharded batch device ``s`` encodes its
      rows of chunk ``c`` with that chunk's key folded with ``s`` (and the step
      all-reduces the gradients once). ``grads`` has the structure of ``params``.

    Examples:
      >>> import jax, jax.numpy as jnp, gc_jax
      >>> encode = lambda w, x, key: jnp.tanh(x @ w)
      >>> loss = lambda w, q, d: gc_jax.losses.contrastive_loss(q, d)
      >>> f = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size=3))
      >>> w = jnp.eye(4)
      >>> q, d = jnp.ones((8, 4)), jnp.arange(32.0).reshape(8, 4) / 32
      >>> value, grads = f(w, q, d)
      >>> full = jax.value_and_grad(lambda w: loss(w, encode(w, q, None), encode(w, d, None)))
      >>> bool(jnp.allclose(value, full(w)[0])), grads.shape
      (True, (4, 4))
    """
    _validation.callable_arg(loss_fn, "loss_fn")
    _check_loss_keywords(loss_fn)
    encoders = _encoders(encoders, chunk_size)
    chunk_size = _plan.check_all(chunk_size)
    cache_dtype = _validation.float_dtype(cache_dtype, "cache_dtype")
    encoder_view = _validation.encoder_view(encoder_view)
    keep = _plan.check_keep(keep, allow_none=True)

    @_layout.types_mesh
    def value_and_grad_fn(
        params: PyTree,
        *inputs: PyTree,
        rng: jax.Array | None = None,
        loss_scale: jax.Array | float | None = None,
        **loss_kwargs: Any,
    ):
        if not inputs:
            raise ValueError("no inputs were given; expected at least one batch to encode.")
        _validation.key_as_input(inputs, "grad_fn(params, queries, docs, rng=key)")
        _check_loss_call(loss_fn, len(inputs), loss_kwargs)
        _validation.axis_bound(axis_name)
        _validation.rng_key(rng)
        _loss_scale.check_loss_scale(loss_scale)
        planned = _inputs(encoders, chunk_size, inputs, rng, axis_name, batch_axis)
        # Manual axes (shard_map, pmap): the parameters vary per device, each chunk's
        # gradient stays local, and the step sums them once at the end.
        manual = planned[0].plan.layout.manual_axes
        pparams = _distributed.to_varying(params, manual)
        _distributed.check_split_alike(  # after _inputs has checked every leaf is an array
            {f"inputs[{i}]": x for i, x in enumerate(inputs)}, _distributed.typed_axes(axis_name)
        )
        planned = _passes.per_device(planned, params, encoder_view)
        counts, keep_all = _kept_counts(planned, keep)
        reps, kept = (), []
        for i, inp in enumerate(planned):
            after = None if keep_all else reps  # plain full-batch training: no order
            cache, vjp = _passes.forward(
                inp, pparams, keep=counts[i], cache_dtype=cache_dtype, after=after
            )
            _check_differentiable(cache, inp, i)
            reps += (cache,)
            kept.append(vjp)

        with _layout.batch_layout(planned[0].plan.layout):  # for losses under auto axes
            loss, aux, acc, rep_grads = _loss_and_rep_grads(
                loss_fn, has_aux, pparams, reps, loss_scale, axis_name, inputs, loss_kwargs
            )
        _check_named_axes(axis_name)  # after the loss's own axis check, which says more
        acc = jax.tree.map(lambda g: g.astype(_passes.wide(g.dtype)), acc)
        acc, _ = _passes.backward(planned, pparams, list(rep_grads), acc, kept=kept)
        loss, acc = _loss_scale.unscale(loss, acc, loss_scale)
        grads = jax.tree.map(
            lambda g, p: g.astype(p.dtype), _distributed.reduce_grads(acc, manual), params
        )
        loss = _distributed.replicated_loss(loss, manual)
        out = ((loss, aux), grads) if has_aux else (loss, grads)
        return _first_order_only(out, chunk_size, inputs)

    return _naming_a_swap(value_and_grad_fn, loss_fn, encoders)


def _naming_a_swap(value_and_grad_fn: Callable, loss_fn: Callable, encoders: Any) -> Callable:
    """``value_and_grad_fn``, whose errors become a TypeError saying so where the loss
    and the encoder were given in each other's place (asked only once it has failed)."""
    first = encoders if callable(encoders) else encoders[0]

    @functools.wraps(value_and_grad_fn)
    def checked(params: PyTree, *inputs: PyTree, **kwargs: Any):
        try:
            return value_and_grad_fn(params, *inputs, **kwargs)
        except Exception as e:
            swapped = inputs and _validation.swapped_loss_and_encoder(
                loss_fn, first, params, inputs[0]
            )
            if swapped:
                raise TypeError(swapped) from e
            raise

    return checked


def _first_order_only(out: Any, chunk_size: Any, inputs: tuple) -> Any:
    """``out``, refusing reverse-mode differentiation with a named error where an input's
    number of chunks is traced (a token budget or packing under ``jit``: see
    ``gc_jax._first_order``)."""
    sizes = _validation.per_input(chunk_size, len(inputs), "chunk_size", lambda s, _: s)
    for i, size in enumerate(sizes):
        if _plan.by_tokens(size) and _first_order.staged():
            what = f"The gradient of cached_value_and_grad (or make_train_step) for inputs[{i}]"
            return _first_order.mark(out, _first_order.message(what, size, forward_mode=True))
    return out


def _kept_vjps(inputs: list[_passes.Input]) -> tuple[bool, bool]:
    """Whether pass 1 keeps every input's VJP, and whether it keeps the last chunk's.

    Every VJP is kept when every input is a single chunk: that is plain full-batch
    training, which re-encodes nothing. Otherwise only the batch's very last chunk
    may stay live from pass 1, and only when at least two chunks are left for pass
    2's loop: XLA inlines a one-trip loop, and may then merge that chunk's second
    encoding with its first (common-subexpression elimination), which keeps the
    chunk's activations from pass 1 next to the kept ones.
    """
    counts = [inp.plan.num_chunks for inp in inputs]
    if None in counts:
        return False, False  # chunk counts the data decides (token budgets): nothing kept
    chunks = sum(counts)
    return chunks == len(inputs), chunks >= 3


def _kept_counts(inputs: list[_passes.Input], keep: int | None) -> tuple[list[int], bool]:
    """The chunks pass 1 keeps of each input, and whether that is every chunk of all.

    ``keep=None``: :func:`_kept_vjps`. Else the batch's last ``keep`` chunks: the last
    input's, then the one before it, ... (raises where the batch has fewer)."""
    n = len(inputs)
    if keep is None:
        keep_all, keep_last = _kept_vjps(inputs)
        return [int(keep_all or (keep_last and i == n - 1)) for i in range(n)], keep_all
    most = [inp.plan.keepable for inp in inputs]
    if keep > sum(most):
        raise _plan.TooManyKept(
            f"keep={keep} is more chunks than the batch has: {sum(most)} (per input: "
            f"{most}); write keep={sum(most)} to keep every chunk, or fewer.",
            sum(most),
        )
    counts, left = [0] * n, keep
    for i in reversed(range(n)):
        counts[i], left = min(left, most[i]), left - min(left, most[i])
    every = all(c == inp.plan.num_chunks for c, inp in zip(counts, inputs, strict=True))
    return counts, every


def _inputs(encoders, chunk_size, inputs, rng, axis_name, batch_axis) -> list[_passes.Input]:
    """One planned :class:`_passes.Input` per batch (input ``i``'s key: ``gc_jax._keys``)."""
    n = len(inputs)
    encs = _validation.per_input(encoders, n, "encoders", lambda e, _: e)
    sizes = _validation.per_input(chunk_size, n, "chunk_size", lambda size, _: size)
    return [
        _passes.make_input(
            e,
            x,
            size,
            rng,
            index=i,
            name=f"encoders[{i}]" if isinstance(encoders, tuple) else "encoder",
            batch_name=f"inputs[{i}]",
            axis_name=axis_name,
            batch_axis=batch_axis,
        )
        for i, (e, x, size) in enumerate(zip(encs, inputs, sizes, strict=True))
    ]
