"""Plots of the cluster commands, drawn headless: perplexity against m (`extrapolate`), curves against the
training step (`compare`).

We build a matplotlib Figure with the Agg canvas directly instead of going through pyplot: pyplot keeps global
state and picks a GUI backend from the environment, which a Ray driver on a server or a test process must not
depend on, and figures made this way are freed with the object (no plt.close bookkeeping).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_ppl_against_m(lines: Mapping[str, Sequence[tuple[int, float]]], path: str | os.PathLike, *, tgt_len: int,
                       split: str) -> Path:
    """The LaMemo paper's Figure 5: perplexity against the memory multiplier m (memory m x N), one line per run.

    lines: label -> [(m, ppl), ...]. A run with a missing m (a failed task) is drawn with a gap there, not
    bridged, so a failure is visible in the plot as well as in the output.
    """
    fig, ax = _axes((6.0, 4.0), 120)
    all_m: set[int] = set()
    for label, points in lines.items():
        points = sorted(points)
        all_m.update(m for m, _ in points)
        xs, ys = _with_gaps(points)
        ax.plot(xs, ys, marker="o", markersize=4, label=label)
    ax.set_xlabel(f"memory multiplier m (memory length = m x {tgt_len})")
    ax.set_ylabel(f"{split} perplexity")
    ax.set_title(f"Memory extrapolation, target length N = {tgt_len}")
    if all_m:
        ax.set_xticks(sorted(all_m))
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend()
    return _save_png(fig, path)


def plot_curves(curves: Mapping[str, Sequence[tuple[int, float]]], path: str | os.PathLike, *, ylabel: str,
                title: str, log_y: bool = False) -> Path | None:
    """One metric against the training step, one line per run (`memlm compare`).

    curves: label -> [(step, value), ...]. Writes nothing and returns None when no run has a point.
    """
    fig = draw_curves(curves, ylabel=ylabel, title=title, log_y=log_y)
    return None if fig is None else _save_png(fig, path)


def draw_curves(curves: Mapping[str, Sequence[tuple[int, float]]], *, ylabel: str, title: str,
                log_y: bool = False):
    """The Figure of plot_curves. When no run has more than two points (validated once or twice, as short runs
    and the demo are) a line per run would be one dot each: a bar per run with its latest value is drawn
    instead, labelled with the run names and the values. A log y axis is used only where the values span at
    least a factor of ten (less than a decade would get no labelled tick but "1.4x10^1" style minor labels), and
    its ticks read as plain numbers."""
    curves = {label: points for label, points in curves.items() if points}
    if not curves:
        return None
    values = [v for points in curves.values() for _, v in points]
    finite = [v for v in values if math.isfinite(v)]
    fig, ax = _axes((7.0, 4.2), 110)
    if all(len(points) <= 2 for points in curves.values()):
        labels = list(curves)
        latest = [curves[label][-1] for label in labels]
        bars = ax.bar(range(len(labels)), [v for _, v in latest], color=[f"C{i % 10}" for i in range(len(labels))])
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=20 if len(labels) > 3 else 0, ha="right" if len(labels) > 3 else "center",
                           fontsize="small")
        ax.bar_label(bars, labels=[f"{v:.4g}\n(step {step:,})" for step, v in latest], fontsize="small")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if finite:
            ax.set_ylim(0, max(finite) * 1.2)  # room for the value labels
        ax.grid(True, axis="y", alpha=0.3)
        return fig
    for label, points in curves.items():
        steps, ys = zip(*points)
        # Markers only where a curve has a few points (validation every k steps), so it stays visible.
        ax.plot(steps, ys, label=label, marker="o" if len(points) <= 20 else None, markersize=3)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    positive = [v for v in finite if v > 0]
    if log_y and positive and len(positive) == len(values) and max(positive) >= 10 * min(positive):
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def plot_accuracy_heatmap(grid: Sequence[Sequence[float | None]], lengths: Sequence[int],
                          windows: Sequence[tuple[float, float]], path: str | os.PathLike, *, title: str) -> Path:
    """Accuracy by sample length (columns) and fact depth (rows, 0 = the start of the context), BABILong's figure.
    grid[depth][length]: accuracy in [0, 1], None where the evaluation is missing (drawn blank)."""
    fig, ax = _axes((1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(windows)), 120)
    values = [[float("nan") if v is None else v for v in row] for row in grid]
    image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            if not math.isnan(v):
                ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [_size_label(n) for n in lengths])
    ax.set_yticks(range(len(windows)), [f"{lo:.1f}-{hi:.1f}" for lo, hi in windows])
    ax.set_xlabel("sample length (tokens)")
    ax.set_ylabel("fact depth")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy")
    return _save_png(fig, path)


def _size_label(n: int) -> str:
    return f"{n / 1024:g}k" if n >= 1024 and n % 512 == 0 else str(n)


def _axes(size: tuple[float, float], dpi: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _save_png(fig, path: str | os.PathLike) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")  # aside, then renamed: never half a file
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _with_gaps(points: list[tuple[int, float]]) -> tuple[list[float], list[float]]:
    """Insert a NaN between non-consecutive m so matplotlib breaks the line there."""
    xs: list[float] = []
    ys: list[float] = []
    for m, ppl in points:
        if xs and m > xs[-1] + 1:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(m)
        ys.append(ppl)
    return xs, ys
