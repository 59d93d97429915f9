"""Plots of `memlm compare`: one metric against the training step, one line per run, as PNG.

Drawn on a bare Agg Figure rather than through pyplot: pyplot keeps global state and picks a GUI backend from the
environment, which a command run over ssh or inside a test must not depend on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_curves(curves: Mapping[str, Sequence[tuple[int, float]]], path: str | os.PathLike, *, ylabel: str,
                title: str, log_y: bool = False) -> Path | None:
    """curves: label -> [(step, value), ...]. Writes nothing and returns None when no run has a point."""
    curves = {label: points for label, points in curves.items() if points}
    if not curves:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for label, points in curves.items():
        steps, values = zip(*points)
        # Markers only where a curve has a few points (validation every k steps), so it stays visible.
        ax.plot(steps, values, label=label, marker="o" if len(points) <= 20 else None, markersize=3)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y and all(v > 0 for points in curves.values() for _, v in points):
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")  # aside, then renamed: never half a file
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path
