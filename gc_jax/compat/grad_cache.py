"""``GradCache``: the PyTorch GradCache class API for Flax NNX modules.

A thin, jitted wrapper over :func:`gc_jax.cached_value_and_grad` and the NNX
encoder of :mod:`gc_jax._flax`: no second implementation of the algorithm.

Two things make the class safe to use the way NNX code is usually written:

- *Inside* ``nnx.jit`` (or another NNX transform), the models the object holds are
  not the ones being traced: the transform works on copies. Every call looks up
  the traced copy of each held variable in the transform's bookkeeping (the
  ``update_context`` that maps outer graph nodes to inner ones), so ``gc(x, y)``
  in an ``nnx.jit`` step reads the weights passed to that step. Where no traced
  copy exists (plain ``jax.jit``, tree-mode ``nnx.jit``, a model captured by
  closure), the weights would be baked into the compiled step as constants; that
  raises and asks for ``params=``.
- All distinct models are split *jointly*, so a submodule shared by two towers is
  one leaf and gets one gradient, the sum over both towers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from gc_jax import _flax, _validation, _value_and_grad
from gc_jax._base import AxisName, EncoderView, PyTree
from gc_jax._chunks import plan as _plan
from gc_jax._chunks.plan import ChunkSize

__all__ = ["GradCache"]


def _is_array_tree(value: Any) -> bool:
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(x, jax.Array | np.ndarray) for x in leaves)


def _partition(loss_kwargs: dict[str, Any]) -> tuple[dict[str, Any], tuple]:
    """Splits loss kwargs into traced (pytrees of arrays) and static (hashable) ones."""
    dyn = {k: v for k, v in loss_kwargs.items() if _is_array_tree(v)}
    static = tuple(sorted((k, v) for k, v in loss_kwargs.items() if k not in dyn))
    for k, v in static:
        try:
            hash(v)
        except TypeError:
            raise TypeError(
                f"loss_kwargs[{k!r}] must be a pytree of arrays (traced) or hashable "
                f"(static), got {type(v).__name__}."
            ) from None
    return dyn, static


def _is_traced(tree: PyTree) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _under_trace() -> bool:
    """Whether we are being staged out (jit, pmap, shard_map, scan, ...)."""
    return isinstance(jnp.zeros(()), jax.core.Tracer)


def _per_model(joint: nnx.State, n: int) -> tuple[nnx.State, ...]:
    raw = joint.raw_mapping
    return tuple(nnx.State(raw.get(i, {})) for i in range(n))


def _joint(per_model: Sequence[nnx.State]) -> nnx.State:
    return nnx.State(dict(enumerate(per_model)))


def _paths(tree: PyTree) -> set[str]:
    return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


class GradCache:
    """Gradient-cached steps for NNX encoders, ported from the PyTorch ``GradCache`` class.

    ``cache_step`` (or calling the object) returns ``(loss, grads)`` equal to the
    full-batch ``jax.value_and_grad`` while holding one chunk's activations at a time.
    The step is jitted once per input shape and cached. The models are read with
    ``nnx.split`` at every call but never modified (nor is their non-``Param`` state,
    e.g. RNG counters or batch statistics): apply ``grads`` with ``nnx.Optimizer``.

    Call it eagerly, or inside an ``nnx.jit`` step that takes the models as
    arguments (see the examples): there it reads the traced models, so each step
    uses the current weights. Inside ``jax.jit``, ``pmap``, ``shard_map`` or a
    tree-mode ``nnx.jit`` (``graph=False``), pass the weights as ``params=``, an
    argument of that transform; calling it there without ``params=`` raises,
    because the weights would be compiled in as constants and never change.

    Differences from the PyTorch class: gradients are returned, not accumulated on
    the weights; there is no ``fp16``/``scaler`` (mixed precision is the encoder's
    dtype business, see ``cached_value_and_grad(loss_scale=...)``); and there is no
    ``no_sync_except_last``: under ``axis_name`` gradients are all-reduced exactly
    once per step by construction, never once per chunk.

    Args:
      models: one ``nnx.Module`` or a sequence of them, one per model input. The same
        object may appear more than once (tied weights): it then gets one gradient,
        the sum over its uses, like the hooks of the original. Distinct models may
        share submodules or variables (a shared embedding): a shared variable gets
        one gradient, the sum over all towers, and appears in ``grads`` only under
        the first model that holds it; apply such ``grads`` with one optimizer over
        all the models, ``nnx.Optimizer((a, b), tx, wrt=nnx.Param)`` and
        ``optimizer.update((a, b), grads)`` (one optimizer per tower would update
        the shared weights twice, and fails on the missing leaves).
      chunk_sizes: rows encoded at once, one int for all models or one per model; or
        a :class:`gc_jax.TokenBudget` (chunks of at most that many tokens, rows
        grouped by length and trimmed to a bucket) or :class:`gc_jax.TokenPacking`
        (rows packed into lines), for all models or per model.
      loss_fn: ``loss_fn(*reps, **loss_kwargs)``, the scalar loss of the whole
        batch's representations, one per model (``(loss, aux)`` with ``has_aux``).
        Under ``axis_name`` it must return the global loss with the gradient of
        this device's share, as ``gc_jax.losses(..., axis_name=...)`` and losses
        decorated with ``gc_jax.compat.functional.gather_inputs`` do.
      split_input_fn: optional ``split_input_fn(model_input, chunk_size)`` returning a
        non-empty list of chunk pytrees. Their concatenation along axis 0, in order,
        is the batch (so the hook may select or reorder rows, as in the original;
        ``loss_fn`` sees the representations in that order). The batch is then
        re-chunked into ``chunk_size`` rows: memory and dropout keys follow
        ``chunk_sizes``, not the hook's boundaries.
      get_rep_fn: picks the representation out of a model's output.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      axis_name: the data-parallel axis when called inside ``pmap``/``shard_map``
        (pass the weights as ``params=``, see ``cache_step``). None for one device
        or for a batch sharded over a mesh under plain ``jit``.
      batch_axis: under plain ``jit`` with *auto* mesh axes (``jax.set_mesh``), the
        mesh axes the batch is sharded over; not needed under explicit axes, where
        the sharding is read from the array types (as ``cached_value_and_grad``).
      cache_dtype: dtype of the cached float representations (default: the models'
        own output dtype), as ``cached_value_and_grad``.
      encoder_view: ``"auto"``, ``"local"`` or ``"global"``: how the models see a
        chunk under ``jit`` over a sharded batch, as ``cached_value_and_grad``.
      keep: how many chunks (the batch's last) pass 1 keeps the activations of, so
        that pass 2 re-encodes only the others, as ``cached_value_and_grad``.

    Model inputs are passed as in the original: an array ``x`` as ``model(x)``, a list
    or tuple as ``model(*x)``, a dict as ``model(**x)``; every leaf is a batch.
    ``nnx.BatchNorm`` must run on its running statistics (pass
    ``nnx.view(model, use_running_average=True)``, which shares the model's
    variables); in training mode it raises, see ``gc_jax.nnx_encoder``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, gc_jax
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
      >>> gc = gc_jax.compat.GradCache([model, model], chunk_sizes=2,
      ...                       loss_fn=gc_jax.losses.contrastive_loss)
      >>> q, d = jnp.ones((6, 4)), jnp.arange(24.0).reshape(6, 4) / 24
      >>> loss, grads = gc(q, d, reduction="sum")
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> _ = optimizer.update(model, grads)
      >>> loss.shape, grads["kernel"].get_value().shape
      ((), (4, 3))

      The usual NNX training loop: an ``nnx.jit`` step taking the model and the
      optimizer; ``gc`` reads the model passed to the step.

      >>> @nnx.jit
      ... def train_step(model, optimizer, q, d):
      ...     loss, grads = gc(q, d)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> losses = [float(train_step(model, optimizer, q, d)) for _ in range(3)]
      >>> losses[0] > losses[1] > losses[2]
      True

      Inside ``jax.jit`` (or ``shard_map``, ``pmap``), pass the weights in:

      >>> step = jax.jit(lambda params, q, d: gc(q, d, params=params))
      >>> loss, grads = step(gc.params, q, d)
    """

    def __init__(
        self,
        models: nnx.Module | Sequence[nnx.Module],
        chunk_sizes: ChunkSize | Sequence[ChunkSize],
        loss_fn: Callable[..., Any],
        split_input_fn: Callable[[PyTree, int], list[PyTree]] | None = None,
        get_rep_fn: Callable[[Any], PyTree] | None = None,
        *,
        has_aux: bool = False,
        axis_name: AxisName | None = None,
        batch_axis: AxisName | None = None,
        cache_dtype: DTypeLike | None = None,
        encoder_view: EncoderView = "auto",
        keep: int | None = None,
    ):
        self.models = [models] if isinstance(models, nnx.Module) else list(models)
        if not self.models:
            raise ValueError("models is empty; expected an nnx.Module or a list of them.")
        for i, m in enumerate(self.models):
            if not isinstance(m, nnx.Module):
                raise TypeError(f"models[{i}] must be an nnx.Module, got {type(m).__name__}.")
        self.chunk_sizes = _validation.per_input(
            chunk_sizes, len(self.models), "chunk_sizes", _plan.check, what="models"
        )
        budgets = [i for i, c in enumerate(self.chunk_sizes) if _plan.by_tokens(c)]
        if split_input_fn is not None and budgets:
            raise ValueError(
                f"chunk_sizes[{budgets[0]}] is a {type(self.chunk_sizes[budgets[0]]).__name__}, "
                "which cuts chunks by tokens, but split_input_fn cuts them by rows; pass one "
                "or the other (drop split_input_fn: the budget already groups rows by length)."
            )
        self.loss_fn = _validation.callable_arg(loss_fn, "loss_fn")
        for name, fn in (("split_input_fn", split_input_fn), ("get_rep_fn", get_rep_fn)):
            if fn is not None:
                _validation.callable_arg(fn, name)
        self.split_input_fn, self.get_rep_fn = split_input_fn, get_rep_fn
        self.has_aux, self.axis_name, self.batch_axis = has_aux, axis_name, batch_axis
        self.cache_dtype = _validation.float_dtype(cache_dtype, "cache_dtype")
        self.encoder_view = _validation.encoder_view(encoder_view)
        self.keep = _plan.check_keep(keep, allow_none=True)
        self._unique = tuple({id(m): m for m in self.models}.values())
        self._slot = tuple(
            next(j for j, u in enumerate(self._unique) if u is m) for m in self.models
        )
        self._step = jax.jit(self._run, static_argnames=("graphdef", "static_kwargs", "joined"))

    def _encode(self, params, chunk, key, *, graphdef, rest, slot):
        models = nnx.merge(graphdef, _flax.fresh(_joint(params)), _flax.fresh(rest))
        name = f"models[{self._slot.index(slot)}]"
        return _flax.call_nnx(models[slot], "__call__", chunk, key, self.get_rep_fn, name)

    def _run(self, params, rest, inputs, rng, dyn_kwargs, *, graphdef, static_kwargs, joined):
        encoders = [
            functools.partial(self._encode, graphdef=graphdef, rest=rest, slot=s)
            for s in self._slot
        ]
        inputs = [
            jax.tree.map(lambda *xs: jnp.concatenate(xs), *x) if j else x
            for x, j in zip(inputs, joined, strict=True)
        ]
        loss = lambda _, *reps, **kw: self.loss_fn(*reps, **kw)
        f = _value_and_grad.cached_value_and_grad(
            loss,
            encoders,
            self.chunk_sizes,
            has_aux=self.has_aux,
            axis_name=self.axis_name,
            batch_axis=self.batch_axis,
            cache_dtype=self.cache_dtype,
            encoder_view=self.encoder_view,
            keep=self.keep,
        )
        return f(params, *inputs, rng=rng, **dyn_kwargs, **dict(static_kwargs))

    def _split(self, x: PyTree, i: int) -> tuple[PyTree, bool]:
        if self.split_input_fn is None:
            return x, False
        chunks = self.split_input_fn(x, self.chunk_sizes[i])
        if not isinstance(chunks, list | tuple) or not chunks:
            raise TypeError(
                f"split_input_fn returned {type(chunks).__name__} for model_inputs[{i}]; "
                "expected a non-empty list of chunks whose concatenation is the batch."
            )
        return list(chunks), True

    def _state(self) -> tuple[Any, tuple[nnx.State, ...], nnx.State]:
        """``(graphdef, per-model Params, rest)`` of the models, split jointly.

        Inside an NNX transform, each variable is replaced by its traced copy.
        """
        graphdef, params, rest = nnx.split(self._unique, nnx.Param, ...)
        contexts = _flax.update_contexts()
        if contexts:
            traced = lambda _, v: _flax.traced_copy(v, contexts)
            # If Flax internals changed, there is no mapping, and _check_not_constant
            # raises where one was needed.
            with contextlib.suppress(AttributeError, KeyError, TypeError):
                params, rest = nnx.map_state(traced, params), nnx.map_state(traced, rest)
        return graphdef, _per_model(params, len(self._unique)), rest

    def _check_not_constant(self, params: tuple[nnx.State, ...]) -> None:
        """Raises if traced with weights that would be compiled in as constants."""
        if not _under_trace():
            return
        constant = [
            (i, path)
            for i, p in enumerate(params)
            for path, v in nnx.to_flat_state(p)
            if not _is_traced(v.get_value())
        ]
        if not constant:
            return
        models = " and ".join(
            f"models[{j}]" for j in sorted({self._slot.index(i) for i, _ in constant})
        )
        where = ", ".join(
            f"models[{self._slot.index(i)}]." + ".".join(map(str, path)) for i, path in constant[:3]
        )
        raise ValueError(
            "GradCache is being traced (jax.jit, pmap, shard_map or a tree-mode "
            f"nnx.jit) but the weights of {models} ({where}, ...) are not traced: "
            "they would be compiled into the step as constants, and every later call "
            "would keep using them, ignoring optimizer updates. Either call gc inside "
            "`@nnx.jit def step(model, optimizer, ...)` with the models as arguments "
            "(graph mode, the default), or pass the weights as an argument of the "
            "transform: `jax.jit(lambda params, x, y: gc(x, y, params=params))(gc.params, "
            "x, y)`, or params=nnx.state(model, nnx.Param) of a model passed to the step."
        )

    def _check_params(self, params: Any, current: tuple[nnx.State, ...]) -> tuple:
        n = len(self._unique)
        params = (params,) if n == 1 else tuple(params)
        if len(params) != n:
            raise ValueError(
                f"params has {len(params)} entries for {n} distinct models; pass params "
                "structured like grads (e.g. self.params)."
            )
        for i, (given, want) in enumerate(zip(params, current, strict=True)):
            got, expected = _paths(given), _paths(want)
            if got != expected:
                name = "params" if n == 1 else f"params[{i}]"
                missing, extra = sorted(expected - got)[:3], sorted(got - expected)[:3]
                raise ValueError(
                    f"{name} does not match models[{self._slot.index(i)}]'s parameters "
                    f"(missing {missing}, unexpected {extra}). Pass params structured "
                    "like grads, e.g. gc.params: variables shared between models appear "
                    "only under the first model that holds them."
                )
        return params

    @property
    def params(self) -> nnx.State | tuple[nnx.State, ...]:
        """The models' current ``nnx.Param`` state, structured like ``grads``."""
        _, params, _ = nnx.split(self._unique, nnx.Param, ...)
        states = _per_model(params, len(self._unique))
        return states[0] if len(states) == 1 else states

    def cache_step(
        self,
        *model_inputs: PyTree,
        rng: jax.Array | None = None,
        params: nnx.State | Sequence[nnx.State] | None = None,
        **loss_kwargs: Any,
    ):
        """Runs one gradient-cached step.

        Args:
          *model_inputs: one batch per model, in the order of ``models``.
          rng: PRNG key for dropout. Chunk ``c`` of input ``i`` runs with every RNG
            stream of its model reseeded with ``fold_in(fold_in(rng, i), c)``, in both
            passes. With ``rng=None`` models run deterministically; one with
            dropout in training mode raises (see ``gc_jax.nnx_encoder``).
          params: weights to use instead of the models' current ones, structured
            like ``grads`` (e.g. ``self.params``). Needed inside ``jax.jit``,
            ``pmap``, ``shard_map`` or a tree-mode ``nnx.jit``, as an argument of
            that transform (without it the call raises there). Not needed inside a
            graph-mode ``nnx.jit`` (the default) that takes the models as
            arguments: the traced models are read.
          **loss_kwargs: passed to ``loss_fn``. Array-valued ones are traced; others
            (e.g. ``reduction="sum"``) must be hashable and are static.

        Returns:
          ``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``). ``grads`` is
          the ``nnx.State`` of ``nnx.Param`` for a single distinct model, else a tuple
          with one per distinct model, in order of first appearance in ``models``; a
          variable shared by several models is only in the first one's, with the
          gradient summed over all of them.

        Raises:
          ValueError: if traced (``jax.jit``, ...) without ``params=`` while the
            models' weights are not traced; if ``params`` is not structured like
            ``grads``; if the number of inputs is not the number of models.
        """
        if len(model_inputs) != len(self.models):
            _validation.key_as_input(model_inputs, "gc(queries, docs, rng=key)")
            raise ValueError(
                f"got {len(model_inputs)} model_inputs for {len(self.models)} models; "
                "pass exactly one input batch per model."
            )
        inputs, joined = zip(*(self._split(x, i) for i, x in enumerate(model_inputs)), strict=True)
        dyn, static = _partition(loss_kwargs)
        graphdef, current, rest = self._state()
        if params is None:
            self._check_not_constant(current)
            params = current
        else:
            params = self._check_params(params, current)
        out, grads = self._step(
            params, rest, inputs, rng, dyn,
            graphdef=graphdef, static_kwargs=static, joined=tuple(joined),
        )  # fmt: skip
        return out, grads[0] if len(grads) == 1 else grads

    __call__ = cache_step
