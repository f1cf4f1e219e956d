"""``GradCache``: the PyTorch GradCache class API for Flax NNX modules.

A thin, jitted wrapper over :func:`gc_jax.cached_value_and_grad` and
:func:`gc_jax.nnx_encoder`: no second implementation of the algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gc_jax import _cache, _flax, _validation

PyTree = Any


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


class GradCache:
    """Gradient-cached steps for NNX encoders, ported from the PyTorch ``GradCache`` class.

    ``cache_step`` (or calling the object) returns ``(loss, grads)`` equal to the
    full-batch ``jax.value_and_grad`` while holding one chunk's activations at a time.
    The step is jitted once per input shape and cached. The models are read with
    ``nnx.split`` at every step but never modified (nor is their non-``Param`` state,
    e.g. RNG counters or batch statistics): apply ``grads`` with ``nnx.Optimizer``.

    Differences from the PyTorch class: gradients are returned, not accumulated on
    the weights; there is no ``fp16``/``scaler`` (mixed precision is the encoder's
    dtype business, see ``cached_value_and_grad(loss_scale=...)``); and there is no
    ``no_sync_except_last``: under ``axis_name`` gradients are all-reduced exactly
    once per step by construction, never once per chunk.

    Args:
      models: one ``nnx.Module`` or a sequence of them, one per model input. The same
        object may appear more than once (tied weights): it then gets one gradient,
        the sum over its uses, like the hooks of the original.
      chunk_sizes: rows encoded at once, one int for all models or one per model.
      loss_fn: ``loss_fn(*reps, **loss_kwargs)``, the scalar loss of the whole
        batch's representations, one per model (``(loss, aux)`` with ``has_aux``).
        Under ``axis_name`` it must return the global loss with the gradient of
        this device's share, as ``gc_jax.losses(..., axis_name=...)`` and losses
        decorated with ``gc_jax.functional.gather_inputs`` do.
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

    Model inputs are passed as in the original: an array ``x`` as ``model(x)``, a list
    or tuple as ``model(*x)``, a dict as ``model(**x)``; every leaf is a batch.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, gc_jax
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
      >>> gc = gc_jax.GradCache([model, model], chunk_sizes=2,
      ...                       loss_fn=gc_jax.losses.contrastive_loss)
      >>> q, d = jnp.ones((6, 4)), jnp.arange(24.0).reshape(6, 4) / 24
      >>> loss, grads = gc(q, d, reduction="sum")
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> _ = optimizer.update(model, grads)
      >>> loss.shape, grads["kernel"].get_value().shape
      ((), (4, 3))
    """

    def __init__(
        self,
        models: nnx.Module | Sequence[nnx.Module],
        chunk_sizes: int | Sequence[int],
        loss_fn: Callable[..., Any],
        split_input_fn: Callable[[PyTree, int], list[PyTree]] | None = None,
        get_rep_fn: Callable[[Any], PyTree] | None = None,
        *,
        has_aux: bool = False,
        axis_name: Any = None,
    ):
        self.models = [models] if isinstance(models, nnx.Module) else list(models)
        if not self.models:
            raise ValueError("models is empty; expected an nnx.Module or a list of them.")
        for i, m in enumerate(self.models):
            if not isinstance(m, nnx.Module):
                raise TypeError(f"models[{i}] must be an nnx.Module, got {type(m).__name__}.")
        n = len(self.models)
        if isinstance(chunk_sizes, Sequence) and not isinstance(chunk_sizes, str):
            if len(chunk_sizes) != n:
                raise ValueError(
                    f"chunk_sizes has {len(chunk_sizes)} entries for {n} models; "
                    "pass one int for all models or exactly one per model."
                )
            names = [f"chunk_sizes[{i}]" for i in range(n)]
        else:
            chunk_sizes, names = [chunk_sizes] * n, ["chunk_sizes"] * n
        self.chunk_sizes = tuple(map(_validation.positive_int, chunk_sizes, names))
        self.loss_fn = _validation.callable_arg(loss_fn, "loss_fn")
        for name, fn in (("split_input_fn", split_input_fn), ("get_rep_fn", get_rep_fn)):
            if fn is not None:
                _validation.callable_arg(fn, name)
        self.split_input_fn, self.get_rep_fn = split_input_fn, get_rep_fn
        self.has_aux, self.axis_name = has_aux, axis_name
        self._unique = list({id(m): m for m in self.models}.values())
        self._slot = tuple(
            next(j for j, u in enumerate(self._unique) if u is m) for m in self.models
        )
        self._step = jax.jit(self._run, static_argnames=("graphdefs", "static_kwargs", "joined"))

    def _run(self, params, rests, inputs, rng, dyn_kwargs, *, graphdefs, static_kwargs, joined):
        encoders = [
            _flax.nnx_encoder(nnx.merge(*state), get_rep=self.get_rep_fn)
            for state in zip(graphdefs, params, rests, strict=True)
        ]
        encs = [lambda ps, x, k, e=encoders[s], s=s: e(ps[s], x, k) for s in self._slot]
        inputs = [
            jax.tree.map(lambda *xs: jnp.concatenate(xs), *x) if j else x
            for x, j in zip(inputs, joined, strict=True)
        ]
        loss = lambda _, *reps, **kw: self.loss_fn(*reps, **kw)
        f = _cache.cached_value_and_grad(
            loss, encs, self.chunk_sizes, has_aux=self.has_aux, axis_name=self.axis_name
        )
        return f(tuple(params), *inputs, rng=rng, **dyn_kwargs, **dict(static_kwargs))

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

    @property
    def params(self) -> nnx.State | tuple[nnx.State, ...]:
        """The models' current ``nnx.Param`` state, structured like ``grads``."""
        states = tuple(nnx.state(m, nnx.Param) for m in self._unique)
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
            passes; with ``rng=None`` models run deterministically.
          params: weights to use instead of the models' current ones, structured
            like ``grads`` (e.g. ``self.params``). Inside an outer ``jax.jit``,
            ``pmap`` or ``shard_map``, pass them as an argument of that transform:
            weights read from the models there are baked in as constants, and a
            cached compilation would keep using them after an optimizer update.
          **loss_kwargs: passed to ``loss_fn``. Array-valued ones are traced; others
            (e.g. ``reduction="sum"``) must be hashable and are static.

        Returns:
          ``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``). ``grads`` is
          the ``nnx.State`` of ``nnx.Param`` for a single distinct model, else a tuple
          with one per distinct model, in order of first appearance in ``models``.
        """
        if len(model_inputs) != len(self.models):
            raise ValueError(
                f"got {len(model_inputs)} model_inputs for {len(self.models)} models; "
                "pass exactly one input batch per model."
            )
        inputs, joined = zip(*(self._split(x, i) for i, x in enumerate(model_inputs)), strict=True)
        dyn, static = _partition(loss_kwargs)
        split = [nnx.split(m, nnx.Param, ...) for m in self._unique]
        graphdefs, current, rests = zip(*split, strict=True)
        if params is not None:
            params = (params,) if len(self._unique) == 1 else tuple(params)
            if len(params) != len(self._unique):
                raise ValueError(
                    f"params has {len(params)} entries for {len(self._unique)} distinct "
                    "models; pass params structured like grads (e.g. self.params)."
                )
        out, grads = self._step(
            current if params is None else params, rests, inputs, rng, dyn,
            graphdefs=graphdefs, static_kwargs=static, joined=tuple(joined),
        )  # fmt: skip
        return out, grads[0] if len(grads) == 1 else grads

    __call__ = cache_step
