"""Trace-time argument checks with messages that say what was given and what is expected."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from gc_jax import _layout
from gc_jax._base import EncoderView, PyTree


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def positive_int(value: Any, name: str) -> int:
    """Returns ``value`` as an int, or raises naming ``name``."""
    if not _is_int(value):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__}).")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}.")
    return int(value)


def per_input(value: Any, num_inputs: int, name: str, check: Callable[[Any, str], Any], *,
              what: str = "inputs") -> tuple:  # fmt: skip
    """Broadcasts a single setting to every input, or checks a per-input sequence.

    ``what`` names the inputs in messages (e.g. ``"models"``).
    """
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != num_inputs:
            raise ValueError(
                f"{name} has {len(value)} entries for {num_inputs} {what}; "
                f"pass one {name} for all {what} or exactly one per {what[:-1]}."
            )
        return tuple(check(v, f"{name}[{i}]") for i, v in enumerate(value))
    return (check(value, name),) * num_inputs


def float_dtype(value: Any, name: str) -> Any:
    """``value`` as a real floating-point dtype, or None; otherwise raises naming ``name``."""
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a floating-point dtype (e.g. jnp.bfloat16) or None, got {value!r}."
        ) from None
    if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        raise TypeError(
            f"{name} must be a real floating-point dtype such as jnp.float32 or jnp.bfloat16 "
            f"(or None: the encoder's own dtype), got {dtype}: the cached representations "
            "are what the loss is differentiated against, and a "
            f"{'complex' if dtype.kind == 'c' else 'non-float'} cache would change them. "
            f"Write {name}=jnp.bfloat16 (half the memory) or leave it out."
        )
    return dtype


def callable_arg(value: Any, name: str, *, swapped_with: tuple | None = None) -> Callable:
    """``value`` if callable, else a TypeError naming ``name``. ``swapped_with``:
    ``(other argument's name, its value, the call to write)``, named when that one is
    callable instead (the two given in the wrong order)."""
    if not callable(value):
        hint = ""
        if swapped_with is not None and callable(swapped_with[1]):
            hint = (
                f", while {swapped_with[0]} is callable: the two look swapped; write "
                f"{swapped_with[2]}"
            )
        raise TypeError(f"{name} must be callable, got {value!r} ({type(value).__name__}){hint}.")
    return value


def swapped_loss_and_encoder(loss_fn: Callable, encode: Callable, params: PyTree,
                             batch: PyTree) -> str | None:  # fmt: skip
    """A message when ``loss_fn`` and ``encode`` were given in each other's place:
    ``loss_fn(params, batch, None)`` returns one row per row of ``batch`` as an encoder
    does, and ``encode(params, batch, None)`` does not (it raises, or returns a scalar).
    Asked only once a step has failed (shapes only: ``jax.eval_shape``)."""
    as_encoder = lambda f: jax.eval_shape(lambda p, x: f(p, x, None), params, batch)
    rows = {x.shape[0] for x in jax.tree.leaves(batch) if getattr(x, "ndim", 0)}
    per_row = lambda out: (
        bool(jax.tree.leaves(out))
        and all(getattr(r, "ndim", 0) and {r.shape[0]} == rows for r in jax.tree.leaves(out))
    )
    try:
        got = as_encoder(loss_fn)
    except Exception:
        return None
    try:
        if not per_row(got) or per_row(as_encoder(encode)):
            return None
    except Exception:
        pass  # the encoder fails on a batch: as a loss would
    return (
        f"the loss and the encoder look swapped: loss_fn ({_signature(loss_fn)}) returns one "
        f"row per input row as an encoder does ({_structure(got)}), and the encoder "
        f"({_signature(encode)}) does not. The loss comes first: write "
        "cached_value_and_grad(loss_fn, encode, chunk_size) (make_train_step(loss_fn, "
        "encode, chunk_size, ...) likewise), with loss_fn(params, *reps) and "
        "encode(params, chunk, key)."
    )


def leading_size(tree: PyTree, name: str, *, axis: str = "batch", hint: str = "") -> int:
    """The shared leading (``axis``) size of every leaf of ``tree``; ``hint`` ends messages."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        raise ValueError(f"{name} has no array leaves; expected a pytree of arrays{hint}.")
    sizes = {}
    for path, leaf in leaves:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(
                f"{where} must be an array with a leading {axis} axis, "
                f"got {type(leaf).__name__}: {leaf!r}."
            )
        if len(leaf.shape) == 0:
            raise ValueError(
                f"{where} is a scalar; every input leaf needs a leading {axis} axis{hint}."
            )
        sizes[where] = leaf.shape[0]
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(
            f"leaves of {name} have different leading ({axis}) sizes: {listing}{hint}."
        )
    size = next(iter(sizes.values()))
    if size == 0:
        raise ValueError(f"{name} is an empty {axis} (leading size 0); expected at least one row.")
    return size


def _describe(value: Any) -> str:
    """``value`` in a message: an array by shape and dtype, anything else by type."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"


def rows(tree: PyTree, expected: int, name: str, hint: str = "") -> None:
    """Checks that an encoder returned one row per input row (``hint`` ends the error)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        raise ValueError(
            f"{name} returned {_describe(tree)} with no array leaves; an encoder must "
            "return an array (or pytree of arrays) with one representation row per input row."
        )
    for path, leaf in leaves:
        where = jax.tree_util.keystr(path) or "an output"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(
                f"{name} returned {where} that is {_describe(leaf)}, not an array; an "
                "encoder must return arrays with one representation row per input row."
            )
        shape = tuple(leaf.shape)
        if len(shape) == 0 or shape[0] != expected:
            raise ValueError(
                f"{name} returned {where} with shape {shape} for a chunk of {expected} rows; "
                f"an encoder must return one representation row per input row (leading "
                f"axis {expected}){hint}."
            )


def first_mismatch(a: PyTree, b: PyTree) -> tuple[str, Any, Any] | None:
    """``(where, leaf of a, leaf of b)`` of the first leaves whose dtype or trailing shape
    differ (two chunks' outputs), or None if every leaf agrees."""
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b),
                            strict=True):  # fmt: skip
        if x.shape[1:] != y.shape[1:] or x.dtype != y.dtype:
            return jax.tree_util.keystr(path) or "its output", x, y
    return None


