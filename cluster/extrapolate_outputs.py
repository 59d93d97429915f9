"""The files and the table `memlm extrapolate` leaves behind, from the collected results.

    summary.json      {"split", "tgt_len", "mults", "runs": {name: {run_dir, arch, step, results: [{m, ...}]}}}
    extrapolation.csv one row per (run, m)
    extrapolation.png perplexity against m, one line per run (LaMemo Figure 5)

The per-(run, m) JSON files are written as results arrive (by the task, checked by the driver); these three are
rewritten at the end from everything known, including results reused from an earlier invocation.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from typing import Any

from memlm.trainer.tracking.plots import plot_ppl_against_m

from .extrapolate_plan import RunSpec

SUMMARY = "summary.json"
CSV = "extrapolation.csv"
PLOT = "extrapolation.png"
CSV_FIELDS = ("run", "arch", "step", "m", "split", "tgt_len", "mem_len", "documents", "tokens", "nll", "ppl", "bpc",
              "eval_seconds", "run_dir", "node")


def build_summary(runs: list[RunSpec], mults: list[int], split: str, tgt_len: int,
                  results: dict[tuple[str, int], dict[str, Any]], seconds: dict[tuple[str, int], float],
                  nodes: dict[tuple[str, int], str] | None = None) -> dict:
    """runs -> results ordered by m. eval_seconds is None for a result reused from disk (not measured now), and
    so is node (the Ray node id that evaluated it; "" where Ray does not say)."""
    body = {}
    nodes = nodes or {}
    for run in runs:
        rows = [{"m": m, **results[(run.name, m)], "eval_seconds": seconds.get((run.name, m)),
                 "node": nodes.get((run.name, m))}
                for m in mults if (run.name, m) in results]
        body[run.name] = {"run_dir": str(run.run_dir), "arch": run.arch, "step": run.step, "checkpoint": run.tag,
                          "missing_m": [m for m in mults if (run.name, m) not in results], "results": rows}
    return {"split": split, "tgt_len": tgt_len, "mults": mults, "runs": body}


def write_outputs(out: Path, summary: dict) -> dict[str, Path]:
    """summary.json, the CSV and the plot under `out`; returns their paths by kind."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary": out / SUMMARY, "csv": out / CSV, "plot": out / PLOT}
    _write_text(paths["summary"], json.dumps(summary, indent=2) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for name, run in summary["runs"].items():
        for row in run["results"]:
            writer.writerow({**{k: row.get(k) for k in CSV_FIELDS}, "run": name, "run_dir": run["run_dir"]})
    _write_text(paths["csv"], buf.getvalue())
    lines = {label(name, run): [(row["m"], row["ppl"]) for row in run["results"]]
             for name, run in summary["runs"].items()}
    plot_ppl_against_m(lines, paths["plot"], tgt_len=summary["tgt_len"], split=summary["split"])
    return paths


def label(name: str, run: dict) -> str:
    """Plot legend: the run's name, with its arch when the name does not already say it."""
    return name if run["arch"] in name else f"{name} ({run['arch']})"


def table(summary: dict) -> str:
    """run x m -> ppl as aligned text, for the terminal ("-" where a task failed)."""
    mults = summary["mults"]
    header = ["run", "arch"] + [f"m={m}" for m in mults]
    rows = [header]
    for name, run in summary["runs"].items():
        by_m = {row["m"]: row["ppl"] for row in run["results"]}
        rows.append([name, run["arch"]] + [_fmt(by_m.get(m)) for m in mults])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join([f"{summary['split']} perplexity, N = {summary['tgt_len']}, memory = m x N", *lines])


def _fmt(ppl: float | None) -> str:
    if ppl is None:
        return "-"
    return f"{ppl:.2f}" if math.isfinite(ppl) and ppl < 1e6 else f"{ppl:.3g}"


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
