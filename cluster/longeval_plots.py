"""`memlm longeval`'s accuracy.png: accuracy (all depths) against sample length, one solid line per run and one
dashed line per baseline of a reader that does not learn (trainer/inference/longeval_baselines.py), so a run's line
reads against chance and the heuristics measured on its own samples."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from memlm.trainer.tracking.plots import _axes, _save_png


def plot_accuracy(lines: Mapping[str, Mapping[int, float]], baselines: Mapping[str, Mapping[int, float]],
                  lengths: Sequence[int], labels: Sequence[str], path: Path, *, title: str,
                  xlabel: str = "sample length (tokens)") -> Path:
    """lines / baselines: {name: {length: accuracy}}; lengths and their tick labels in order. A log-2 length axis,
    or one tick per length when a length is 0 (BABILong's 0k: its facts alone)."""
    fig, ax = _axes((6.5, 4.2), 120)
    log = all(n > 0 for n in lengths)
    x = {n: (n if log else i) for i, n in enumerate(lengths)}
    for name, points in lines.items():
        shown = [n for n in lengths if n in points]
        ax.plot([x[n] for n in shown], [points[n] for n in shown], marker="o", markersize=4, label=name)
    for k, (name, points) in enumerate(baselines.items()):
        shown = [n for n in lengths if n in points]
        ax.plot([x[n] for n in shown], [points[n] for n in shown], linestyle="--", linewidth=1.0,
                color=f"C{(len(lines) + k) % 10}", alpha=0.8, label=f"baseline: {name}")
    if log:
        ax.set_xscale("log", base=2)
    ax.set_xticks([x[n] for n in lengths], list(labels))
    ax.minorticks_off()
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("answer accuracy")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if lines or baselines:
        ax.legend(fontsize="small")
    return _save_png(fig, path)
