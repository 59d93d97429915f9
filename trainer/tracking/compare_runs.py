"""The MLflow side of `memlm compare`: find an experiment, sort its runs into training runs and the rest, read
the metric histories the table and plots need. Works the same against a SQLite file and a tracking server.

    client, uri = open_store("http://127.0.0.1:5000")      # or None: $MLFLOW_TRACKING_URI, else ./mlflow.db
    found = read_experiment(client, uri, "memlm-demo")     # TrackingError for a missing/empty experiment
    found.runs[0].histories["loss"]                         # [(step, value), ...]

Which runs are rows: those with a logged `model.arch` param (the Tracker logs the flattened config), unless a
`kind` or `memlm.kind` tag says otherwise (extrapolate uses the first, sweep the second: a sweep's parent, an
extrapolation, an earlier comparison) or another run of the experiment names it as its parent (a sweep run, however
it is tagged). A sweep's trials are ordinary training runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from memlm.trainer.config.run_config import TrackingConfig

from .client import open_client, set_environment
from .errors import TrackingError
from .tracker import error_reason

KIND_TAGS = ("kind", "memlm.kind")  # what the cluster commands tag runs that are not training runs with
COMPARISON_KIND = "comparison"
NOT_TRAINING = {COMPARISON_KIND, "extrapolation", "sweep", "sweep-parent", "sweep_parent"}
HISTORY_KEYS = ("loss", "tokens_per_s", "valid_ppl")  # curves read per run (one request each)

# Against a server MLflow prints "View run ... at: URL" on stdout when a run ends: stdout is the table here.
_QUIET = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


@dataclass
class RunRecord:
    """What the comparison needs of one MLflow run, as plain values (no MLflow objects past this module)."""

    run_id: str
    name: str
    status: str
    params: dict[str, str]
    metrics: dict[str, float]  # latest value per key (MLflow's rule: highest step, then newest)
    tags: dict[str, str]
    histories: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # key -> [(step, value)]


@dataclass
class ExperimentRuns:
    name: str
    experiment_id: str
    runs: list[RunRecord]  # training runs: the table's rows
    others: Counter  # kind -> how many runs of the experiment are not rows


def resolve_uri(uri: str | None) -> str:
    """--uri, else $MLFLOW_TRACKING_URI, else ./mlflow.db as an absolute sqlite:/// URI (as training does)."""
    return TrackingConfig(uri=uri or "").resolved_uri()


def open_store(uri: str) -> Any:
    """An MlflowClient for uri. A SQLite file that does not exist is refused: opening it would create an empty
    store as a side effect, and the user almost surely ran from another folder."""
    set_environment(_QUIET)
    return open_client(uri, create=False)


def read_experiment(client: Any, uri: str, name: str) -> ExperimentRuns:
    experiment = _experiment(client, uri, name)
    all_runs = []
    page_token = None
    while True:
        page = client.search_runs([experiment.experiment_id], max_results=1000, page_token=page_token)
        all_runs.extend(page)
        page_token = page.token
        if not page_token:
            break
    parents = {run.data.tags.get("mlflow.parentRunId") for run in all_runs}
    rows, others = [], Counter()
    for run in all_runs:
        kind = _kind(run, parents)
        if kind:
            others[kind] += 1
            continue
        rows.append(_record(client, run))
    if not rows:
        held = f" (it holds only {describe(others)})" if others else " (it has no runs)"
        raise TrackingError(f"experiment {name!r} in {uri} has no training runs{held}: train with "
                           f"tracking.enabled=true tracking.experiment={name} first")
    return ExperimentRuns(name, experiment.experiment_id, rows, others)


def _experiment(client: Any, uri: str, name: str) -> Any:
    try:
        experiment = client.get_experiment_by_name(name)
    except Exception as exc:  # noqa: BLE001 - the first request: whatever fails here, the store is unusable
        raise TrackingError(f"cannot read the MLflow store {uri} ({error_reason(exc)}); "
                           "start the server or fix --uri / $MLFLOW_TRACKING_URI") from None
    if experiment is None:
        names = sorted(e.name for e in client.search_experiments())
        shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
        raise TrackingError(f"no experiment {name!r} in {uri}; it has: {shown or 'no experiments'} "
                           "(pass one of those to --experiment, or --uri for another store)")
    if experiment.lifecycle_stage == "deleted":
        raise TrackingError(f"experiment {name!r} in {uri} is deleted; restore it (MLflow UI, or "
                           f"`mlflow experiments restore --experiment-id {experiment.experiment_id}`) to compare it")
    return experiment


def _kind(run: Any, parents: set) -> str:
    """"" for a training run, else what it is (counted in the table's footnote)."""
    tags = run.data.tags
    kind = next((tags[key] for key in KIND_TAGS if tags.get(key)), "")
    if kind in NOT_TRAINING:
        return kind
    if run.info.run_id in parents:
        return "parent (sweep)"
    if "model.arch" not in run.data.params:
        return kind or "without a model config"
    return ""


def _record(client: Any, run: Any) -> RunRecord:
    record = RunRecord(run_id=run.info.run_id, name=run.info.run_name or run.info.run_id, status=run.info.status,
                       params=dict(run.data.params), metrics=dict(run.data.metrics), tags=dict(run.data.tags))
    for key in HISTORY_KEYS:
        if key in record.metrics:  # a key never logged would cost a request for nothing
            record.histories[key] = last_per_step(client.get_metric_history(run.info.run_id, key))
    return record


def last_per_step(history: list[Any]) -> list[tuple[int, float]]:
    """[(step, value)] ascending, one point per step: a resumed run re-logs its last steps and `memlm eval` adds a
    valid_ppl at the checkpoint's step, and the newest value is the one that counts."""
    latest: dict[int, tuple[int, float]] = {}
    for m in sorted(history, key=lambda m: (m.step, m.timestamp)):
        latest[m.step] = (m.step, m.value)
    return [latest[step] for step in sorted(latest)]


def describe(counts: Counter) -> str:
    return ", ".join(f"{n} {kind} run{'s' if n > 1 else ''}" for kind, n in sorted(counts.items()))
