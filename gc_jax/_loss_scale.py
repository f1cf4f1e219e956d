"""Loss scaling and finite checks: the scale's state, its validation and the NaN report.

:class:`DynamicLossScale` is the state of dynamic loss scaling (``make_train_step``
carries it); :func:`check_loss_scale` validates a scale where it is given;
:func:`unscale` divides the gradients by it, and makes a traced scale that is not
finite and positive impossible to miss; :func:`all_finite` and :func:`check_finite`
are the train step's skip test and its opt-in report.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from gc_jax._base import PyTree
from gc_jax._passes import is_inexact

# The floor of a dynamic loss scale. Non-finite gradients at this scale are not an
# overflow that backing off could fix, so the opt-in finite check reports them.
MIN_LOSS_SCALE = 1.0


class DynamicLossScale(NamedTuple):
    """State of dynamic loss scaling: the current scale and the finite-step streak.

    The policy is the usual one (PyTorch's ``GradScaler``, Flax's ``DynamicScale``):
    a step whose loss or gradients are not finite is skipped and the scale is
    multiplied by ``backoff_factor`` (halved, but not below ``min_scale``); after
    ``growth_interval`` finite steps in a row it is multiplied by ``growth_factor``
    (doubled). Only the scale and the streak are state (a pytree of two scalars);
    the policy's constants are arguments of :meth:`update`.

    Attributes:
      scale: float32 scalar multiplying the loss gradient before the backward pass.
      good_steps: int32 scalar, finite steps since the scale last changed.

    Examples:
      >>> from gc_jax import DynamicLossScale
      >>> s = DynamicLossScale.create(1024.0)
      >>> float(s.update(False).scale), float(s.update(True, growth_interval=1).scale)
      (512.0, 2048.0)
    """

    scale: jax.Array
    good_steps: jax.Array

    @classmethod
    def create(cls, scale: float = 2.0**15) -> DynamicLossScale:
        """The initial state: ``scale`` (default ``2**15``) and no finite steps yet."""
        check_loss_scale(scale)
        return cls(jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32))

    def update(
        self,
        finite: jax.Array | bool,
        *,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = MIN_LOSS_SCALE,
    ) -> DynamicLossScale:
        """The state after a step whose loss and gradients were ``finite`` (or not)."""
        scale = jnp.asarray(self.scale, jnp.float32)
        good = jnp.where(finite, jnp.asarray(self.good_steps, jnp.int32) + 1, 0)
        grow = good >= growth_interval
        grown = jnp.minimum(scale * growth_factor, jnp.finfo(jnp.float32).max)
        backed_off = jnp.maximum(scale * backoff_factor, min_scale)
        new_scale = jnp.where(finite, jnp.where(grow, grown, scale), backed_off)
        return DynamicLossScale(
            new_scale.astype(jnp.float32), jnp.where(grow, 0, good).astype(jnp.int32)
        )


def all_finite(loss: jax.Array, grads: PyTree) -> jax.Array:
    """True iff ``loss`` and every floating-point leaf of ``grads`` are finite."""
    finite = jnp.all(jnp.isfinite(loss))
    for g in jax.tree.leaves(grads):
        if is_inexact(g):
            finite = finite & jnp.all(jnp.isfinite(g))
    return finite


def grad_leaves(grads: PyTree) -> list[tuple[str, jax.Array]]:
    return [
        (f"grads{jax.tree_util.keystr(path)}", g)
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
        if is_inexact(g)
    ]


def nonfinite_message(loss: Any, grads_checked: Any, named_counts: list) -> str:
    """The message of the finite check, from concrete values (host side)."""
    bad = [(n, c, size) for n, c, size in named_counts if c] if bool(grads_checked) else []
    listing = ", ".join(f"{n} ({c} of {size} entries)" for n, c, size in bad)
    if np.all(np.isfinite(loss)):
        what = f"the loss is finite ({loss}) but gradients are not: {listing}"
    elif bad:
        what = f"the loss is {loss}, and gradients are not finite: {listing}"
    else:
        what = f"the loss is {loss} (the gradients are finite)"
    return f"gc_jax train step produced non-finite values: {what}."


def check_finite(mode: str, loss: jax.Array, grads: PyTree, dynamic_scale: Any = None) -> None:
    """Emits the opt-in finite check (``mode`` is ``"debug"`` or ``"checkify"``).

    With a dynamic scale, overflowing gradients are expected and backed off from:
    they are reported only once ``dynamic_scale`` is down to ``MIN_LOSS_SCALE``.
    """
    grads_checked = jnp.array(True) if dynamic_scale is None else dynamic_scale <= MIN_LOSS_SCALE
    leaves = grad_leaves(grads)
    counts = [jnp.sum(~jnp.isfinite(g)) for _, g in leaves]
    if mode == "checkify":
        listing = ", ".join(n.replace("{", "{{").replace("}", "}}") + ": {}" for n, _ in leaves)
        ok = jnp.all(jnp.isfinite(loss)) & ~(grads_checked & (sum(counts, 0) > 0))
        checkify.check(
            ok,
            "gc_jax train step produced non-finite values: loss = {}; gradients checked: {}; "
            "non-finite entries per gradient: " + listing,
            loss,
            grads_checked,
            *counts,
        )
        return
    names = [n for n, _ in leaves]
    sizes = [g.size for _, g in leaves]

    def raise_if_bad(loss, grads_checked, *counts):
        named = list(zip(names, (int(c) for c in counts), sizes, strict=True))
        loss_bad = not np.all(np.isfinite(loss))
        if loss_bad or (bool(grads_checked) and any(c for _, c, _ in named)):
            raise FloatingPointError(nonfinite_message(loss, grads_checked, named))

    jax.debug.callback(raise_if_bad, loss, grads_checked, *counts)


def check_loss_scale(loss_scale: Any, *, allow_dynamic: bool = False) -> Any:
    """``loss_scale`` if it is None, a finite positive scalar, a traced scalar or
    (``allow_dynamic``) ``"dynamic"``; otherwise raises naming ``loss_scale``.

    A traced scale cannot be checked here: :func:`unscale` guards it in the result.
    """
    if loss_scale is None:
        return None
    what = "None, a finite positive number" + (" or 'dynamic'" if allow_dynamic else "")
    if isinstance(loss_scale, str):
        if allow_dynamic and loss_scale == "dynamic":
            return loss_scale
        raise ValueError(f"loss_scale must be {what}, got {loss_scale!r}.")
    dtype = getattr(loss_scale, "dtype", None)
    if dtype is None and isinstance(loss_scale, int | float) and not isinstance(loss_scale, bool):
        dtype = np.asarray(loss_scale).dtype
    if dtype is None or not (
        jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    ):
        raise TypeError(
            f"loss_scale must be {what}, got {loss_scale!r} ({type(loss_scale).__name__})."
        )
    if np.shape(loss_scale) != ():
        raise ValueError(f"loss_scale must be a scalar, got shape {np.shape(loss_scale)}.")
    if isinstance(loss_scale, jax.core.Tracer):
        return loss_scale
    if not (np.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(
            f"loss_scale must be a finite positive number, got {loss_scale}: the gradients "
            "are divided by it."
        )
    return loss_scale


def unscale(loss: jax.Array, grads: PyTree, loss_scale: Any) -> tuple[jax.Array, PyTree]:
    """``(loss, grads / loss_scale)``.

    A traced ``loss_scale`` is only known when the step runs: if it is not finite and
    positive (0, inf, nan, -1), the loss and every gradient are NaN, so the step
    cannot pass as a good one (``make_train_step`` skips it, ``check_finite`` names it).
    """
    if loss_scale is None:
        return loss, grads
    grads = jax.tree.map(lambda g: (g / loss_scale).astype(g.dtype) if is_inexact(g) else g, grads)
    if not isinstance(loss_scale, jax.core.Tracer):
        return loss, grads  # checked by check_loss_scale
    ok = jnp.isfinite(loss_scale) & (loss_scale > 0)
    poison = lambda x: jnp.where(ok, x, jnp.nan).astype(x.dtype) if is_inexact(x) else x
    return poison(loss), jax.tree.map(poison, grads)
