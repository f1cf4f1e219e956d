"""Equinox adapter: an ``eqx.Module`` as a gc_jax encoder.

Equinox is an optional dependency (``pip install "gc-jax[equinox]"``), imported
only when :func:`equinox_encoder` is called. The params are the model's floating
point arrays (``eqx.partition(model, eqx.is_inexact_array)``); the rest of the
model is static. Equinox models usually take one example, so by default the
encoder vmaps the model over the chunk's rows, each row with its own key.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax

from gc_jax import _validation
from gc_jax._base import PyTree
from gc_jax._model_calls import call_with_chunk


def _takes_key(model: Any) -> bool:
    """Whether ``model(...)`` accepts ``key=`` (assumed so if it cannot be inspected)."""
    try:
        params = inspect.signature(model).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "key" or p.kind is p.VAR_KEYWORD for p in params)


def _training_dropouts(model: Any, eqx: Any) -> list[str]:
    """Where the model has an ``eqx.nn.Dropout`` in training mode (``inference=False``)."""
    is_dropout = lambda x: isinstance(x, eqx.nn.Dropout)
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_dropout)[0]
    return [
        "model" + jax.tree_util.keystr(path)
        for path, leaf in leaves
        if is_dropout(leaf) and not leaf.inference
    ]


def _stateful(model: Any, eqx: Any) -> list[str]:
    """Where the model has layers that use an ``eqx.nn.State`` (``eqx.nn.BatchNorm``, ...),
    and ``"model(..., state)"`` if its ``__call__`` requires one."""
    is_stateful = lambda x: (
        isinstance(x, eqx.nn.StatefulLayer)
        and not isinstance(x, eqx.nn.Sequential)  # look inside: which of its layers
        and x.is_stateful()
    )
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_stateful)[0]
    found = ["model" + jax.tree_util.keystr(p) for p, leaf in leaves if is_stateful(leaf)]
    with contextlib.suppress(TypeError, ValueError):
        state = inspect.signature(model).parameters.get("state")
        if state is not None and state.default is state.empty:  # a required `state`
            found.append("model(..., state)")
    return found


def _check_model(model: Any, params: PyTree, name: str, eqx: Any) -> None:
    if not isinstance(model, eqx.Module) or not callable(model):
        raise TypeError(f"{name}: model must be a callable equinox.Module, got {model!r}.")
    if stateful := _stateful(model, eqx):
        raise ValueError(
            f"{name}: the model uses an eqx.nn.State ({', '.join(stateful[:4])}), and "
            "stateful layers are not supported by equinox_encoder: an encoder cannot "
            "update state, and BatchNorm in training mode would normalise each chunk with "
            "its own statistics. Write the encoder by hand (docs/models.md, 'Any other "
            "model'): run the model in inference mode (eqx.nn.inference_mode) on a fixed "
            "state and return only its output, not the new state; or use "
            "eqx.nn.LayerNorm, which needs no state."
        )
    if not jax.tree.leaves(params):
        raise ValueError(
            f"{name}: the model has no arrays to differentiate under the filter (no "
            "floating-point arrays with the default eqx.is_inexact_array)."
        )
    dropouts = _training_dropouts(model, eqx)
    if dropouts and not _takes_key(model):
        raise ValueError(
            f"{name}: the model has eqx.nn.Dropout in training mode ({', '.join(dropouts)}) "
            f"but {type(model).__name__}.__call__ takes no `key`, so the chunk's key cannot "
            "reach it. Add `*, key=None` to __call__ and hand the dropouts keys split from "
            "it (jax.random.split(key)), or turn dropout off with eqx.nn.inference_mode(model)."
        )


def _call(model: Any, takes_key: bool, chunk: PyTree, key: jax.Array | None) -> Any:
    """``model`` on ``chunk`` as the PyTorch GradCache calls a model, with ``key=``."""
    fn = functools.partial(model, key=key) if takes_key and key is not None else model
    return call_with_chunk(fn, chunk)


def _per_row(call: Callable, chunk: PyTree, key: jax.Array | None) -> Any:
    """``call`` vmapped over the chunk's rows; row ``r`` gets ``split(key, rows)[r]``."""
    rows = _validation.leading_size(chunk, "the chunk")
    keys = None if key is None else jax.random.split(key, rows)
    return jax.vmap(call)(chunk, keys)


