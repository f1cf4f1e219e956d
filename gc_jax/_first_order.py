"""What cannot be differentiated in reverse mode again: chunk loops as long as the data says.

A :class:`gc_jax.TokenBudget` or :class:`gc_jax.TokenPacking` cuts a batch into a
number of chunks that the data decides. Under ``jit`` both passes then loop over
chunks with traced bounds (``while`` loops), which JAX cannot differentiate in
reverse mode; its own error ("dynamic start/stop") names neither the budget nor a
way out. The step's outputs (loss, aux, gradients) are therefore passed through
:func:`mark`, an identity whose reverse-mode derivative (its transpose) raises
:func:`message` instead. A cotangent reaches the mark before any chunk loop, so the
error is this one; forward mode (``jax.jvp``, ``jax.jacfwd``) works as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from gc_jax import _passes
from gc_jax._base import PyTree


def message(what: str, chunk_size: object, *, forward_mode: bool) -> str:
    """Why ``what`` (an entry point and its input) cannot be differentiated twice with
    ``chunk_size``, and what to do instead; ``forward_mode``: whether forward mode
    (``jax.jvp``) over it works, so that only reverse mode is refused."""
    kind = type(chunk_size).__name__
    mode, forward = "", ""
    if forward_mode:
        mode = ", the second time in reverse mode"
        forward = "; or take the outer derivative in forward mode (jax.jvp, jax.jacfwd)"
    return (
        f"{what} was differentiated twice{mode} (a gradient of its loss or of its "
        "gradients: a gradient of a gradient, a Hessian, a meta-gradient through a "
        f"training step), with chunk_size={chunk_size!r}. A {kind} cuts the batch into a "
        "number of chunks that only the data decides, so its chunk loops run as long as "
        "the data says, and JAX cannot differentiate such a loop in reverse mode. Pass "
        "an integer chunk_size for this input (every order of derivative works there), "
        f"or compute higher derivatives on a batch without the {kind}{forward}."
    )


def _refuse(ct, x, *, message: str):
    raise ValueError(message)


_first_order_only = Primitive("gc_jax_first_order_only")
_first_order_only.def_impl(lambda x, *, message: x)
_first_order_only.def_abstract_eval(lambda x, *, message: x)
ad.deflinear2(_first_order_only, _refuse)
batching.defvectorized(_first_order_only)
mlir.register_lowering(
    _first_order_only, mlir.lower_fun(lambda x, *, message: x, multiple_results=False)
)


def mark(tree: PyTree, message: str) -> PyTree:
    """``tree``, whose floating-point leaves raise ``message`` when differentiated in
    reverse mode (forward mode passes through)."""
    one = lambda x: _first_order_only.bind(x, message=message) if _passes.is_inexact(x) else x
    return jax.tree.map(one, tree)


def staged() -> bool:
    """Whether values computed here are staged out (under ``jit``), so that a number of
    chunks computed from the data is traced, not a concrete count (eagerly, the chunk
    loops have static bounds and every derivative works)."""
    return isinstance(jnp.zeros(()), jax.core.Tracer)
