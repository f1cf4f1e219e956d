"""The argument docs every loss shares, written once and filled into each docstring.

A loss's docstring holds a line ``{shared args}`` at the end of its ``Args:`` section
and a line ``{shared returns}`` as its ``Returns:`` section; :func:`shared_docs`
replaces each with the text below, indented like the marker. The filled docstring is
the function's ``__doc__``: what ``help()``, Sphinx and the doctests read.
"""

from __future__ import annotations

import textwrap
import types
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_ARGS = """\
reduction: ``"mean"`` or ``"sum"`` of the per-row losses over the global batch,
  or ``"none"`` for the per-row losses of this device's rows.
block_size: if set, the logits and their gradients are computed in
  ``block_size x block_size`` tiles and never held whole: memory grows with
  ``rows * dim`` instead of ``rows**2``. The same values up to float rounding.
axis_name: the data-parallel axis of ``shard_map``/``pmap`` (or a mesh axis of
  ``jax.set_mesh`` under ``jit``), or None (also under ``jit`` over rows sharded
  over explicit mesh axes, whose types say how they lie).
method: ``"auto"``, ``"ring"`` or ``"gather"``: how the rows of other devices are
  reached (see :mod:`gc_jax.losses`); the same values either way."""

_RETURNS = """\
The loss, in float32 (or wider). Under ``axis_name``: the global loss on every
device, typed replicated under ``shard_map`` (``out_specs=P()``). With
``reduction="none"``: this device's per-row losses."""

_MARKERS = types.MappingProxyType({"{shared args}": _ARGS, "{shared returns}": _RETURNS})


def shared_docs(fn: F) -> F:
    """Fills the ``{shared args}`` and ``{shared returns}`` lines of ``fn``'s docstring.

    Args:
      fn: a loss whose docstring holds each marker once, alone on its line.

    Returns:
      ``fn`` itself, its ``__doc__`` filled.

    Examples:
      >>> @shared_docs
      ... def loss(x):
      ...     '''A loss.
      ...
      ...     Args:
      ...       x: rows.
      ...       {shared args}
      ...     '''
      >>> print(loss.__doc__.splitlines()[4])
            reduction: ``"mean"`` or ``"sum"`` of the per-row losses over the global batch,
    """
    lines = []
    for line in (fn.__doc__ or "").splitlines():
        text = _MARKERS.get(line.strip())
        if text is None:
            lines.append(line)
        else:
            indent = line[: len(line) - len(line.lstrip())]
            lines.append(textwrap.indent(text, indent))
    doc = "\n".join(lines)
    if any(marker in doc for marker in _MARKERS):
        raise ValueError(f"{fn.__name__}: a {{shared ...}} marker is not alone on its line.")
    fn.__doc__ = doc
    return fn
