"""Keras 3 adapter: a Keras model on the JAX backend as a gc_jax encoder.

Keras is an optional dependency (``pip install "gc-jax[keras]"``), imported only
when :func:`keras_encoder` is called. The model runs through
``model.stateless_call``: its trainable variables are the differentiated params;
its non-trainable variables are read and never updated, with the state of every
``keras.random.SeedGenerator`` (where Keras keeps dropout seeds) drawn from the
chunk's key.
"""

from __future__ import annotations

import inspect
import os
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gc_jax import _validation
from gc_jax._base import PyTree
from gc_jax._model_calls import PER_CHUNK_STATISTICS

_SEED_STATE = "seed_generator_state"  # the name Keras gives a SeedGenerator's variable


def _keras() -> Any:
    """Keras, checked to run on the JAX backend."""
    try:
        import keras
    except ImportError as e:
        raise ImportError(f"keras_encoder needs Keras 3 ({e}): pip install 'gc-jax[keras]'.") from e

    backend = keras.backend.backend()
    if backend != "jax":
        raise ValueError(
            f"keras_encoder needs Keras on the JAX backend, but Keras runs on {backend!r} "
            f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). Set "
            "os.environ['KERAS_BACKEND'] = 'jax' before the first `import keras` (or "
            "export KERAS_BACKEND=jax): the backend cannot change once Keras is imported."
        )
    return keras


def _by_path(variables: list[Any], name: str) -> dict[str, jax.Array]:
    values = {v.path: v.value for v in variables}
    if len(values) < len(variables):
        paths = sorted(p for p, n in Counter(v.path for v in variables).items() if n > 1)
        raise ValueError(
            f"{name}: several variables share the path(s) {paths}; the params are keyed "
            "by variable.path. Give the variables distinct names (layer.add_weight(..., "
            "name='...')), or the layers (keras.layers.Dense(..., name='...'))."
        )
    return values


def _trainable(model: Any, name: str) -> list[Any]:
    variables = list(model.trainable_variables)
    if variables:
        return variables
    state = "it is not built" if not model.built else "every variable is frozen"
    raise ValueError(
        f"{name}: the model has no trainable variables ({state}; "
        f"{len(model.non_trainable_variables)} non-trainable). gc_jax differentiates the "
        "trainable variables: build the model first (give a Sequential an input, e.g. "
        "keras.Input(shape), or call model.build(input_shape) or model(x) once), and "
        "keep the layers you train trainable (layer.trainable = True)."
    )


