"""The sides of a loss, by name: :class:`Sides` holds something per side.

A side is one of the arrays a loss scores: the queries ``x``, the documents ``y``
(``k`` per query), each query's positive document ``p`` (rows only: ``Firsts`` of
``y``), the columns gathered from every device ``cx``/``cy`` (the gather form) and a
bank's earlier queries and documents ``bx``/``by`` (``losses._bank``). The names are
:data:`Side` literals; :func:`gathered` and :func:`banked` name a side's gathered and
bank columns, :func:`is_bank` tells a bank's.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

Side = Literal["x", "y", "p", "cx", "cy", "bx", "by"]
Own = Literal["x", "y"]
"""A side of this step's rows (the others are those rows gathered, or a bank's)."""


def gathered(side: Own) -> Side:
    """The side of ``side``'s columns gathered from every device: ``cx`` or ``cy``."""
    return "cx" if side == "x" else "cy"


def banked(side: Own) -> Side:
    """The side of a bank's earlier rows of ``side``: ``bx`` or ``by``."""
    return "bx" if side == "x" else "by"


def is_bank(side: Side) -> bool:
    """Whether ``side`` is a bank's (constants: no gradient)."""
    return side in ("bx", "by")


class Sides(NamedTuple):
    """Something per side of a loss (rows, metadata, gradients); None where absent.

    The fields are the :data:`Side` names, in alphabetical order: a pytree's leaves in
    the order of the dicts it replaced (sorted keys), so the compiled programs did not
    change."""

    bx: Any = None
    by: Any = None
    cx: Any = None
    cy: Any = None
    p: Any = None
    x: Any = None
    y: Any = None

    def of(self, side: Side) -> Any:
        """The entry of ``side``."""
        return getattr(self, side)

    def put(self, side: Side, value: Any) -> Sides:
        """These sides with ``side``'s entry replaced."""
        return self._replace(**{side: value})
