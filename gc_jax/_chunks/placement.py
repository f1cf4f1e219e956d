"""How one device's rows are packed into lines, with NumPy: the model of the traced plan.

:func:`pack_lines` places rows as :mod:`gc_jax._chunks.lines`' traced plan does (the
longest row left, then the shortest that fit); :func:`lines_by_bucket` does so for each
line length. ``TokenPacking``'s NumPy methods (chunk counts, the lines, the fit of
``for_lengths``) and the tests read them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gc_jax._chunks import spans


def lines_by_bucket(lengths: Any, widths: tuple[int, ...], segments: int | None = None):
    """Each line length's lines of one device's rows (NumPy; :func:`pack_lines` of the
    rows each holds): a row goes to the shortest ``widths[c]`` that holds it (a row of
    length 0, to the last). ``segments`` None: no limit on the rows a line holds."""
    lengths = np.asarray(lengths)
    lengths = np.where(lengths > 0, lengths, widths[-1])
    bucket = spans.bucket_of(lengths, widths, np)
    return [pack_lines(lengths[bucket == c], n, segments or n) for c, n in enumerate(widths)]


def pack_lines(lengths: Any, line_length: int, segments: int) -> list[list[int]]:
    """The lines of one device's rows, with NumPy: each line's rows, as positions in the
    rows sorted longest first (a row of length 0 takes a line of its own).

    A line takes the longest row left, then the shortest rows left while they fit and
    it has fewer than ``segments`` rows (the shortest left not fitting, none does).
    """
    ordered = np.asarray(lengths)
    ordered = np.sort(np.where(ordered > 0, ordered, line_length), kind="stable")[::-1]
    front, back, lines = 0, len(ordered) - 1, []
    while front <= back:
        lines.append([front])
        used, front = int(ordered[front]), front + 1
        while front <= back and len(lines[-1]) < segments and used + ordered[back] <= line_length:
            lines[-1].append(back)
            used, back = used + int(ordered[back]), back - 1
    return lines
