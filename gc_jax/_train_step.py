"""A complete, pure training step on top of :func:`gc_jax.cached_value_and_grad`.

``make_train_step`` adds what a training loop needs around the cached gradient:
the optimizer update (a Flax ``TrainState`` or a plain ``(params, opt_state)``
pair with an optax optimizer), skipping of non-finite steps, float16 loss scaling
(static or dynamic) and an opt-in check that raises on non-finite values.

Why the skip is a ``jnp.where`` and not ``optax.apply_if_finite``:
``apply_if_finite`` is an optimizer wrapper, so it only works if the user builds
their optimizer with it (and it changes the optimizer state's layout); it looks at
the gradients but not at the loss; and after ``max_consecutive_errors`` bad steps
it gives up and *applies* the non-finite update. Here the whole updated state is
selected against the old one on one ``is_finite`` flag (loss and every gradient),
which works for any optimizer and either state form and never lets a NaN through.
A select rather than ``lax.cond`` keeps it robust to state leaves whose types
change on the first update (e.g. ``TrainState.step`` starts as a Python int); the
optimizer update is elementwise and cheap next to the two encoder passes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state as flax_train_state
from jax.typing import DTypeLike

from gc_jax import _loss_scale, _optimizer_update, _validation
from gc_jax._base import AxisName, Encoder, EncoderView
from gc_jax._chunks.plan import ChunkSize
from gc_jax._loss_scale import DynamicLossScale
from gc_jax._value_and_grad import cached_value_and_grad

TrainState = flax_train_state.TrainState


def _state_error(expected: str, state: Any) -> TypeError:
    return TypeError(f"train_step expected state to be {expected}; got {type(state).__name__}.")


# --- the two forms of state --------------------------------------------------------------


def _unpack_train_state(state: Any, dynamic: bool) -> tuple[TrainState, Any]:
    """``(train_state, DynamicLossScale or None)`` for ``optimizer=None``."""
    scale = None
    if dynamic and isinstance(state, tuple):
        if len(state) != 2 or not isinstance(state[0], TrainState):
            raise _state_error("a pair (TrainState, DynamicLossScale)", state)
        state, scale = state
    elif dynamic and isinstance(state, TrainState):
        scale = getattr(state, "loss_scale", None)
    if not isinstance(state, TrainState):
        what = "a flax.training.train_state.TrainState (optimizer=None)"
        if isinstance(state, tuple):
            what += "; to train a (params, opt_state) tuple pass optimizer="
        raise _state_error(what, state)
    if dynamic and not isinstance(scale, DynamicLossScale):
        raise TypeError(
            "loss_scale='dynamic' needs the scale in the state: pass "
            "(train_state, gc_jax.DynamicLossScale.create()) or a TrainState "
            "subclass with a `loss_scale: DynamicLossScale` field."
        )
    return state, scale


def _unpack_pair(state: Any, dynamic: bool) -> tuple[tuple[Any, Any], Any]:
    """``((params, opt_state), DynamicLossScale or None)`` for a given ``optimizer``."""
    if isinstance(state, TrainState):
        raise TypeError(
            "train_step got a TrainState but optimizer= was given: a TrainState "
            "carries its own tx, so pass optimizer=None (or pass (params, opt_state))."
        )
    n = 3 if dynamic else 2
    if not isinstance(state, tuple | list) or len(state) != n:
        what = "(params, opt_state, DynamicLossScale)" if dynamic else "(params, opt_state)"
        raise _state_error(f"a tuple {what} (optimizer= was given)", state)
    if dynamic and not isinstance(state[2], DynamicLossScale):
        raise TypeError(
            "with loss_scale='dynamic' the third element of the state must be a "
            f"gc_jax.DynamicLossScale, got {type(state[2]).__name__}."
        )
    return tuple(state[:2]), state[2] if dynamic else None


def _repack(state: Any, new: Any, new_scale: DynamicLossScale | None, pair: bool) -> Any:
    """The state to return, in the form ``state`` came in."""
    if new_scale is None:
        return new
    if pair:
        return (*new, new_scale)
    if isinstance(state, tuple):
        return (new, new_scale)
    return new.replace(loss_scale=new_scale)


def _metrics(loss, aux, grads, finite, has_aux, scale) -> dict[str, Any]:
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "is_finite": finite}
    if has_aux:
        metrics["aux"] = aux
    if scale is not None:
        metrics["loss_scale"] = jnp.asarray(scale, jnp.float32)
    return metrics


def _warn_if_skipped(finite, loss, grads, dynamic_scale, checked: bool) -> None:
    """A ``RuntimeWarning`` from the host when the step is skipped, naming what was not
    finite; nothing runs on a finite step (a ``lax.cond``). With a dynamic loss scale an
    overflow is expected and backed off from: it warns once the scale is at its minimum
    (1), or when the loss itself is not finite (as ``check_finite``). ``checked``: the
    ``check_finite`` check raises for a non-finite loss or gradient, so only a skip it
    does not raise for (an update not finite) warns."""
    report = ~finite
    if dynamic_scale is not None:
        report = report & ((dynamic_scale <= _loss_scale.MIN_LOSS_SCALE) | ~jnp.isfinite(loss))
    leaves = _loss_scale.grad_leaves(grads)
    names, sizes = [n for n, _ in leaves], [g.size for _, g in leaves]
    counts = [jnp.sum(~jnp.isfinite(g)) for _, g in leaves]
    if checked:
        report = report & jnp.isfinite(loss) & (sum(counts) == 0)

    def warn(loss, *counts):
        named = list(zip(names, (int(c) for c in counts), sizes, strict=True))
        if np.all(np.isfinite(loss)) and not any(c for _, c, _ in named):
            what = (
                "gc_jax train step: the loss and gradients are finite, but the optimizer's "
                "update (evaluated at other parameters: value_fn, obj_fn, grad_fn) is not."
            )
        else:
            what = _loss_scale.nonfinite_message(loss, True, named)
        warnings.warn(what + _SKIPPED, RuntimeWarning, stacklevel=2)

    jax.lax.cond(report, lambda: jax.debug.callback(warn, loss, *counts), lambda: None)


_SKIPPED = (
    " make_train_step skipped this step (skip_nonfinite=True): params, optimizer state and "
    "step are unchanged and metrics['is_finite'] is False. Common causes: a learning rate "
    "too high; float16 overflow (use loss_scale='dynamic'); a row without tokens "
    "normalised as x / ||x|| (its gradient is NaN; gc_jax.pooling.l2_normalize clamps the "
    "norm). check_finite=True raises instead; warn_skipped=False silences this warning."
)


def _check_settings(loss_scale, skip_nonfinite, growth_interval, check_finite):
    """Validated ``(loss_scale, growth_interval, check mode or False)``."""
    loss_scale = _loss_scale.check_loss_scale(loss_scale, allow_dynamic=True)
    if loss_scale is not None and loss_scale != "dynamic":
        loss_scale = float(loss_scale)
    if loss_scale == "dynamic" and not skip_nonfinite:
        raise ValueError(
            "loss_scale='dynamic' needs skip_nonfinite=True: an overflowing step must be "
            "skipped (and the scale backed off), not applied."
        )
    growth_interval = _validation.positive_int(growth_interval, "growth_interval")
    if not (isinstance(check_finite, bool) or check_finite in ("debug", "checkify")):
        raise ValueError(
            f"check_finite must be False, True, 'debug' or 'checkify', got {check_finite!r}."
        )
    return loss_scale, growth_interval, "debug" if check_finite is True else check_finite


def make_train_step(
    loss_fn: Callable[..., Any],
    encoders: Encoder | Sequence[Encoder],
    chunk_size: ChunkSize | Sequence[ChunkSize],
    *,
    optimizer: optax.GradientTransformation | optax.MultiSteps | None = None,
    has_aux: bool = False,
    axis_name: AxisName | None = None,
    batch_axis: AxisName | None = None,
    skip_nonfinite: bool = True,
    loss_scale: float | str | None = None,
    growth_interval: int = 2000,
    check_finite: bool | str = False,
    cache_dtype: DTypeLike | None = None,
    encoder_view: EncoderView = "auto",
    keep: int | None = None,
    warn_skipped: bool = True,
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """A pure training step with cached (chunked) gradients.

    The gradient is ``gc_jax.cached_value_and_grad(loss_fn, encoders, chunk_size)``
    (see there for ``loss_fn``, ``encoders``, ``chunk_size``, ``has_aux``,
    ``axis_name``, ``batch_axis``, ``cache_dtype``, ``encoder_view`` and ``keep``);
    this adds the optimizer update and the bookkeeping around it.

    The optimizer's ``update`` gets the keywords its signature takes (all of them
    when it takes ``**kwargs``, as ``optax.chain`` and ``optax.MultiSteps`` do), all
    computed from the gradient-cached loss on the same batch, keys and loss kwargs:
    ``value=`` (the loss), ``grad=`` (the gradients), ``value_fn=`` and ``obj_fn=``
    (the loss at other parameters, differentiable with the cached gradient, twice
    too), and ``grad_fn=`` (``grad_fn(params, i)``: the gradient at other parameters;
    ``i`` is ignored). So ``optax.contrib.reduce_on_plateau``, ``optax.polyak_sgd``,
    ``optax.lbfgs`` (its line search), ``optax.contrib.sophia`` (Hutchinson's
    Hessian-vector products) and ``optax.contrib.sam`` (``opaque_mode=True``: the
    adversarial gradient; the default transparent mode needs nothing) train exactly
    as with full-batch ``jax.value_and_grad``; others ignore them. Where a member of
    a chain rejects a keyword (``optax.contrib.sam`` takes only ``grad_fn=``), it is
    left out, as a full-batch loop would not pass it.

    Args:
      loss_fn: ``loss_fn(params, *reps, **loss_kwargs)``, a scalar (or
        ``(loss, aux)`` with ``has_aux``).
      encoders: ``encode(params, chunk, key) -> reps``, one for all inputs or one
        per input.
      chunk_size: rows encoded at once, for all inputs or one per input; or a
        :class:`gc_jax.TokenBudget` or :class:`gc_jax.TokenPacking` (tokens).
      optimizer: None to train a ``flax.training.train_state.TrainState`` (its
        ``tx`` is used); or an optax ``GradientTransformation``, an
        ``optax.MultiSteps`` (gradient accumulation over ``k`` steps) or its
        ``.gradient_transformation()``, to train a plain ``(params, opt_state)``
        tuple.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` is returned in
        ``metrics["aux"]``.
      axis_name: the data-parallel axis under ``pmap``/``shard_map``, or None. The
        gradients are summed over it, so every device applies the same update.
      batch_axis: under plain ``jit`` with *auto* mesh axes, the mesh axes the batch
        is sharded over (call the step under ``jax.set_mesh(mesh)``), so every
        device encodes its own rows of every chunk. Not needed under explicit axes.
      skip_nonfinite: if the loss or any gradient is not finite, return the state
        unchanged (params, optimizer state and ``TrainState.step``) instead of
        applying the update; when the optimizer evaluated the loss at other
        parameters (``value_fn``, ``obj_fn``, ``grad_fn``), also if an updated
        parameter is not finite. ``metrics["is_finite"]`` says which happened, and
        a skipped step warns (``warn_skipped``).
      loss_scale: None; a positive number, a static loss scale; or ``"dynamic"``,
        dynamic loss scaling (for float16 encoders): the state then carries a
        :class:`DynamicLossScale` (see Returns), halved on every non-finite step
        and doubled after ``growth_interval`` finite ones. The gradients the
        optimizer sees are always unscaled. Requires ``skip_nonfinite``.
      growth_interval: finite steps before a dynamic loss scale is doubled.
      check_finite: opt-in check that raises when the loss or a gradient is not
        finite, naming which: ``True`` (or ``"debug"``) raises a
        ``FloatingPointError`` from a ``jax.debug.callback`` (under ``jit`` it
        reaches you wrapped in a ``JaxRuntimeError`` with the same message);
        ``"checkify"`` adds a ``jax.experimental.checkify`` check instead, so the
        step must be wrapped in ``checkify.checkify`` (then ``err.throw()``). With
        dynamic loss scaling, overflowing gradients are expected and handled by
        backing off, so they raise only once the scale is down to its minimum (1);
        a non-finite loss always raises.
      cache_dtype: dtype of the cached (float) representations (default: the
        encoder's own output dtype; see ``cached_value_and_grad``).
      warn_skipped: a skipped step is never silent: by default it issues a
        ``RuntimeWarning`` from the host (a ``jax.debug.callback`` run only on a
        skipped step, under ``jit``, ``pmap`` and ``shard_map`` alike) naming the loss
        and the gradients that were not finite. Python shows a repeated warning once
        per message (``warnings`` filters); with ``loss_scale="dynamic"`` an overflow
        backed off from warns only at the minimum scale or for a non-finite loss.
        ``False`` silences it (``metrics["is_finite"]`` still says so);
        ``check_finite`` raises instead.

    Returns:
      ``train_step(state, *inputs, rng=None, **loss_kwargs) -> (state, metrics)``,
      pure and jittable (``jax.jit(train_step, donate_argnums=0)``). ``state`` is:

      - ``optimizer=None``: a ``TrainState``; with ``loss_scale="dynamic"``, a
        pair ``(train_state, DynamicLossScale)``, or a ``TrainState`` subclass with
        a ``loss_scale: DynamicLossScale`` field;
      - ``optimizer`` given: ``(params, opt_state)``; with ``loss_scale="dynamic"``,
        ``(params, opt_state, DynamicLossScale)``.

      ``rng`` feeds the encoders' dropout (chunk ``c`` of input ``i`` gets
      ``fold_in(fold_in(rng, i), c)``). ``metrics`` holds ``"loss"``,
      ``"grad_norm"`` (the global L2 norm of the unscaled gradients, ``optax.tree.norm``),
      ``"is_finite"``, ``"aux"`` with ``has_aux`` and ``"loss_scale"`` (the scale
      this step used) when ``loss_scale`` is set.

    Raises:
      TypeError: if ``optimizer`` is not an optax optimizer, or (when tracing the
        step) ``state`` does not have the form above.
      ValueError: for a bad ``loss_scale``, ``growth_interval`` or ``check_finite``.

    Examples:
      Two steps of a ``TrainState`` with a chunk size of 2 rows:

      >>> import jax, jax.numpy as jnp, optax, gc_jax
      >>> from flax.training.train_state import TrainState
      >>> encode = lambda p, x, key: jnp.tanh(x @ p["w"])
      >>> loss = lambda p, q, d: gc_jax.losses.contrastive_loss(q, d)
      >>> params = {"w": jnp.eye(4)}
      >>> state = TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
      >>> step = jax.jit(gc_jax.make_train_step(loss, encode, chunk_size=2))
      >>> q, d = jnp.eye(8, 4), jnp.eye(8, 4)[::-1]
      >>> for _ in range(2):
      ...     state, metrics = step(state, q, d)
      >>> int(state.step), bool(metrics["is_finite"]), sorted(metrics)
      (2, True, ['grad_norm', 'is_finite', 'loss'])

      A plain ``(params, opt_state)`` pair, with dynamic loss scaling:

      >>> opt = optax.adamw(1e-3)
      >>> state = (params, opt.init(params), gc_jax.DynamicLossScale.create())
      >>> step = gc_jax.make_train_step(loss, encode, 2, optimizer=opt, loss_scale="dynamic")
      >>> (params, opt_state, scale), metrics = jax.jit(step)(state, q, d)
      >>> float(metrics["loss_scale"]), int(scale.good_steps)
      (32768.0, 1)

      Gradient accumulation over 2 steps, and an optimizer that needs the loss:

      >>> opt = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
      >>> step = jax.jit(gc_jax.make_train_step(loss, encode, 2, optimizer=opt))
      >>> state = (params, opt.init(params))
      >>> state, _ = step(state, q, d)
      >>> bool(jnp.all(state[0]["w"] == params["w"]))  # accumulated, not applied yet
      True
      >>> opt = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1))
      >>> step = jax.jit(gc_jax.make_train_step(loss, encode, 2, optimizer=opt))
      >>> state, metrics = step((params, opt.init(params)), q, d)  # gets value=loss

      Sharpness-aware minimisation, its adversarial gradient gradient-cached too:

      >>> adv = optax.chain(optax.contrib.normalize(), optax.sgd(0.05))
      >>> opt = optax.contrib.sam(optax.sgd(0.1), adv, opaque_mode=True)
      >>> step = jax.jit(gc_jax.make_train_step(loss, encode, 2, optimizer=opt))
      >>> state, metrics = step((params, opt.init(params)), q, d)  # gets grad_fn=
      >>> bool(metrics["is_finite"])
      True
    """
    tx = _optimizer_update.check_optimizer(optimizer)
    loss_scale, growth_interval, check_mode = _check_settings(
        loss_scale, skip_nonfinite, growth_interval, check_finite
    )
    dynamic = loss_scale == "dynamic"
    grad_fn = cached_value_and_grad(
        loss_fn,
        encoders,
        chunk_size,
        has_aux=has_aux,
        axis_name=axis_name,
        batch_axis=batch_axis,
        cache_dtype=cache_dtype,
        encoder_view=encoder_view,
        keep=keep,
    )

    def train_step(state, *inputs, rng=None, **loss_kwargs):
        if tx is None:
            trained, scale_state = _unpack_train_state(state, dynamic)
            params = trained.params
        else:
            trained, scale_state = _unpack_pair(state, dynamic)
            params = trained[0]
        _validation.key_as_input(inputs, "train_step(state, queries, docs, rng=key)")
        _validation.rng_key(rng)
        scale = scale_state.scale if dynamic else loss_scale
        out, grads = grad_fn(params, *inputs, rng=rng, loss_scale=scale, **loss_kwargs)
        loss, aux = out if has_aux else (out, None)
        finite = _loss_scale.all_finite(loss, grads)
        if check_mode:
            dynamic_scale = scale_state.scale if dynamic else None
            _loss_scale.check_finite(check_mode, loss, grads, dynamic_scale)

        def value_and_grads(at):  # the same step at other params, for the optimizer
            out, grads = grad_fn(at, *inputs, rng=rng, loss_scale=scale, **loss_kwargs)
            return (out[0] if has_aux else out), grads

        new, still_finite = _optimizer_update.apply(tx, trained, loss, grads, value_and_grads)
        finite = finite & still_finite
        if skip_nonfinite:
            new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, trained)
            if warn_skipped:
                dynamic_scale = scale_state.scale if dynamic else None
                _warn_if_skipped(finite, loss, grads, dynamic_scale, bool(check_mode))

        new_scale = None
        if dynamic:
            new_scale = scale_state.update(finite, growth_interval=growth_interval)
        metrics = _metrics(loss, aux, grads, finite, has_aux, scale)
        return _repack(state, new, new_scale, pair=tx is not None), metrics

    return train_step
