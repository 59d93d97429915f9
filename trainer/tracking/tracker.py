"""MLflow tracking for a training run: params, batched metrics, artifacts, tags; rank 0 only.

    tracker = Tracker(cfg.tracking, run_dir, rank, cfg)   # rank != 0 or tracking disabled: a no-op
    tracker.log_metrics(step, {"loss": 3.2, "lr": 1e-4})   # buffered, sent with log_batch
    tracker.log_artifact(run_dir / "config.yaml")
    tracker.finish()                                       # or finish("FAILED"); idempotent

Tracking must never stop training, and nothing is lost when the tracking server is away. A failing MLflow call
(server down, database locked, ...) logs one warning; what could not be sent stays queued in order (the run's
creation itself, when the server was down at the start) and is retried at most every RETRY_FIRST_SECONDS, backing
off to RETRY_MAX_SECONDS, so a dead server costs a training step one fast-failing request now and then (client.py
bounds each request: no retries, a 10 s timeout). When the server answers again, everything missed is sent in step
order and the run ends with its status. If it is still away when the run ends, the warning says so and
`memlm track RUN_DIR` (catchup.py) sends the rest from the run folder later: metrics.jsonl and eval/*.json are the
record, and STATUS_FILE keeps the status the run ended with.

We use an MlflowClient rather than mlflow.start_run(): no process-global active run, so a Ray worker or a test
can hold several trackers, and nothing the trainer or a library does with the fluent API interferes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any, NamedTuple, Optional
from urllib.parse import urlsplit, urlunsplit

from memlm.data_pipeline.remote.location import is_remote, redact
from memlm.models.pretrained.shape import backbone_name
from memlm.trainer.checkpoint.run_files import RUN_ID_FILE
from memlm.trainer.config.run_config import RunConfig, TrackingConfig, flatten
from memlm.trainer.runtime.quiet import prints_into_library_log, route_library_loggers

from .client import open_client, set_environment
from .recorded import MAX_BATCH_METRICS, send_missing_metrics

log = logging.getLogger(__name__)

URI_FILE = "mlflow_tracking_uri"  # beside RUN_ID_FILE: the store that run lives in (`memlm eval` logs there too)
STATUS_FILE = "mlflow_run_status"  # ... and how the run ended (FINISHED/FAILED/KILLED), for `memlm track` later
LOCK_FILE = ".mlflow_tracker.lock"  # held while a Tracker runs: `memlm track` leaves a training run's folder alone
FLUSH_EVERY_CALLS = 20  # log_metrics calls between batches (each SQLite write costs ~10-15 ms, docs/design.md §9)
FLUSH_EVERY_SECONDS = 30.0  # ... or this long since the last batch, whichever comes first
MAX_BATCH_PARAMS = 100  # MLflow's limit for params/tags per log_batch
MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value's length
RETRY_FIRST_SECONDS = 15.0  # after a failure, the next try; each failed retry doubles the wait ...
RETRY_MAX_SECONDS = 120.0  # ... up to this
MAX_BATCHES_PER_CALL = 10  # a catch-up sends the backlog over several calls, never one long stall of a step
CONFIG_ARTIFACTS = ("config.yaml", "config_changes.jsonl")  # logged with URL credentials redacted
MAX_QUEUED_METRICS = 200_000  # ~50 MB; beyond it metrics wait in metrics.jsonl (sent from there on reconnection)

# MLflow 3's UI opens an experiment on its GenAI "Traces" tab unless the experiment says it holds model training:
# this tag (values "custom_model_development" / "genai_development", the UI's own kind selector) makes it open on
# the runs table, where memlm's training runs are.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# The UI's runs table shows Source / Models / Dataset columns by default, none of which a training run fills. MLflow
# 3's saved views live in experiment tags `mlflow.sharedViewState.<key>` (a JSON envelope around the UI state) and
# open from `#/experiments/<id>/runs?viewStateShareKey=<key>`: memlm saves one view per experiment with the columns
# that tell runs apart, and `memlm ui` links to it. A user may edit or overwrite it in the UI; memlm never replaces it.
RUNS_VIEW_KEY = "memlm"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
RUNS_VIEW_COLUMNS = ("metrics.`valid_ppl`", "metrics.`test_ppl`", "metrics.`loss`", "metrics.`tokens`",
                     "metrics.`tokens_per_s`", "tags.`arch`", "tags.`tokenizer`", "attributes.`Duration`")


class RunsView(NamedTuple):
    """A saved view of an experiment's runs table: its name in the UI's list of views, the columns it shows."""

    name: str
    columns: tuple[str, ...]


TRAINING_VIEW = RunsView("memlm: training metrics", RUNS_VIEW_COLUMNS)

# MLflow 3's UI starts in its GenAI mode (traces, prompts, the assistant) unless the page's address asks for the
# classic machine-learning one: the mode is each browser's own (localStorage "mlflow.workflowType", default
# "genai"), and no server option or experiment tag sets it (MLflow 3.17), so memlm's links to the UI carry it.
UI_WORKFLOW = ("workflowType", "machine_learning")


def runs_link(base_url: str, experiment_id: str, saved_view: bool) -> str:
    """The address of an experiment's runs table in the UI: the classic view, in memlm's saved view if it has it."""
    query = ([f"viewStateShareKey={RUNS_VIEW_KEY}"] if saved_view else []) + ["=".join(UI_WORKFLOW)]
    return f"{base_url}/#/experiments/{experiment_id}/runs?{'&'.join(query)}"

RUN_ID_CHARS = 6  # of the MLflow run id, appended to a default run name: enough to tell a store's runs apart


class Tracker:
    """One MLflow run for one training run folder. Inactive (every method a no-op, run_id None) on ranks other
    than 0, when tracking is disabled, and after finish. While the store cannot be reached, calls queue their work
    (see the module docstring); `connected` says whether the last MLflow call succeeded."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, rank: int, config: RunConfig):
        self.run_id: Optional[str] = None
        self.uri = ""
        self._enabled = False
        self._finished = False
        self._client: Any = None  # opened once, kept across failures (an HTTP client holds no connection state)
        self._opened = False  # the run exists in the store, with its params and memlm's tags
        self._metrics: list[Any] = []  # measured, not yet sent; in step order
        self._pending: list[tuple[str, tuple]] = []  # tags and artifacts not yet sent, in call order
        self._gap: Optional[list[int]] = None  # [first, last] step of metrics dropped past MAX_QUEUED_METRICS
        self._calls = 0
        self._last_flush = time.monotonic()
        self._down_since: Optional[float] = None  # when the current outage began (None: the store answers)
        self._retry_at = 0.0
        self._retry_wait = RETRY_FIRST_SECONDS
        self._lock: Optional[IO[str]] = None
        self._run_dir = Path(run_dir)
        if rank != 0 or not cfg.enabled:
            return
        set_environment()
        self.uri = cfg.resolved_uri()
        self._cfg, self._config, self._enabled = cfg, config, True
        self._claim_folder()
        self._send(force=True)

    @property
    def active(self) -> bool:
        """Rank 0 of a tracked run that has not finished: calls are sent now or queued."""
        return self._enabled and not self._finished

    @property
    def connected(self) -> bool:
        """The run exists in the store and nothing is waiting for it to come back."""
        return self.active and self._opened and self._down_since is None

    # ---------------------------------------------------------------------------------------------------------
    # The trainer's calls

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)  # when measured, not when flushed
        batch = []
        for key, value in metrics.items():
            try:
                batch.append(Metric(key, float(value), now, int(step)))
            except (TypeError, ValueError):  # a non-number must not cost the whole run's tracking
                log.debug("tracking: skipping non-numeric metric %s=%r", key, value)
        if len(self._metrics) + len(batch) > MAX_QUEUED_METRICS:  # whole calls only: a step is queued or not
            self._gap = [self._gap[0] if self._gap else int(step), int(step)]
        else:
            self._metrics.extend(batch)
        self._calls += 1
        # During an outage every call asks whether the retry is due (_send answers at once until it is), so the
        # backlog goes as soon as the store is back rather than at the next full batch.
        if (self._calls >= FLUSH_EVERY_CALLS or len(self._metrics) >= MAX_BATCH_METRICS or not self.connected
                or time.monotonic() - self._last_flush >= FLUSH_EVERY_SECONDS):
            self.flush()

    def flush(self) -> None:
        if self.active and (self._metrics or self._pending or not self._opened or self._gap):
            self._send()

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if not self.active:
            return
        if not Path(path).exists():  # the caller's mistake: skip it, but keep tracking the run
            log.warning("tracking: artifact %s does not exist; not logged", path)
            return
        self._pending.append(("artifact", (str(path), artifact_path)))
        self._send()

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.active and tags:
            self._pending.append(("tags", ({k: str(v) for k, v in tags.items()},)))
            self._send()

    def finish(self, status: str = "FINISHED") -> None:
        """Send what is queued and end the run with FINISHED, FAILED or KILLED; later calls do nothing. A store
        still away gets one last try; then the warning names `memlm track`, which sends the rest later."""
        if not self.active:
            return
        try:
            (self._run_dir / STATUS_FILE).write_text(status + "\n")
        except OSError as exc:  # a full disk must not turn a finished run into a crash here
            log.warning("tracking: cannot record the run's status in %s (%s)", self._run_dir / STATUS_FILE, exc)
        # Against a tracking server MLflow prints "View run ... at: URL" lines on stdout here.
        with prints_into_library_log(self._run_dir):
            sent = self._send(force=True, drain=True) and self._call(self._client.set_terminated, self.run_id, status)
        if not sent:
            log.warning(
                "MLflow tracking at %s is still unreachable as the run ends: %s and the status %s are not logged; "
                "`memlm track %s` logs them from the run folder once the server is back",
                _redact(self.uri), self._backlog(), status, self._run_dir)
        self._finished = True
        self._release_folder()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, (KeyboardInterrupt, SystemExit)) else "FAILED")

    # ---------------------------------------------------------------------------------------------------------
    # Internals

    def _claim_folder(self) -> None:
        """Record the store before any MLflow call (so `memlm track` finds it even if no call ever succeeds), forget
        how an earlier run in this folder ended (this one is running), and hold LOCK_FILE while it runs."""
        import fcntl

        self._run_dir.mkdir(parents=True, exist_ok=True)
        (self._run_dir / STATUS_FILE).unlink(missing_ok=True)
        uri_file = self._run_dir / URI_FILE
        if not uri_file.is_file() or uri_file.read_text().strip() != self.uri:
            uri_file.write_text(self.uri + "\n")
        self._lock = open(self._run_dir / LOCK_FILE, "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            log.debug("tracking: %s is held by another process", self._run_dir / LOCK_FILE)
        import mlflow  # noqa: F401 - loaded first: its import replaces the handlers of its loggers

        # Before the store is opened: "Creating initial MLflow database tables" and the migrations' INFO lines go to
        # RUN_DIR/library.log.
        route_library_loggers(self._run_dir)

    def _release_folder(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the lock
            self._lock = None

    def _send(self, force: bool = False, drain: bool = False) -> bool:
        """Deliver what is queued: the run first (created when the store was away at the start), then tags and
        artifacts, then metrics. Returns whether everything went. During an outage only one try per retry wait
        (force: try now); each call sends at most MAX_BATCHES_PER_CALL metric batches unless `drain`."""
        if self._down_since is not None and not force and time.monotonic() < self._retry_at:
            return False
        try:
            if self._client is None:
                self._client = open_client(self.uri)
            if not self._opened:
                self.run_id = open_run(self._client, self.uri, self._cfg, self._run_dir, self._config)
                self._opened = True
            while self._pending:
                kind, args = self._pending[0]
                if kind == "tags":
                    log_tags(self._client, self.run_id, args[0])
                elif Path(args[0]).exists():  # an artifact removed meanwhile (a resume's rewind) is not an error
                    with without_credentials(Path(args[0])) as shown:
                        self._client.log_artifact(self.run_id, str(shown), *args[1:])
                del self._pending[0]
            self._flush_metrics(None if drain else MAX_BATCHES_PER_CALL)
            if self._gap and not self._metrics:
                send_missing_metrics(self._client, self.run_id, self._run_dir, self._config, steps=tuple(self._gap))
                self._gap = None
        except Exception as exc:  # noqa: BLE001 - whatever MLflow raises, training goes on
            self._failed(exc)
            return False
        self._retry_at = 0.0  # the store answers: the rest of a backlog goes with the next calls, not a wait later
        if self._down_since is not None and not self._metrics:
            log.warning("MLflow tracking at %s answers again after %.0f s: what this run missed is logged to run %s",
                        _redact(self.uri), time.monotonic() - self._down_since, self.run_id)
            self._down_since, self._retry_wait = None, RETRY_FIRST_SECONDS
        return not self._metrics

    def _call(self, fn, *args) -> bool:
        """One more MLflow call after a successful _send (the run's end): False, and the outage noted, if it fails."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - whatever MLflow raises, training goes on
            self._failed(exc)
            return False
        return True

    def _failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since, self._retry_wait = now, RETRY_FIRST_SECONDS
            log.warning("MLflow tracking at %s failed (%s); training goes on and tries again every %.0f-%.0f s, "
                        "nothing is lost (metrics.jsonl in the run folder stays complete)",
                        _redact(self.uri), error_reason(exc), RETRY_FIRST_SECONDS, RETRY_MAX_SECONDS)
        else:
            self._retry_wait = min(self._retry_wait * 2, RETRY_MAX_SECONDS)
        self._retry_at = now + self._retry_wait

    def _backlog(self) -> str:
        parts = [] if self._opened else ["the run itself (its params and tags)"]
        steps = sorted({m.step for m in self._metrics})
        if steps:
            parts.append(f"{len(self._metrics)} metric values of steps {steps[0]}-{steps[-1]}")
        if self._gap:
            parts.append(f"the metrics of steps {self._gap[0]}-{self._gap[1]}")
        artifacts = sum(1 for kind, _ in self._pending if kind == "artifact")
        if artifacts:
            parts.append(f"{artifacts} artifact{'s' if artifacts != 1 else ''}")
        return ", ".join(parts) or "nothing else"

    def _flush_metrics(self, max_batches: Optional[int]) -> None:
        sent = 0
        while self._metrics and (max_batches is None or sent < max_batches):
            batch = self._metrics[:MAX_BATCH_METRICS]
            # A retried batch carries the same timestamps: MLflow's stores keep one row per (key, step, timestamp,
            # value), so a batch that reached the store before its answer was lost adds nothing the second time.
            self._client.log_batch(self.run_id, metrics=batch, synchronous=True)
            del self._metrics[:len(batch)]
            sent += 1
        if not self._metrics:
            self._calls, self._last_flush = 0, time.monotonic()


def open_run(client: Any, uri: str, cfg: TrackingConfig, run_dir: Path, config: RunConfig, *,
             reopen: bool = True) -> str:
    """The id of RUN_DIR's MLflow run in `client`'s store (RUN_ID_FILE's run, else a new one), with the config's
    params it lacks and memlm's tags logged. Every step is safe to repeat after a failure: a new run's id goes to
    RUN_ID_FILE at once, so a retry finds it rather than creating a second run. reopen: mark the run RUNNING (a
    training continues it), rather than leave its status (`memlm track`)."""
    from mlflow.exceptions import MlflowException

    id_file = run_dir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    run = None
    if run_id:
        try:
            run = client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            log.info("tracking: run %s from %s is not in %s; starting a new run", run_id, id_file, _redact(uri))
    label = cfg.run_name or default_run_label(str(config.model.arch), run_dir)
    if run is None:
        experiment_id = ensure_experiment(cfg, client)
        # mlflow.parentRunId is how the MLflow UI nests a sweep's trials under the sweep run.
        nest = {"mlflow.parentRunId": cfg.parent_run_id} if cfg.parent_run_id else None
        run = client.create_run(experiment_id, run_name=label, tags=nest)
        run_id = run.info.run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        (run_dir / URI_FILE).write_text(uri + "\n")
    elif reopen:
        client.update_run(run_id, status="RUNNING")  # reopen a FINISHED/FAILED/KILLED run
    if not cfg.run_name and run.info.run_name == label:  # the id exists only now; a name the user chose stays
        client.update_run(run_id, name=f"{label}-{run_id[:RUN_ID_CHARS]}")

    old_params = run.data.params
    # data.path and data.shards may be URLs with a user:password@ or a ?token=: MLflow gets them redacted
    params = {key: _param_value(redact(str(value)) if key.startswith("data.") else value)
              for key, value in flatten(config).items()}
    # A param can never change once logged: a resumed run with an edited config (say, more steps) keeps the first
    # values in MLflow; the trainer has said what changed in one line, and config_changes.jsonl (logged as an
    # artifact) records it with its step (trainer/checkpoint/resume_policy.py).
    changed = sorted(k for k, v in params.items() if k in old_params and old_params[k] != v)
    if changed:
        log.info("tracking: run %s keeps its first params; the values of %s changed at a resume: see the artifact "
                 "config_changes.jsonl", run_id, changed)
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items() if k not in old_params]
    for i in range(0, len(items), MAX_BATCH_PARAMS):
        client.log_batch(run_id, params=items[i:i + MAX_BATCH_PARAMS], synchronous=True)
    revision = git_revision()
    backbone = backbone_name(config.model)  # a pretrained backbone's folder, or "inline gpt2"
    log_tags(client, run_id, {
        "arch": str(config.model.arch),
        **({"backbone": backbone} if backbone else {}),
        "git_revision": revision,
        "mlflow.source.git.commit": revision,  # the MLflow UI shows this one
        "run_dir": str(run_dir.resolve()),
        # bytes: a token is a byte, so bits per token are bits per character (bpc); not for words or pieces.
        "tokenizer": tokenizer_kind(config.data.path),
    })
    return run_id


def log_tags(client: Any, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    items = [RunTag(k, str(v)[:MAX_PARAM_VALUE]) for k, v in tags.items()]
    for i in range(0, len(items), MAX_BATCH_PARAMS):
        client.log_batch(run_id, tags=items[i:i + MAX_BATCH_PARAMS], synchronous=True)


def ensure_experiment(cfg: TrackingConfig, client: Any = None, view: RunsView | None = TRAINING_VIEW) -> str:
    """The id of cfg.experiment, created if missing (and tagged to open on its runs in the UI, with `view` saved
    for its runs table; None: no view). A fresh SQLite store is created under open_client's lock; still, a driver
    starting parallel trials calls this first."""
    from mlflow.exceptions import MlflowException

    uri = cfg.resolved_uri()
    client = client or open_client(uri)
    found = client.get_experiment_by_name(cfg.experiment)
    if found is not None:
        if found.lifecycle_stage == "deleted":  # deleted in the UI: runs cannot be created in it until restored
            client.restore_experiment(found.experiment_id)
        # Made by an older memlm or by hand: add what is missing; a user's own choice stays.
        for key, value in experiment_tags(view).items():
            if key not in found.tags:
                client.set_experiment_tag(found.experiment_id, key, value)
        return found.experiment_id
    # A SQLite store would put artifacts in ./mlruns of whatever folder the creator ran in; keep them beside
    # the database instead, so every run of the experiment, from any folder, writes to one place.
    location = None
    if uri.startswith("sqlite:///"):
        location = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
    try:
        return client.create_experiment(cfg.experiment, artifact_location=location,
                                        tags=experiment_tags(view))
    except MlflowException as exc:  # another process created it between our two calls
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(cfg.experiment).experiment_id


def experiment_tags(view: RunsView | None = TRAINING_VIEW) -> dict[str, str]:
    """The tags of an experiment memlm creates: open on the runs table, with `view` of it saved (column keys as
    MLflow's UI writes them: "metrics.`loss`", "tags.`arch`", "attributes.`Duration`")."""
    tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
    if view is not None:
        now = int(time.time() * 1000)
        state = {"selectedColumns": list(view.columns)}
        envelope = {"name": view.name, "createdAt": now, "updatedAt": now, "state": json.dumps(state)}
        tags[RUNS_VIEW_TAG] = json.dumps(envelope)
    return tags


def default_run_label(arch: str, run_dir: Path) -> str:
    """The run folder's name, led by the arch unless the name already holds it: "lamemo", "txl-exp3"."""
    name = Path(run_dir).resolve().name
    return name if arch.lower() in name.lower() else f"{arch}-{name}"


def tokenizer_kind(data_path: str | os.PathLike) -> str:
    """The prepared data's tokenizer kind (bytes, word, spm-unigram, ...) from its manifest, or "unknown"."""
    import json

    if is_remote(data_path):  # a tag is not worth a network read; compare_table reads the manifest where needed
        return "unknown"
    try:
        return str(json.loads((Path(data_path) / "manifest.json").read_text())["tokenizer"]["kind"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def git_revision() -> str:
    """HEAD of the repository this code runs from, or "unknown" (no git, not a checkout, an installed copy)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


@contextlib.contextmanager
def without_credentials(path: Path):
    """The config artifacts as MLflow gets them: a copy with a URL's credentials redacted (data.path may carry a
    user:password@ or a ?token=, data_pipeline/remote/location.py) where the file has any; else the file itself."""
    if path.name not in CONFIG_ARTIFACTS:
        yield path
        return
    text = path.read_text()
    shown = redact(text)
    if shown == text:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="memlm-artifact-") as folder:
        copy = Path(folder) / path.name
        copy.write_text(shown)
        yield copy


def _param_value(value: Any) -> str:
    return str(value)[:MAX_PARAM_VALUE]


def error_reason(exc: BaseException, limit: int = 300) -> str:
    """One readable piece for a log line: the operating system's reason where the failure was the network's
    (MLflow wraps "Connection refused" three exceptions deep, after the whole request URL), else the exception's
    type and the first line of its message, shortened at a word boundary."""
    import socket

    seen, inner = set(), exc
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        if isinstance(inner, (ConnectionError, TimeoutError, socket.gaierror)):
            return f"cannot reach the server: {inner.strerror or inner}"
        inner = inner.__cause__ or inner.__context__
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return text


def _redact(uri: str) -> str:
    """The URI without a password, for log lines."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def log_eval_result(config: RunConfig, run_dir: Path, result: dict[str, Any], json_path: Path) -> bool:
    """`memlm eval`: add an evaluation to the training run's MLflow run (rank 0 calls it; True when logged).

    Metrics `{split}_nll`, `{split}_ppl`, `{split}_bpc` at the checkpoint's step, so `memlm compare` finds dev and
    test perplexity on the run itself; the JSON goes under the artifact folder `eval/`. An evaluation at other
    lengths than the run was trained with (longer memory, another target length) gets its own metric names, e.g.
    `test_ppl_tgt64_mem256`: it is a different measurement and must not replace the run's own number.
    Like Tracker, a failing MLflow call warns once and the evaluation result stands.
    """
    id_file = Path(run_dir) / RUN_ID_FILE
    if not config.tracking.enabled or not id_file.is_file():
        return False
    run_id = id_file.read_text().strip()
    set_environment()
    uri_file = Path(run_dir) / URI_FILE
    # The store the run was created in, wherever `memlm eval` runs from now; older run folders lack the file.
    uri = uri_file.read_text().strip() if uri_file.is_file() else config.tracking.resolved_uri()
    suffix = _eval_suffix(config, result)
    step = int(result.get("step") or 0)
    try:
        from mlflow.entities import Metric

        client = open_client(uri, create=False)
        client.get_run(run_id)  # a run id from another store (say, a relative ./mlflow.db elsewhere) fails here
        now = int(time.time() * 1000)
        metrics = [Metric(f"{result['split']}_{key}{suffix}", float(result[key]), now, step)
                   for key in ("nll", "ppl", "bpc") if key in result]
        client.log_batch(run_id, metrics=metrics, synchronous=True)
        client.log_artifact(run_id, str(json_path), "eval")
    except Exception as exc:  # noqa: BLE001 - the evaluation itself succeeded; tracking must not undo that
        log.warning("MLflow tracking at %s failed (%s); evaluation of %s not logged to run %s (the JSON is at %s)",
                    _redact(uri), error_reason(exc), run_dir, run_id, json_path)
        return False
    return True


def _eval_suffix(config: RunConfig, result: dict[str, Any]) -> str:
    """"" when evaluated as trained; else the settings that differ, e.g. "_tgt64_mem256" or "_clamp100_same"."""
    model, ev = config.model, config.eval
    suffix = ""
    if (result.get("tgt_len"), result.get("mem_len")) != (model.tgt_len, model.mem_len):
        suffix += f"_tgt{result.get('tgt_len')}_mem{result.get('mem_len')}"
    if ev.clamp_len is not None and ev.clamp_len != model.clamp_len:
        suffix += f"_clamp{ev.clamp_len}"
    if ev.same_length is not None and ev.same_length != model.same_length:
        suffix += "_same" if ev.same_length else "_notsame"
    return suffix