def _vmap_hint(name: str, vmap: bool) -> str:
    """What to check when the model fails on a chunk: whether it takes one example."""
    if vmap:
        return (
            f"({name} calls the model once per row of the chunk (vmap=True, the default). "
            "If the model takes a whole batch at once, pass vmap=False.)"
        )
    return (
        f"({name} with vmap=False calls the model once on the whole chunk. If the model "
        "takes one example at a time, as eqx.nn layers do, leave vmap=True (the default): "
        "it is then vmapped over the chunk's rows.)"
    )


def equinox_encoder(
    model: Any,
    *,
    get_rep: Callable[[Any], PyTree] | None = None,
    vmap: bool = True,
    filter_spec: Any = None,
) -> tuple[Callable[[PyTree, PyTree, jax.Array | None], PyTree], PyTree]:
    """Turns an Equinox module into an encoder over its floating-point arrays.

    ``params, static = eqx.partition(model, filter_spec)``; the encoder calls
    ``eqx.combine(params, static)`` on the chunk as the PyTorch GradCache calls a
    model: an array as ``model(x)``, a tuple as ``model(*x)``, a dict as
    ``model(**x)``. With ``vmap=True`` (the default, for models written for one
    example, as ``eqx.nn`` layers are) it is ``jax.vmap``-ed over the chunk's rows
    and row ``r`` gets the key ``jax.random.split(key, rows)[r]``; with
    ``vmap=False`` the model gets the whole chunk and the chunk's key. Either way
    the keys depend only on the chunk's key, so dropout is replayed exactly in
    pass 2. The key is passed as ``key=`` if the model's ``__call__`` takes one;
    with ``key=None`` the model runs under ``eqx.nn.inference_mode`` (no dropout).

    Stateful layers (``eqx.nn.BatchNorm`` with ``eqx.nn.State``) are not supported
    (a ``ValueError`` names them): write the encoder by hand (see docs/models.md)
    with the state read, not updated.

    Args:
      model: the ``eqx.Module``, called as ``model(x, *, key=None)``.
      get_rep: picks the representation out of the model's output for the chunk
        (rows first, after the ``vmap``), e.g. ``lambda out: out[:, 0]``.
      vmap: call the model once per row (True) or once on the whole chunk (False).
      filter_spec: which leaves are params, as in ``eqx.partition``; default
        ``eqx.is_inexact_array``.

    Returns:
      ``(encode, params)``: ``encode(params, chunk, key)`` for
      ``cached_value_and_grad``, ``chunked_encoder``, ``make_train_step`` and
      ``gc_jax.testing``, and the params to train (the model's pytree, other leaves None). The
      trained model is ``eqx.combine(params, eqx.partition(model, filter_spec)[1])``.

    Raises:
      ValueError: if the model has ``eqx.nn.Dropout`` in training mode but its
        ``__call__`` takes no ``key``, stateful layers (``eqx.nn.State``), or no
        arrays to differentiate.
      TypeError: if ``model`` is not an ``eqx.Module``; (when encoding) if
        ``get_rep`` returns something that is not an array or a pytree of arrays.

    Examples:
      >>> import jax, equinox as eqx, gc_jax
      >>> model = eqx.nn.MLP(2, 3, width_size=8, depth=1, key=jax.random.key(0))
      >>> encode, params = gc_jax.equinox_encoder(model)
      >>> x = jax.numpy.ones((4, 2))
      >>> encode(params, x, None).shape
      (4, 3)
      >>> loss = lambda p, q, d: gc_jax.losses.contrastive_loss(q, d)
      >>> grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size=2))
      >>> value, grads = grad_fn(params, x, x)
      >>> trained = eqx.combine(params, eqx.partition(model, eqx.is_inexact_array)[1])
    """
    try:
        import equinox as eqx
    except ImportError as e:
        raise ImportError(
            f"equinox_encoder needs Equinox ({e}): pip install 'gc-jax[equinox]'."
        ) from e

    name = f"equinox_encoder({type(model).__name__})"
    params, static = eqx.partition(model, filter_spec or eqx.is_inexact_array)
    _check_model(model, params, name, eqx)
    takes_key = _takes_key(model)

    def encode(params, chunk, key):
        module = eqx.combine(params, static)
        if key is None:
            module = eqx.nn.inference_mode(module)
        call = functools.partial(_call, module, takes_key)
        try:
            out = _per_row(call, chunk, key) if vmap else call(chunk, key)
        except (TypeError, ValueError) as e:
            kind = TypeError if isinstance(e, TypeError) else ValueError
            raise kind(f"{e}\n{_vmap_hint(name, vmap)}") from e
        return _validation.picked_rep(get_rep, out, name)

    return encode, params
