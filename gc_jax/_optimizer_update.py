"""One optimizer update inside ``make_train_step``: optax or a Flax ``TrainState``.

``make_train_step`` updates either a plain ``(params, opt_state)`` pair with an optax
optimizer or a ``TrainState`` with its own ``tx``. optax's ``update`` may take more than
the gradients: ``value``, ``grad``, ``value_fn`` (line searches), ``obj_fn`` and
``grad_fn`` (SAM, Sophia). :func:`apply` offers each update only the keywords its
signature takes, and the optimizer's own evaluations of the loss run the cached
gradient again at other parameters.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state as flax_train_state

from gc_jax import _loss_scale

TrainState = flax_train_state.TrainState


def check_optimizer(optimizer: Any) -> Any:
    """``optimizer`` as something with ``init``/``update`` (None: a TrainState's tx)."""
    if optimizer is None or isinstance(optimizer, optax.GradientTransformation | optax.MultiSteps):
        return optimizer
    raise TypeError(
        "optimizer must be an optax.GradientTransformation (e.g. optax.adamw(1e-3)), an "
        "optax.MultiSteps, or None to train a flax TrainState; got "
        f"{type(optimizer).__name__}: {optimizer!r}."
    )


def _extras(value_and_grads, loss, grads) -> dict[str, Any]:
    """Every keyword an optax ``update`` may ask for, from the gradient-cached loss.

    ``value_and_grads(params) -> (loss, grads)`` is the cached step at other
    parameters (same batch, keys and loss kwargs). ``value_fn`` and ``obj_fn`` (the
    loss at given params) differentiate with the cached gradient, twice too (their
    Hessian-vector products, ``jax.jvp(jax.grad(obj_fn), ...)``, are exact: the
    cached gradient is differentiable); ``grad_fn(params, i)`` is the gradient at
    ``params`` (``i``, SAM's adversarial step, is ignored: the batch is the same).
    """

    @jax.custom_jvp
    def value_fn(params):
        return value_and_grads(params)[0]

    @value_fn.defjvp
    def value_fn_jvp(primals, tangents):
        value, grads = value_and_grads(primals[0])
        pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(tangents[0]), strict=True)
        slope = sum((jnp.vdot(g, t.astype(g.dtype)) for g, t in pairs), jnp.zeros_like(value))
        return value, slope

    def grad_fn(params, i=None):
        del i
        return value_and_grads(params)[1]

    return {"value": loss, "grad": grads, "value_fn": value_fn, "obj_fn": value_fn,
            "grad_fn": grad_fn}  # fmt: skip


