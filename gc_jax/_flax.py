"""Flax adapters: Linen and NNX modules as gc_jax encoders.

An encoder is ``encode(params, chunk, key) -> reps``. The adapters call the module
on a chunk the way the PyTorch GradCache calls a model: an array ``x`` as
``model(x)``, a list or tuple as ``model(*x)``, a dict as ``model(**x)``, a
``(list, dict)`` pair as ``model(*x[0], **x[1])``; and
``get_rep`` picks the representation out of the output (e.g. a pooled vector).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import errors as flax_errors
from flax import linen, nnx
from flax.nnx import graphlib

from gc_jax import _validation
from gc_jax._base import PyTree
from gc_jax._model_calls import PER_CHUNK_STATISTICS, call_with_chunk


def _identity(x: Any) -> Any:
    return x


def _check_extra_variables(extra_variables: Any) -> dict[str, Any]:
    if extra_variables is None:
        return {}
    if not isinstance(extra_variables, Mapping):
        raise TypeError(
            "extra_variables must be a mapping from collection name to variables, e.g. "
            "extra_variables={'batch_stats': variables['batch_stats']}; got "
            f"{type(extra_variables).__name__}."
        )
    if "params" in extra_variables:
        raise ValueError(
            "extra_variables must not contain 'params': the params are the encoder's "
            "first argument (the ones differentiated). Pass only the other collections, "
            "e.g. extra_variables={'batch_stats': variables['batch_stats']}."
        )
    return dict(extra_variables)


def _linen_error(error: Exception, module: linen.Module, given: list[str]) -> Exception:
    """A Flax scope error while encoding, restated with what to write instead."""
    name = type(module).__name__
    if isinstance(error, flax_errors.ModifyScopeVariableError):
        return ValueError(
            f"linen_encoder({name}): the module tried to update a variable collection "
            f"while encoding a chunk ({error}). gc_jax encoders cannot update "
            f"collections, and {PER_CHUNK_STATISTICS}. Run it on running statistics "
            "(e.g. nn.BatchNorm(use_running_average=True)) and pass them with "
            "extra_variables={'batch_stats': ...}, or use LayerNorm/GroupNorm."
        )
    found = re.search(r'collection "([^"]+)"', str(error))
    col = found.group(1) if found else "<collection>"
    return ValueError(
        f"linen_encoder({name}): the module reads the variable collection {col!r}, "
        f"but the encoder only has {given} ({error}). Pass it with "
        f"linen_encoder(..., extra_variables={{{col!r}: variables[{col!r}]}})."
    )


def linen_encoder(
    module: linen.Module,
    *,
    method: str | Callable[..., Any] | None = None,
    get_rep: Callable[[Any], PyTree] | None = None,
    rng_collection: str = "dropout",
    extra_variables: Mapping[str, PyTree] | None = None,
    **apply_kwargs: Any,
) -> Callable[[PyTree, PyTree, jax.Array | None], PyTree]:
    """Turns a Linen module into an encoder over its ``params`` collection.

    Args:
      module: the Linen module.
      method: the method to apply (name or unbound method), default ``__call__``;
        e.g. ``"encode_image"`` for one tower of a two-tower module.
      get_rep: picks the representation out of the module's output.
      rng_collection: the RNG collection the chunk key feeds (Flax's ``Dropout``
        uses ``"dropout"``). With no key, no RNG is passed.
      extra_variables: the module's other variable collections, e.g.
        ``{"batch_stats": variables["batch_stats"]}`` for a ``BatchNorm`` run on
        its running statistics (``use_running_average=True``). They are read,
        never differentiated or updated. They are captured when the encoder is
        built: for statistics that change between steps, build the encoder inside
        the jitted step from the state passed to it (otherwise they are baked into
        the compiled step as constants).
      **apply_kwargs: static keyword arguments for every call, e.g.
        ``deterministic=False``.

    Returns:
      ``encode(params, chunk, key)`` where ``params`` is the module's ``"params"``
      collection (``variables["params"]``, or ``TrainState.params``).

    Raises:
      ValueError: (when encoding) if the module reads a collection that is not in
        ``extra_variables``, or tries to update one (BatchNorm in training mode:
        each chunk would be normalised with its own statistics).

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, gc_jax
      >>> model = nn.Dense(3)
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
      >>> encode = gc_jax.linen_encoder(model)
      >>> encode(params, jnp.ones((4, 2)), None).shape
      (4, 3)

      A model with ``BatchNorm`` on its running statistics:

      >>> class Tower(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return nn.BatchNorm(use_running_average=True)(nn.Dense(3)(x))
      >>> variables = Tower().init(jax.random.key(0), jnp.ones((1, 2)))
      >>> encode = gc_jax.linen_encoder(
      ...     Tower(), extra_variables={"batch_stats": variables["batch_stats"]})
      >>> encode(variables["params"], jnp.ones((4, 2)), None).shape
      (4, 3)
    """
    get_rep = get_rep or _identity
    extra = _check_extra_variables(extra_variables)
    given = ["params", *extra]

    def encode(params, chunk, key):
        rngs = {} if key is None else {rng_collection: key}
        variables = {**jax.lax.stop_gradient(extra), "params": params}
        fn = lambda *a, **k: module.apply(
            variables, *a, method=method, rngs=rngs, **apply_kwargs, **k
        )
        try:
            return get_rep(call_with_chunk(fn, chunk))
        except (flax_errors.ModifyScopeVariableError, flax_errors.ScopeCollectionNotFound) as e:
            raise _linen_error(e, module, given) from e
        except flax_errors.ApplyScopeInvalidVariablesStructureError as e:
            raise ValueError(
                f"linen_encoder({type(module).__name__}) got a whole Linen variables dict as "
                f"params (a 'params' collection inside params: {sorted(params)}). The "
                "encoder's params are the 'params' collection only: pass "
                "variables['params'] (or TrainState.params), and the other collections "
                "with linen_encoder(..., extra_variables={'batch_stats': ...})."
            ) from e
        except flax_errors.InvalidRngError as e:
            if key is not None:
                raise
            raise _validation.missing_key(f"linen_encoder({type(module).__name__})", e) from e

    return encode


def _batch_stats(module: nnx.Module) -> list[tuple[Any, nnx.Variable, Any]]:
    return [
        (path, v, v.get_value())
        for path, v in nnx.iter_graph(module)
        if isinstance(v, nnx.BatchStat)
    ]


def _training_dropouts(module: nnx.Module) -> list[str]:
    """Where ``module`` has dropout in training mode: layers with ``deterministic=False``
    and a rate (``rate``, ``dropout_rate``) that is not zero."""
    found = []
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module) and getattr(node, "deterministic", None) is False:
            rate = getattr(node, "rate", getattr(node, "dropout_rate", None))
            if not (isinstance(rate, int | float) and rate == 0):
                found.append(".".join(map(str, path)))
    return found


def _check_no_training_dropout(module: nnx.Module, name: str) -> None:
    """Raises if ``module`` (run with no key) has dropout in training mode, as a Linen
    module with dropout on raises without ``rngs``: dropout is never turned off silently."""
    dropouts = [".".join(filter(None, (name, p))) for p in _training_dropouts(module)]
    if dropouts:
        raise TypeError(
            f"{name} has dropout in training mode ({', '.join(dropouts[:4])}) but got "
            "key=None: dropout draws its masks from the chunk's key, and gc_jax does not "
            "turn it off behind your back. To train with dropout, pass a key: "
            "rng=jax.random.key(seed) to the gc_jax step (cached_value_and_grad's "
            "function, make_train_step's train_step, GradCache), or encode_batch(params, "
            "batch, key) for chunked_encoder. To run without it (evaluation), say so: "
            "build the encoder from nnx.view(model, deterministic=True) (or call "
            "model.eval() first)."
        )


def call_nnx(
    module: nnx.Module,
    method: str,
    chunk: PyTree,
    key: jax.Array | None,
    get_rep: Callable[[Any], PyTree] | None,
    name: str = "model",
) -> PyTree:
    """Runs a freshly merged NNX module on a chunk, as :func:`nnx_encoder` does.

    With a key every RNG stream is reseeded from it. Without one the module must have
    no dropout in training mode (``nnx.view(model, deterministic=True)`` turns it off;
    otherwise this raises, naming ``rng=``) and runs with ``deterministic=True``.
    Raises if the module updates its ``nnx.BatchStat`` variables (BatchNorm in
    training mode: per-chunk statistics).
    """
    if key is None:
        _check_no_training_dropout(module, name)
        with contextlib.suppress(ValueError):  # no module has `deterministic`
            module = nnx.view(module, deterministic=True)
    else:
        streams = {s.tag for _, s in nnx.iter_graph(module) if isinstance(s, nnx.RngStream)}
        if streams:  # a scanned stack's streams hold a key per layer: split to match
            nnx.reseed(module, policy="match_shape", **dict.fromkeys(streams, key))
    stats = _batch_stats(module)
    out = call_with_chunk(getattr(module, method), chunk)
    updated = [path for path, v, before in stats if v.get_value() is not before]
    if updated:
        where = ", ".join(f"{name}." + ".".join(map(str, p)) for p in updated[:4])
        raise ValueError(
            f"{name} updated its nnx.BatchStat variables while encoding a chunk ({where}): "
            f"{PER_CHUNK_STATISTICS}. Run BatchNorm on its running statistics: pass "
            "nnx.view(model, use_running_average=True) (dropout stays on) or build it "
            "with use_running_average=True; or use LayerNorm/GroupNorm."
        )
    return (get_rep or _identity)(out)


def fresh(state: PyTree) -> PyTree:
    """A fresh copy of an ``nnx.State``'s variables, made in the current trace.

    NNX ties a variable to the trace it was made in: the RNG counters of a copy made
    elsewhere cannot be updated, and NNX transforms inside the model (``nnx.scan``
    over stacked layers, ``nnx.remat``) refuse it. The state passed in often comes
    from an outer trace (the step's, closed over by gc_jax's chunk loop).
    """
    return jax.tree.map(_identity, state)


def _merged(graphdef: Any, params: Any, rest: nnx.State, name: str) -> nnx.Module:
    """``nnx.merge(graphdef, params, rest)``, or an error saying what ``params`` must be."""
    fix = (
        "The encoder's params are the model's nnx.Param state: pass params = "
        "nnx.state(model, nnx.Param) (or the second value of graphdef, params, rest = "
        "nnx.split(model, nnx.Param, ...)), and after training write it back with "
        "nnx.update(model, params)."
    )
    if isinstance(params, nnx.Module):
        raise TypeError(
            f"{name} got an nnx.Module ({type(params).__name__}) as params, not its state. " + fix
        )
    try:
        return nnx.merge(graphdef, fresh(params), fresh(rest))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f"{name} got params that do not match the model it was built from "
            f"({type(e).__name__}: {e}). {fix}"
        ) from e


def nnx_encoder(
    model: nnx.Module,
    *,
    method: str = "__call__",
    get_rep: Callable[[Any], PyTree] | None = None,
) -> Callable[[nnx.State, PyTree, jax.Array | None], PyTree]:
    """Turns an NNX module into an encoder over its ``nnx.Param`` state.

    The module's other state (RNG streams, ``nnx.BatchStat`` running statistics,
    other non-``Param`` variables) is captured as it is when the encoder is built,
    read and never differentiated; for such state that changes between steps,
    build the encoder inside the jitted step from the model passed to it. Each
    chunk reseeds every RNG stream of the module with the chunk's key, so dropout
    masks are replayed exactly in pass 2. With no key (a step without ``rng=``,
    ``encode(params, x, None)``), a module with dropout in training mode raises,
    naming ``rng=``, as a Linen module does: to run it without dropout, build the
    encoder from ``nnx.view(model, deterministic=True)`` (or call ``model.eval()``
    first). A module without dropout in training mode runs deterministically.

    ``nnx.BatchNorm`` must run on its running statistics: pass
    ``nnx.view(model, use_running_average=True)`` (it shares the model's
    variables, and keeps dropout on). In training mode it would normalise each
    chunk with that chunk's statistics, which is detected and raises.

    Args:
      model: the NNX module.
      method: the method to call, default ``__call__``.
      get_rep: picks the representation out of the module's output.

    Returns:
      ``encode(params, chunk, key)`` where ``params = nnx.state(model, nnx.Param)``.

    Raises:
      ValueError: (when encoding) if the module updates its ``nnx.BatchStat``
        variables, i.e. computes statistics over the chunk; or if ``params`` does
        not match the model.
      TypeError: (when encoding) with no key while dropout is in training mode; or
        if ``params`` is the module itself, not ``nnx.state(model, nnx.Param)``.

    Examples:
      >>> import jax.numpy as jnp, gc_jax
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> encode = gc_jax.nnx_encoder(model)
      >>> encode(nnx.state(model, nnx.Param), jnp.ones((4, 2)), None).shape
      (4, 3)

      A model with ``BatchNorm``, run on its running statistics:

      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
      ...                        nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
      >>> encode = gc_jax.nnx_encoder(nnx.view(model, use_running_average=True))
      >>> encode(nnx.state(model, nnx.Param), jnp.ones((4, 2)), None).shape
      (4, 3)

      A model with dropout: trained with a key, evaluated in eval mode:

      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
      ...                        nnx.Dropout(0.1, rngs=nnx.Rngs(0)))
      >>> eval_encode = gc_jax.nnx_encoder(nnx.view(model, deterministic=True))
      >>> eval_encode(nnx.state(model, nnx.Param), jnp.ones((4, 2)), None).shape
      (4, 3)
    """
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    name = f"nnx_encoder({type(model).__name__})"

    def encode(params, chunk, key):
        module = _merged(graphdef, params, rest, name)
        return call_nnx(module, method, chunk, key, get_rep)

    return encode


# --- reading an enclosing NNX transform's bookkeeping (used by GradCache) ---


def update_contexts() -> list[Any]:
    """The active NNX transforms' maps from outer graph nodes to traced ones."""
    try:
        stacks = graphlib.GRAPH_CONTEXT.update_context_stacks
        return [ctx for stack in stacks.values() for ctx in reversed(stack)]
    except AttributeError:  # another Flax version: no mapping (GradCache then asks for params=)
        return []


def traced_copy(variable: Any, contexts: list[Any]) -> Any:
    """The variable an enclosing NNX transform traces in place of ``variable``."""
    for _ in range(len(contexts)):  # nested transforms: follow the chain inwards
        for ctx in contexts:
            outer = getattr(ctx, "outer_ref_outer_index", None)
            inner = getattr(ctx, "outer_index_inner_ref", None)
            index = None if outer is None or inner is None else outer.get(variable)
            if index is not None and index in inner and inner[index] is not variable:
                variable = inner[index]
                break
        else:
            return variable
    return variable
