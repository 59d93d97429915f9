"""Plots of `memlm analyze` (trainer/inference/analyze.py): headless matplotlib figures (Agg canvas, no pyplot state),
each
written aside and renamed, like trainer/tracking/plots.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def write_plots(result: dict[str, Any], out: Path, title: str) -> list[Path]:
    """Every plot the result has data for; returns the files written."""
    files = []
    if "attention_intervals" in result:
        files.append(plot_intervals(result["attention_intervals"], out / "attention_intervals.png", title))
    if "lamemo_alpha" in result:
        files.append(plot_alpha(result["lamemo_alpha"], out / "lamemo_alpha.png", title))
    if "rmt_attention" in result:
        files.append(plot_rmt_maps(result["rmt_attention"], out / "rmt_attention.png", title))
    return files


def plot_intervals(stats: dict[str, Any], path: Path, title: str) -> Path:
    """LaMemo Figure 1: mean max attention weight per context interval, one line per layer, memory shaded."""
    fig, ax = _figure((7.5, 4.2))
    labels = [iv["label"] for iv in stats["intervals"]]
    xs = list(range(len(labels)))
    for l, row in enumerate(stats["max_weight"]):
        ys = [float("nan") if v is None else v for v in row]
        ax.plot(xs, ys, marker="o", markersize=3, label=f"layer {l}")
    n_mem = sum(1 for label in labels if label.startswith("mem"))
    if n_mem:
        ax.axvspan(-0.5, n_mem - 0.5, color="tab:gray", alpha=0.12, label="memory")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize="small")
    ax.set_xlabel("context interval (key positions; memory oldest first, then the current segment)")
    ax.set_ylabel("mean of max attention weight")
    ax.set_title(f"Attention to context intervals\n{title}", fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_alpha(stats: dict[str, Any], path: Path, title: str) -> Path:
    """LaMemo Figure 6: alpha per layer against memory index."""
    fig, ax = _figure((7.0, 4.0))
    for l, row in enumerate(stats["alpha"]):
        ys = [float("nan") if v is None else v for v in row]
        ax.plot(range(len(ys)), ys, label=f"layer {l}")
    ax.set_xlabel("memory index (0 = oldest slot)")
    ax.set_ylabel("alpha (share kept on past context)")
    ax.set_ylim(0.0, 1.0)
    ax.set_title(f"LaMemo memorising coefficient alpha\n{title}", fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_rmt_maps(stats: dict[str, Any], path: Path, title: str) -> Path:
    """RMT Figure 6: the mean attention map of each layer, block edges drawn and named."""
    import numpy as np

    maps = np.asarray(stats["mean_map"])  # [L, Q, K]
    L = maps.shape[0]
    fig, axes = _figure((4.2 * L + 1.0, 4.4), ncols=L)
    axes = axes if L > 1 else [axes]
    for l, ax in enumerate(axes):
        image = ax.imshow(maps[l], aspect="auto", cmap="viridis", interpolation="nearest", vmin=0.0)
        for lo, hi in stats["key_blocks"].values():
            if lo > 0:
                ax.axvline(lo - 0.5, color="white", linewidth=0.8)
        for lo, hi in stats["query_blocks"].values():
            if lo > 0:
                ax.axhline(lo - 0.5, color="white", linewidth=0.8)
        ax.set_xticks([(lo + hi - 1) / 2 for lo, hi in stats["key_blocks"].values() if hi > lo])
        ax.set_xticklabels([name for name, (lo, hi) in stats["key_blocks"].items() if hi > lo], fontsize="small")
        ax.set_yticks([(lo + hi - 1) / 2 for lo, hi in stats["query_blocks"].values()])
        ax.set_yticklabels(list(stats["query_blocks"]), fontsize="small")
        ax.set_xlabel("keys")
        ax.set_ylabel("queries")
        ax.set_title(f"layer {l}", fontsize="medium")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    fig.suptitle(f"RMT attention: read / tokens / write rows\n{title}", fontsize="medium")
    return _save(fig, path)


def _figure(size: tuple[float, float], ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    return fig, axes


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path