def _offered(update: Callable, extra: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``extra`` that ``update``'s signature takes (all, with ``**kwargs``)."""
    try:
        parameters = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):  # no signature to read: offer all, rejections are dropped
        return dict(extra)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(extra)
    named = {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return {k: v for k, v in extra.items() if k in named}


def _rejected(error: TypeError, offered: dict[str, Any]) -> tuple[str, list[str]] | None:
    """``(where, keywords)`` when ``error`` says an update does not take offered keywords.

    Python says ``f() got an unexpected keyword argument 'k'``; optax's line searches
    say ``Unexpected keyword arguments passed to `...`: ['k', ...]``.
    """
    message = str(error)
    names = [k for k in offered if f"'{k}'" in message]
    if "unexpected keyword argument" not in message.lower() or not names:
        return None
    where = re.search(r"\S+\(\)|`[^`]+`", message)
    return (where.group(0).strip("`") if where else "a part of it"), names


def _left_out(error: Exception, tx: Any, dropped: list[tuple[str, list[str]]]) -> Exception:
    """``error``, raised after keywords were left out, with what was left out and why."""
    by_where: dict[str, list[str]] = {}
    for where, names in dropped:
        by_where.setdefault(where, []).extend(f"{name}=" for name in names)
    said = "; ".join(f"{where} takes no {', '.join(names)}" for where, names in by_where.items())
    message = (
        f"{error}\nmake_train_step(optimizer={type(tx).__name__}(...)) left keywords out "
        f"of its update because a part of it rejected them ({said}); optax.chain and "
        "optax.MultiSteps hand every keyword to each member that takes extra arguments, so "
        "that member keeps them from one that needs them. Wrap the rejecting member so it "
        "drops what it does not take, e.g. for optax.contrib.sam: "
        "optax.GradientTransformationExtraArgs(sam.init, lambda u, s, p=None, *, "
        "grad_fn=None, **_: sam.update(u, s, p, grad_fn=grad_fn))."
    )
    if type(error) in (TypeError, ValueError):
        return type(error)(message)
    error.add_note(message)
    return error


def _optax_update(tx, grads, opt_state, params, extra: dict[str, Any]):
    """``tx.update``, with the keywords of ``extra`` its signature (and its parts) take.

    A keyword an update rejects (``unexpected keyword argument``: a member of an
    ``optax.chain`` that takes fewer) is left out and the update traced again, as a
    full-batch loop would simply not pass it; an error after that says what was left out.
    """
    offered, dropped = _offered(tx.update, extra), []
    while True:
        try:
            return tx.update(grads, opt_state, params, **offered)
        except Exception as e:
            rejected = _rejected(e, offered) if isinstance(e, TypeError) else None
            if rejected is None:
                if not dropped:
                    raise
                raise _left_out(e, tx, dropped) from e
            dropped.append(rejected)
            offered = {k: v for k, v in offered.items() if k not in rejected[1]}


def _apply_pair(tx, trained, grads, extra):
    params, opt_state = trained
    updates, opt_state = _optax_update(tx, grads, opt_state, params, extra)
    return optax.apply_updates(params, updates), opt_state


def _restricted(extra: dict[str, Any], whole: dict[str, Any]) -> dict[str, Any]:
    """``extra`` for the ``"params"`` entry of ``whole`` (the rest held fixed)."""
    at = lambda p: {**whole, "params": p}
    value_fn = lambda p: extra["value_fn"](at(p))
    return dict(
        extra,
        grad=extra["grad"]["params"],
        value_fn=value_fn,
        obj_fn=value_fn,
        grad_fn=lambda p, i=None: extra["grad_fn"](at(p), i)["params"],
    )


def _apply_train_state(state: TrainState, grads, extra) -> TrainState:
    """``state.apply_gradients(grads=grads)``, passing ``extra`` as for a pair."""
    if not _offered(state.tx.update, extra):
        return state.apply_gradients(grads=grads)
    owg = flax_train_state.OVERWRITE_WITH_GRADIENT
    if owg not in grads:
        params, opt_state = _apply_pair(state.tx, (state.params, state.opt_state), grads, extra)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    whole = state.params
    params, opt_state = _apply_pair(
        state.tx, (whole["params"], state.opt_state), grads["params"], _restricted(extra, whole)
    )
    return state.replace(
        step=state.step + 1,
        params={**whole, "params": params, owg: grads[owg]},
        opt_state=opt_state,
    )


def apply(tx, trained, loss, grads, value_and_grads) -> tuple[Any, Any]:
    """The updated ``trained`` state, and whether the optimizer's own evaluations were finite.

    When the optimizer evaluated the loss or gradient at other params (SAM's
    adversarial gradient, a line search, a Hessian-vector product), their
    overflow shows only in the update: then the updated params must be finite too.
    """
    evaluated = []

    def counted(params):
        evaluated.append(True)
        return value_and_grads(params)

    extra = _extras(counted, loss, grads)
    if tx is None:
        new = _apply_train_state(trained, grads, extra)
    else:
        new = _apply_pair(tx, trained, grads, extra)
    if not evaluated:
        return new, True
    return new, _loss_scale.all_finite(loss, new.params if tx is None else new[0])
