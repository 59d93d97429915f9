"""`memlm compare --experiment NAME [--out DIR] [--uri URI]`: an experiment's training runs as one table.

    memlm compare --experiment memlm-demo                       # ./mlflow.db (or $MLFLOW_TRACKING_URI)
    memlm compare --experiment wt103 --uri http://127.0.0.1:5000 --out results/wt103

Writes DIR/table.md, DIR/table.csv, DIR/loss.png (training loss against step) and DIR/valid_ppl.png (when any run
validated), prints the Markdown table on stdout (the file list goes to stderr, so `> table.md` works), and logs the
same files to MLflow as artifacts of a new run tagged kind=comparison in the experiment NAME-comparisons: in the
MLflow UI, NAME's runs table then holds its training runs only.

Why a new comparison run per call rather than one reused run: a comparison is a snapshot of an experiment whose
runs keep training and arriving; a fresh run keeps each snapshot intact with its time, while overwriting the
artifacts of one run is not possible on every artifact store (and would lose the older table). Comparison runs
written into NAME itself by older versions are never rows (compare_runs skips them), and the table is also the
run's description, so the MLflow UI shows it on the run page.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

from memlm.trainer.config.run_config import TrackingConfig
from memlm.trainer.runtime import heartbeat

from .compare_runs import COMPARISON_KIND, KIND_TAGS, ExperimentRuns, describe, open_store, read_experiment, resolve_uri
from .compare_table import build_row, sort_rows, to_csv, to_markdown
from .errors import TrackingError
from .plots import plot_curves
from .tracker import ensure_experiment, error_reason

MAX_PARAM = 6000  # MLflow's limit on a param value's length
COMPARISONS_SUFFIX = "-comparisons"  # the snapshots' experiment: the compared one's name plus this


def main(args: argparse.Namespace) -> int:
    uri = resolve_uri(args.uri)
    client = open_store(uri)
    found = read_experiment(client, uri, args.experiment)
    out = Path(args.out) if args.out else Path("compare") / _folder_name(args.experiment)
    if out.exists() and not out.is_dir():
        raise TrackingError(f"--out {out} is a file; pass a folder (it is created when missing)")
    files, markdown = write_comparison(found, out)
    heartbeat.phase(None)  # the table is the command's first line (memlm/start_watch.py)
    sys.stdout.write(markdown)
    heartbeat.said()
    heartbeat.phase(f"logging the comparison to MLflow at {uri}")
    run_id = log_comparison(client, uri, found, files, markdown)
    logged = f"; logged to MLflow run {run_id} in {comparison_experiment(args.experiment)!r}" if run_id else ""
    print(f"wrote {', '.join(str(f) for f in files)}{logged}", file=sys.stderr)
    return 0


def write_comparison(found: ExperimentRuns, out: Path) -> tuple[list[Path], str]:
    """The table (Markdown, CSV) and the curves of `found` under `out`; returns (files written, Markdown)."""
    rows = sort_rows([build_row(record) for record in found.runs])
    footnotes = [f"Not rows: {describe(found.others)}."] if found.others else []
    footnotes.append("params and FLOPs/token (forward, 2 per multiply-add, at the trained lengths) are analytic "
                     "(models/flops.py); tokens/s is the median over logged steps.")
    markdown = to_markdown(rows, title=f"Experiment {found.name}", footnotes=footnotes)
    out.mkdir(parents=True, exist_ok=True)
    files = [_write(out / "table.md", markdown), _write(out / "table.csv", to_csv(rows))]
    labels = _labels(found)
    by_row = {r.run_id: r for r in found.runs}
    ordered = [by_row[row.run_id] for row in rows]  # legend in the table's order
    for key, ylabel, title, log_y in (("loss", "training loss (nats/token)", "Training loss", False),
                                      ("valid_ppl", "validation perplexity", "Validation perplexity", True)):
        curves = {labels[r.run_id]: r.histories.get(key, []) for r in ordered}
        path = plot_curves(curves, out / f"{key}.png", ylabel=ylabel, title=f"{title}: {found.name}", log_y=log_y)
        if path is not None:
            files.append(path)
        elif (out / f"{key}.png").exists():  # a plot from an earlier call that no longer applies
            (out / f"{key}.png").unlink()
    return files, markdown


def comparison_experiment(name: str) -> str:
    """Where snapshots of experiment NAME go: beside it, never among its training runs."""
    return f"{name}{COMPARISONS_SUFFIX}"


def log_comparison(client: Any, uri: str, found: ExperimentRuns, files: list[Path], markdown: str) -> str:
    """A new run (kind=comparison) in experiment NAME-comparisons holding the files; its id, or "" with a warning
    when the store refuses."""
    from mlflow.entities import Param, RunTag

    tags = {key: COMPARISON_KIND for key in KIND_TAGS}  # both conventions in use, so every reader skips it
    tags["mlflow.note.content"] = markdown  # the MLflow UI shows this as the run's description
    run_ids = ",".join(r.run_id for r in found.runs)
    params = {"runs": str(len(found.runs)), "run_ids": run_ids if len(run_ids) <= MAX_PARAM else "(too many)"}
    run_id = ""
    try:
        # Snapshots hold no training metrics: no saved view of them (the run name says when it was taken).
        experiment_id = ensure_experiment(TrackingConfig(experiment=comparison_experiment(found.name), uri=uri),
                                          client, view=None)
        tags["memlm.compared_experiment"] = found.name
        run = client.create_run(experiment_id, run_name=f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
        run_id = run.info.run_id
        client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()],
                         tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
        for path in files:
            client.log_artifact(run_id, str(path), "compare")
        client.set_terminated(run_id, "FINISHED")
        return run_id
    except Exception as exc:  # noqa: BLE001 - the table is written and printed; the copy in MLflow is extra
        print(f"memlm: warning: could not log the comparison to MLflow ({error_reason(exc)}); the files are in "
              f"{files[0].parent}", file=sys.stderr)
        if run_id:
            try:
                client.set_terminated(run_id, "FAILED")
            except Exception:  # noqa: BLE001 - already warned about this store
                pass
        return ""


def _labels(found: ExperimentRuns) -> dict[str, str]:
    """Legend label per run id: the run name, with the id's start added where two runs share a name."""
    counts: dict[str, int] = {}
    for r in found.runs:
        counts[r.name] = counts.get(r.name, 0) + 1
    return {r.run_id: r.name if counts[r.name] == 1 else f"{r.name} ({r.run_id[:8]})" for r in found.runs}


def _folder_name(experiment: str) -> str:
    """An experiment name as one folder name ("team/wt103 base" -> "team_wt103_base")."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("._") or "experiment"


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path