def _state(variables: list[Any], given: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """The non-trainable values by path: ``given``, or the model's current ones."""
    current = _by_path(variables, name)
    if given is None:
        return current
    if not isinstance(given, Mapping) or set(given) != set(current):
        keys = sorted(given) if isinstance(given, Mapping) else type(given).__name__
        raise ValueError(
            f"{name}: non_trainable must map every non-trainable variable's path to its "
            f"value, {sorted(current)}; got {keys}. Write non_trainable={{v.path: v.value "
            "for v in model.non_trainable_variables}."
        )
    return dict(given)


def _ordered(params: Any, variables: list[Any], name: str) -> list[Any]:
    """The trainable values in ``model.trainable_variables`` order."""
    try:
        return [params[v.path] for v in variables]
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(
            f"{name}: params must be the dict keras_encoder returned, keyed by "
            f"variable.path (e.g. {variables[0].path!r}); got {type(params).__name__} "
            f"({type(e).__name__}: {e})."
        ) from e


def _takes_training(model: Any) -> bool:
    """Whether ``model.call`` takes ``training=`` (``stateless_call`` passes it on as is)."""
    params = inspect.signature(model.call).parameters.values()
    return any(p.name == "training" or p.kind is p.VAR_KEYWORD for p in params)


def _reseeded(values: list[Any], seeds: list[int], key: jax.Array) -> list[Any]:
    """``values`` with every SeedGenerator state drawn from ``key`` (one per generator)."""
    if not seeds:
        return values
    bits = jax.random.bits(key, (len(seeds), 2), jnp.uint32)
    new = dict(zip(seeds, bits, strict=True))
    return [new[i].astype(v.dtype) if i in new else v for i, v in enumerate(values)]


def _check_not_updated(variables, seeds, before, after, name) -> None:
    updated = [
        v.path
        for i, (v, b, a) in enumerate(zip(variables, before, after, strict=True))
        if i not in seeds and a is not b
    ]
    if updated:
        raise ValueError(
            f"{name}: the model updated its non-trainable variables {updated[:4]} while "
            f"encoding a chunk: {PER_CHUNK_STATISTICS}. Set layer.trainable = False on its "
            "BatchNormalization layers before building the encoder (Keras then runs them "
            "on their moving statistics, dropout stays on), or use LayerNormalization."
        )


def _input_keys(model: Any) -> list[str] | None:
    """The keys of a model that takes a dict (a functional model built on a dict of
    ``keras.Input``), else None."""
    try:
        inputs = model.input
    except (AttributeError, ValueError):  # subclassed models: no declared inputs
        return None
    return sorted(inputs) if isinstance(inputs, Mapping) else None


def _check_keys(keys: list[str] | None, chunk: Any, name: str) -> None:
    """Raises if a dict-input model's chunk lacks one of its keys."""
    if keys is None or not isinstance(chunk, Mapping):
        return
    missing = [k for k in keys if k not in chunk]
    if missing:
        raise ValueError(
            f"{name}: the model takes a dict with the keys {keys}, but the batch has no "
            f"{missing} (its keys: {sorted(chunk)}); Keras cannot run the model without "
            f"them. Add {missing} to every batch given for this input, with the same "
            "leading batch axis as the other keys."
        )


def keras_encoder(
    model: Any,
    *,
    get_rep: Callable[[Any], PyTree] | None = None,
    non_trainable: Mapping[str, Any] | None = None,
    **call_kwargs: Any,
) -> tuple[Callable[[PyTree, PyTree, jax.Array | None], PyTree], dict[str, jax.Array]]:
    """Turns a Keras 3 model (JAX backend) into an encoder over its trainable variables.

    The chunk is the model's input, passed as ``model(chunk)`` as Keras does (an
    array, a list, or a dict such as KerasHub's ``{"token_ids": ..., "padding_mask":
    ...}``), through ``model.stateless_call``. With a key the model runs with
    ``training=True`` and every ``keras.random.SeedGenerator`` state (dropout seeds)
    is drawn from the chunk's key, so pass 2 replays pass 1's masks; with
    ``key=None`` it runs with ``training=False`` (no dropout). ``training=`` in
    ``call_kwargs`` overrides this.

    Non-trainable variables (frozen layers, BatchNormalization's moving statistics)
    are read, never differentiated nor updated. BatchNormalization in training mode
    would normalise each chunk with that chunk's statistics: set ``trainable =
    False`` on it (it then runs on its moving statistics); an update raises.

    Trained values go back into the model with ``variable.assign``, after which
    ``model.save_weights("model.weights.h5")`` saves them; or save the ``params``
    dict itself (e.g. with Orbax)::

        for v in model.trainable_variables:
            v.assign(params[v.path])

    Args:
      model: a built Keras 3 model or layer (functional, ``Sequential``, subclassed,
        a KerasHub backbone). Keras must run on JAX: set
        ``os.environ["KERAS_BACKEND"] = "jax"`` before importing it.
      get_rep: picks the representation out of the model's output, e.g.
        ``lambda out: out["pooled_output"]`` for a KerasHub ``BertBackbone``.
      non_trainable: the non-trainable values, ``{v.path: v.value for v in
        model.non_trainable_variables}``; default: the model's values now, captured
        when the encoder is built (baked into a jitted step as constants). For large
        frozen layers, or state that changes between steps, build the encoder inside
        the jitted step from values passed to it.
      **call_kwargs: static keyword arguments for every call of the model.

    Returns:
      ``(encode, params)``: ``encode(params, chunk, key)`` for
      ``cached_value_and_grad``, ``chunked_encoder``, ``make_train_step`` and
      ``gc_jax.testing``, and the values to train, ``params = {v.path: v.value for
      v in model.trainable_variables}``.

    Raises:
      ValueError: if Keras does not run on JAX, the model has no trainable
        variables, or (when encoding) the model updates a non-trainable variable.
      TypeError: (when encoding) if ``get_rep`` returns something that is not an
        array or a pytree of arrays.

    Examples:
      >>> import os
      >>> os.environ.setdefault("KERAS_BACKEND", "jax")  # before importing keras
      '...'
      >>> import jax, keras, gc_jax
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8),
      ...                           keras.layers.Dropout(0.1), keras.layers.Dense(3)])
      >>> encode, params = gc_jax.keras_encoder(model)
      >>> x = jax.numpy.ones((4, 2))
      >>> encode(params, x, jax.random.key(0)).shape  # with dropout
      (4, 3)
      >>> loss = lambda p, q, d: gc_jax.losses.contrastive_loss(q, d)
      >>> grad_fn = jax.jit(gc_jax.cached_value_and_grad(loss, encode, chunk_size=2))
      >>> value, grads = grad_fn(params, x, x, rng=jax.random.key(1))
      >>> sorted(grads) == sorted(v.path for v in model.trainable_variables)
      True
      >>> params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)  # a step
      >>> for v in model.trainable_variables:  # write the trained values back
      ...     _ = v.assign(params[v.path])
      >>> bool(jax.numpy.allclose(model(x), encode(params, x, None)))
      True
    """
    _keras()
    name = f"keras_encoder({type(model).__name__})"
    if not callable(getattr(model, "stateless_call", None)):
        raise TypeError(f"{name}: model must be a Keras 3 model or layer, got {model!r}.")
    trainable, rest = _trainable(model, name), list(model.non_trainable_variables)
    params, state = _by_path(trainable, name), _state(rest, non_trainable, name)
    seeds = [i for i, v in enumerate(rest) if v.name == _SEED_STATE]
    takes_training = _takes_training(model)
    keys = _input_keys(model)

    def encode(params, chunk, key):
        _check_keys(keys, chunk, name)
        before = [jax.lax.stop_gradient(jnp.asarray(state[v.path], v.dtype)) for v in rest]
        values = before if key is None else _reseeded(before, seeds, key)
        kwargs = {"training": key is not None} if takes_training else {}
        kwargs.update(call_kwargs)  # training= given there wins
        out, after = model.stateless_call(
            _ordered(params, trainable, name), values, chunk, **kwargs
        )
        _check_not_updated(rest, seeds, values, after, name)
        return _validation.picked_rep(get_rep, out, name)

    return encode, params
