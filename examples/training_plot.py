"""The picture of a run: losses, temperature and held-out retrieval against the step.

Drawn from the records of ``metrics.jsonl`` (see ``run_dir.py``) with matplotlib's
object-oriented API (no pyplot, no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

RETRIEVAL = (("recall@1", "R@1"), ("recall@10", "R@10"), ("mrr", "MRR"))


def plot(records: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Writes the three panels of a run to ``path`` (PNG) and returns it."""
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    figure = Figure(figsize=(15, 4.2), layout="constrained")
    loss_axes, temperature_axes, retrieval_axes = figure.subplots(1, 3)
    draw_losses(loss_axes, train, evals)
    draw_temperature(temperature_axes, train)
    draw_retrieval(retrieval_axes, evals)
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=110)
    return path


def draw_losses(axes: Axes, train: Sequence[dict], evals: Sequence[dict]) -> None:
    """Training loss per step and held-out loss (same batch size) at each evaluation."""
    axes.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="training")
    held_out = [r for r in evals if "loss" in r]
    axes.plot(
        [r["step"] for r in held_out],
        [r["loss"] for r in held_out],
        "o-",
        ms=4,
        label="held-out",
    )
    axes.set(xlabel="step", ylabel="InfoNCE loss (in-batch negatives)", title="loss")
    axes.grid(alpha=0.3)
    axes.legend()


def draw_temperature(axes: Axes, train: Sequence[dict]) -> None:
    """The learnt temperature after each step."""
    axes.plot([r["step"] for r in train], [r["temperature"] for r in train], color="C2")
    axes.set(xlabel="step", ylabel="temperature", title="learnt temperature")
    axes.grid(alpha=0.3)


def draw_retrieval(axes: Axes, evals: Sequence[dict]) -> None:
    """Held-out Recall@1, Recall@10 and MRR; the legend gives before -> after."""
    steps = [r["step"] for r in evals]
    for key, label in RETRIEVAL:
        values = [r[key] for r in evals]
        if values:
            label = f"{label}: {values[0]:.3f} -> {values[-1]:.3f}"
        axes.plot(steps, values, "o-", ms=4, label=label)
    axes.set(xlabel="step", ylabel="held-out", title="held-out retrieval")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.legend()