def same_chunk_outputs(body: PyTree, tail: PyTree, name: str) -> None:
    """Checks that a full chunk and the (smaller) last chunk give outputs of one kind."""
    if found := first_mismatch(body, tail):
        where, b, t = found
        raise ValueError(
            f"{name} returned {where} of shape {tuple(b.shape)} and dtype {b.dtype} for a "
            f"chunk of {b.shape[0]} rows but shape {tuple(t.shape)} and dtype {t.dtype} for "
            f"the last chunk of {t.shape[0]} rows; an encoder's output may depend on the "
            "number of rows only through its leading axis (did it pad, pool over rows or "
            "pick a dtype from the chunk size?)."
        )


def scalar_loss(out: Any, has_aux: bool) -> tuple[jax.Array, Any]:
    """Splits ``loss_fn``'s output into ``(loss, aux)`` and checks the loss is a scalar."""
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            got = (
                f"a {type(out).__name__} of length {len(out)}"
                if isinstance(out, tuple | list)
                else _describe(out)
            )
            raise TypeError(
                "loss_fn was declared with has_aux=True, so it must return a pair "
                f"(loss, aux); got {got}."
            )
        loss, aux = out
    else:
        loss, aux = out, None
    if not (hasattr(loss, "shape") and hasattr(loss, "dtype")):
        hint = " (did you mean has_aux=True?)" if isinstance(out, tuple | list) else ""
        raise TypeError(f"loss_fn must return a scalar array loss, got {_describe(loss)}{hint}.")
    if loss.shape != ():
        hint = " (did you mean has_aux=True?)" if isinstance(out, tuple | list) else ""
        hint = hint or " (reduce it, e.g. with .mean() or .sum())"
        raise ValueError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}{hint}.")
    if not jax.numpy.issubdtype(loss.dtype, jax.numpy.floating):
        raise TypeError(f"loss_fn must return a floating-point loss, got dtype {loss.dtype}.")
    return loss, aux


def axis_bound(axis_name: Any, name: str = "axis_name") -> None:
    """Raises a ValueError unless ``axis_name`` is bound by pmap/shard_map here."""
    if axis_name is None or _layout.is_bound(axis_name):
        return
    raise ValueError(
        f"{name}={axis_name!r} is not bound here: call this inside jax.pmap(..., "
        f"axis_name={axis_name!r}) or jax.shard_map over a mesh with that axis, or pass "
        f"{name}=None under plain jax.jit."
    )


def rng_key(rng: Any, name: str = "rng") -> None:
    """Checks that ``rng`` is None, a typed key (``jax.random.key``) or a raw uint32 key."""
    if rng is None:
        return
    dtype = getattr(rng, "dtype", None)
    if dtype is None:
        raise TypeError(
            f"{name} must be a JAX random key (jax.random.key(seed)) or None, got {_describe(rng)}."
        )
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(
                f"{name} must be a single key, got a key array of shape {tuple(rng.shape)}."
            )
        return
    if dtype != np.uint32 or rng.ndim != 1:
        raise TypeError(
            f"{name} must be a JAX random key (jax.random.key(seed)) or None, got {_describe(rng)}."
        )
    raw = _raw_key_shape()
    if tuple(rng.shape) != raw:
        raise ValueError(
            f"{name} is a raw uint32 key of shape {tuple(rng.shape)}, but raw keys of the "
            f"default PRNG implementation have shape {tuple(raw)}; pass jax.random.key(seed) "
            "(a typed key) or jax.random.PRNGKey(seed)."
        )


def _raw_key_shape() -> tuple[int, ...]:
    """The shape of a raw key (``jax.random.PRNGKey``) of the default implementation."""
    return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape)


def is_key(value: Any) -> bool:
    """Whether ``value`` is a JAX random key: a typed key array (``jax.random.key``), or
    a raw uint32 key of the default implementation (``jax.random.PRNGKey``)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "shape"):
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return dtype == np.uint32 and tuple(value.shape) == _raw_key_shape()


def key_as_input(inputs: Sequence[Any], call: str) -> None:
    """Raises if the last of ``inputs`` is a random key: ``rng`` passed positionally
    (``call`` shows the right call)."""
    if inputs and is_key(inputs[-1]):
        raise TypeError(
            f"the last positional argument, inputs[{len(inputs) - 1}], is a JAX random key "
            f"({_describe(inputs[-1])}), but positional arguments are the batches to "
            "encode, one per input (and it would be encoded as one). The dropout key is a "
            f"keyword argument: pass it as rng=, e.g. {call}."
        )


def missing_key(name: str, error: Exception) -> TypeError:
    """The error for an encoder that draws random numbers (dropout) but got no key."""
    return TypeError(
        f"{name} draws random numbers (e.g. dropout) but got key=None ({error}). Pass a "
        "key: rng=jax.random.key(seed) to the gc_jax step (cached_value_and_grad's "
        "function, make_train_step's train_step, GradCache), or encode_batch(params, "
        "batch, key) for chunked_encoder; or run the encoder deterministically when its "
        "key is None."
    )


def _signature(fn: Callable) -> str:
    """``fn`` in a message: its name and signature."""
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        return f"{name}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return name


def _takes_three(fn: Callable) -> bool:
    """Whether ``fn(params, chunk, key)`` binds to ``fn``'s signature (True if unknown)."""
    try:
        inspect.signature(fn).bind(None, None, None)
    except ValueError:  # no signature (some builtins)
        return True
    except TypeError:
        return False
    return True


_PACKING_KEYS = ("'segment_ids'", "'position_ids'", "'segment_starts'")


def call_encoder(encode: Callable, params: PyTree, chunk: PyTree, key: Any, name: str) -> PyTree:
    """``encode(params, chunk, key)``; a missing key is named (see :func:`missing_key`),
    and so is a model that does not take a ``TokenPacking``'s keys."""
    try:
        return encode(params, chunk, key)
    except TypeError as e:
        if not _takes_three(encode):
            raise TypeError(
                f"{name} is called as encode(params, chunk, key), but "
                f"{_signature(encode)} cannot take those three arguments ({e}). Every "
                "encoder takes the chunk's dropout key as its third argument (None when the "
                "step has no rng=); give it one even if it is unused: "
                "def encode(params, chunk, key): ... or lambda params, chunk, key: ...."
            ) from e
        if (
            any(k in str(e) for k in _PACKING_KEYS)
            and "segment_ids" in getattr(chunk, "keys", list)()
        ):
            raise TypeError(
                f"{name} does not take the keys a gc_jax.TokenPacking adds to each chunk "
                f"({e}): a packed chunk holds several rows per line, and the model must "
                "read segment_ids, position_ids and segment_starts to keep them apart and "
                "return one row per slot (see gc_jax.packing), or take **kwargs and "
                "ignore them only if rows never interact. Or pass an int chunk_size or a "
                "gc_jax.TokenBudget."
            ) from e
        if key is not None or "PRNG key" not in str(e):
            raise
        raise missing_key(name, e) from e


def _structure(tree: PyTree) -> str:
    """A model output in a message: its arrays' shapes in place of the arrays."""
    shapes = jax.tree.map(lambda x: tuple(x.shape) if hasattr(x, "shape") else x, tree)
    return repr(shapes)


def picked_rep(get_rep: Callable[[Any], PyTree] | None, out: Any, name: str) -> PyTree:
    """``get_rep(out)`` (``out`` if None), checked to be an array or a pytree of arrays."""
    rep = out if get_rep is None else get_rep(out)
    leaves = jax.tree.leaves(rep)
    if leaves and all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
        return rep
    given = "the model" if get_rep is None else "get_rep"
    raise TypeError(
        f"{name}: {given} returned {_describe(rep)}, not an array or a pytree of arrays. "
        f"The model's output is {_structure(out)}; pass get_rep= to pick the "
        "representation out of it, e.g. get_rep=lambda out: out['pooled_output'] or "
        "get_rep=lambda out: out[:, 0] (first token)."
    )


ENCODER_VIEWS = ("auto", "local", "global")


def encoder_view(value: Any) -> EncoderView:
    """Checks an ``encoder_view`` argument."""
    if value not in ENCODER_VIEWS:
        raise ValueError(
            f"encoder_view must be one of {ENCODER_VIEWS}, got {value!r}: 'local' encodes "
            "each device's rows on their own (data parallel), 'global' lets the chunk span "
            "the devices (the encoder's own sharding, e.g. FSDP), 'auto' picks."
        )
    return value
