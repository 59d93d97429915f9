"""trainer.tracking.tracker against real MLflow: a SQLite store in tmp_path, and one real `mlflow server` on loopback.

Everything stays on 127.0.0.1 or in tmp_path (the suite runs in a loopback-only network namespace).
"""

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from memlm.trainer.config.run_config import config_from_dict, flatten
from memlm.trainer.tracking import tracker as tracking
from memlm.trainer.tracking.tracker import RUN_ID_FILE, Tracker


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    # The default store is ./mlflow.db: run in tmp_path so nothing lands in the checkout. The tracker sets the
    # HTTP env vars with setdefault; clearing them here lets monkeypatch restore the environment afterwards.
    monkeypatch.chdir(tmp_path)
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")


def make_config(uri="", enabled=True, **overrides):
    return config_from_dict({"model": {"arch": "txl"}, "tracking": {"uri": uri, "enabled": enabled,
                                                                    "experiment": "test"}}, overrides)


def sqlite_uri(tmp_path):
    return f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_values(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_params_metrics_artifacts_tags_round_trip(tmp_path, monkeypatch):
    (tmp_path / "store").mkdir()
    cfg = make_config(sqlite_uri(tmp_path), **{"tracking.run_name": "round-trip"})
    calls = []
    original = MlflowClient.log_batch

    def counting(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        if metrics:
            calls.append(len(metrics))
        return original(self, run_id, metrics, params, tags, synchronous)

    monkeypatch.setattr(MlflowClient, "log_batch", counting)
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model:\n  arch: txl\n")

    tracker = Tracker(cfg.tracking, run_dir, 0, cfg)
    assert tracker.run_id and (run_dir / RUN_ID_FILE).read_text().strip() == tracker.run_id
    steps = 2 * tracking.FLUSH_EVERY_CALLS + 5
    for step in range(steps):
        tracker.log_metrics(step, {"loss": 10.0 - step, "lr": 1e-3})
    tracker.log_artifact(run_dir / "config.yaml")
    tracker.log_artifact(run_dir / "config.yaml", artifact_path="configs")
    tracker.set_tags({"phase": "test"})
    tracker.log_artifact(run_dir / "missing.png")  # skipped with a warning; tracking goes on
    assert tracker.active
    tracker.finish()
    tracker.finish()  # idempotent
    tracker.log_metrics(steps, {"loss": 0.0})  # after finish: ignored, no error

    # Batched: one log_batch per FLUSH_EVERY_CALLS calls plus the rest at finish, not one per call.
    assert calls == [2 * tracking.FLUSH_EVERY_CALLS] * 2 + [2 * 5]

    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "round-trip"
    expected = {k: str(v) for k, v in flatten(cfg).items()}
    assert run.data.params == expected
    assert run.data.params["train.adam_betas"] == "[0.9, 0.999]"
    assert metric_values(client, tracker.run_id, "loss") == [(s, 10.0 - s) for s in range(steps)]
    tags = run.data.tags
    assert tags["arch"] == "txl" and tags["phase"] == "test" and tags["run_dir"] == str(run_dir.resolve())
    revision = tracking.git_revision()
    assert tags["git_revision"] == revision and (revision == "unknown" or len(revision) == 40)
    paths = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert paths == {"config.yaml", "configs"}
    assert [a.path for a in client.list_artifacts(tracker.run_id, "configs")] == ["configs/config.yaml"]
    # Artifacts live beside the database, not in the folder the run was started from.
    assert not (tmp_path / "mlruns").exists()
    assert list((tmp_path / "store" / "mlartifacts").rglob("config.yaml"))


def test_default_store_is_sqlite_in_working_folder(tmp_path):
    cfg = make_config()
    tracker = Tracker(cfg.tracking, tmp_path / "run", 0, cfg)
    tracker.log_metrics(1, {"loss": 1.5})
    tracker.finish("FAILED")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(tracker.run_id)
    # Default name: the arch (the folder's name lacks it), the folder's name, the start of the run id.
    assert run.info.status == "FAILED" and run.info.run_name == f"txl-run-{tracker.run_id[:6]}"
    assert metric_values(client, tracker.run_id, "loss") == [(1, 1.5)]


@pytest.mark.slow
def test_resume_continues_the_same_run(tmp_path):
    # The trainer says on the console what a resume changed; the tracker's own word on its params is an INFO record
    # (read here from its logger: routing the library loggers raises the level of any console handler, caplog's too).
    said: list[logging.LogRecord] = []
    listener = logging.Handler(logging.INFO)
    listener.emit = said.append
    logger = logging.getLogger("memlm.trainer.tracking.tracker")
    logger.addHandler(listener)
    level, logger.level = logger.level, logging.INFO
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    cfg = make_config(uri)
    first = Tracker(cfg.tracking, run_dir, 0, cfg)
    first.log_metrics(1, {"loss": 3.0})
    first.finish("KILLED")

    # The resumed run asks for more steps: params cannot change in MLflow, so the first value stays and
    # tracking carries on (no switch to no-op).
    longer = make_config(uri, **{"train.steps": 2000})
    with Tracker(longer.tracking, run_dir, 0, longer) as second:
        assert second.run_id == first.run_id and second.active
        second.log_metrics(2, {"loss": 2.0})
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "1000"
    assert metric_values(client, first.run_id, "loss") == [(1, 3.0), (2, 2.0)]
    assert len(client.search_runs([run.info.experiment_id])) == 1
    logger.removeHandler(listener)
    logger.setLevel(level)
    assert any("train.steps" in record.getMessage() for record in said)

    # A run id from another store is not an error: a new run starts and the file points to it.
    other = make_config(f"sqlite:///{tmp_path / 'other.db'}")
    third = Tracker(other.tracking, run_dir, 0, other)
    assert third.active and third.run_id != first.run_id
    assert (run_dir / RUN_ID_FILE).read_text().strip() == third.run_id
    third.finish()


def test_deleted_experiment_is_restored(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    client.delete_experiment(client.create_experiment("test"))
    cfg = make_config(uri)
    tracker = Tracker(cfg.tracking, tmp_path / "run", 0, cfg)
    assert tracker.active
    tracker.finish()
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


@pytest.mark.parametrize("rank, enabled", [(1, True), (0, False)])
def test_other_ranks_and_disabled_write_nothing(tmp_path, rank, enabled):
    cfg = make_config(enabled=enabled)
    run_dir = tmp_path / "run"
    tracker = Tracker(cfg.tracking, run_dir, rank, cfg)
    assert tracker.run_id is None and not tracker.active
    (tmp_path / "a.txt").write_text("x")
    tracker.log_metrics(1, {"loss": 1.0})
    tracker.log_artifact(tmp_path / "a.txt")
    tracker.set_tags({"a": "b"})
    tracker.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_unreachable_server_warns_once_queues_and_says_how_to_catch_up(tmp_path, caplog):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = make_config(uri)
    run_dir = tmp_path / "run"
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        tracker = Tracker(cfg.tracking, run_dir, 0, cfg)
        for step in range(3 * tracking.FLUSH_EVERY_CALLS):
            tracker.log_metrics(step, {"loss": 1.0})
        tracker.set_tags({"a": "b"})
        tracker.finish("FAILED")
    assert time.monotonic() - start < 5
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "memlm.trainer.tracking.tracker" and r.levelno == logging.WARNING]
    # The reason in words, not the request URL and urllib3's repr cut at 300 characters; then, as the run ends,
    # what is still missing and the command that sends it.
    assert warnings == [
        f"MLflow tracking at {uri} failed (cannot reach the server: Connection refused); training goes on and tries "
        f"again every {tracking.RETRY_FIRST_SECONDS:.0f}-{tracking.RETRY_MAX_SECONDS:.0f} s, nothing is lost "
        "(metrics.jsonl in the run folder stays complete)",
        f"MLflow tracking at {uri} is still unreachable as the run ends: the run itself (its params and tags), "
        f"{3 * tracking.FLUSH_EVERY_CALLS} metric values of steps 0-{3 * tracking.FLUSH_EVERY_CALLS - 1} and the "
        f"status FAILED are not logged; `memlm track {run_dir}` logs them from the run folder once the server is back"]
    assert not tracker.connected and tracker.run_id is None
    # The run folder says where the run belongs and how it ended, for `memlm track`.
    assert (run_dir / tracking.URI_FILE).read_text().strip() == uri
    assert (run_dir / tracking.STATUS_FILE).read_text().strip() == "FAILED"
    assert not (run_dir / RUN_ID_FILE).exists()
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"


def test_failure_mid_run_warns_once_then_catches_up(tmp_path, monkeypatch, caplog):
    """A store that fails for a while (here: a locked database) loses nothing: the metrics queued meanwhile go, in
    step order and once each, when it answers again."""
    cfg = make_config(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = Tracker(cfg.tracking, tmp_path / "run", 0, cfg)
    monkeypatch.setattr(tracking, "RETRY_FIRST_SECONDS", 0.0)  # try again at every call
    original = MlflowClient.log_batch

    def broken(*args, **kwargs):
        raise RuntimeError("database is locked")

    monkeypatch.setattr(MlflowClient, "log_batch", broken)
    steps = 3 * tracking.FLUSH_EVERY_CALLS
    with caplog.at_level(logging.WARNING):
        for step in range(steps):
            tracker.log_metrics(step, {"loss": float(step)})
        assert not tracker.connected
        monkeypatch.setattr(MlflowClient, "log_batch", original)
        tracker.log_metrics(steps, {"loss": float(steps)})
        tracker.finish()
    warnings = [r.getMessage() for r in caplog.records if r.name == "memlm.trainer.tracking.tracker"]
    assert len(warnings) == 2 and "database is locked" in warnings[0] and "answers again" in warnings[1], warnings
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    assert metric_values(client, tracker.run_id, "loss") == [(s, float(s)) for s in range(steps + 1)]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def tracker_experiment(uri: str) -> str:
    return MlflowClient(tracking_uri=uri).get_experiment_by_name("test").experiment_id


def test_default_run_names_tell_runs_apart_and_a_chosen_one_stays(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    names = []
    for folder in ("a/lamemo", "b/lamemo", "c/exp3"):  # two folders of the same name, one without the arch
        cfg = make_config(uri, **{"model.arch": "lamemo"})
        with Tracker(cfg.tracking, tmp_path / folder, 0, cfg) as tracker:
            pass
        names.append(MlflowClient(tracking_uri=uri).get_run(tracker.run_id).info.run_name)
        assert names[-1].endswith(f"-{tracker.run_id[:tracking.RUN_ID_CHARS]}"), names
    assert [n[:-7] for n in names] == ["lamemo", "lamemo", "lamemo-exp3"] and len(set(names)) == 3
    chosen = make_config(uri, **{"tracking.run_name": "trial_0001"})  # the sweep names its trials itself
    with Tracker(chosen.tracking, tmp_path / "d", 0, chosen) as tracker:
        pass
    assert MlflowClient(tracking_uri=uri).get_run(tracker.run_id).info.run_name == "trial_0001"


def test_experiments_carry_a_saved_runs_view_the_ui_reads(tmp_path):
    """The MLflow UI lists an experiment tag `mlflow.sharedViewState.<key>` as a saved view of the runs table when
    its value is {"name": str, "createdAt": number, "state": JSON string} (mlflow/server/js: the saved-view
    envelope), and shows the state's selectedColumns ("metrics.`key`", "tags.`key`", "attributes.`Name`")."""
    import json

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment(tracking.ensure_experiment(make_config(uri).tracking, client))
    view = json.loads(experiment.tags[tracking.RUNS_VIEW_TAG])
    assert tracking.RUNS_VIEW_TAG == f"mlflow.sharedViewState.{tracking.RUNS_VIEW_KEY}"
    assert isinstance(view["name"], str) and isinstance(view["createdAt"], int) and isinstance(view["state"], str)
    columns = json.loads(view["state"])["selectedColumns"]
    # The metrics the trainer and `memlm eval` log, the tags the Tracker sets.
    for key in ("valid_ppl", "test_ppl", "loss", "tokens", "tokens_per_s"):
        assert f"metrics.`{key}`" in columns, columns
    assert {"tags.`arch`", "tags.`tokenizer`"} <= set(columns)

    # An experiment made before (by hand, or an older memlm) gets the view once; a view the user edited stays.
    old = client.create_experiment("older")
    older = make_config(uri, **{"tracking.experiment": "older"}).tracking
    tracking.ensure_experiment(older, client)
    assert tracking.RUNS_VIEW_TAG in client.get_experiment(old).tags
    client.set_experiment_tag(old, tracking.RUNS_VIEW_TAG, "edited in the UI")
    tracking.ensure_experiment(older, client)
    assert client.get_experiment(old).tags[tracking.RUNS_VIEW_TAG] == "edited in the UI"


def test_error_reason_is_readable_and_never_cut_mid_word():
    class Wrapped(Exception):
        pass

    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as inner:
            raise Wrapped("API request to http://h:5000/api/2.0/mlflow/runs/create failed with " + "x" * 400) from inner
    except Wrapped as exc:
        assert tracking.error_reason(exc) == "cannot reach the server: Connection refused"
    long = RuntimeError("database " + "locked again " * 40 + "\nsecond line")
    reason = tracking.error_reason(long)
    assert reason.startswith("RuntimeError: database locked again") and reason.endswith(" ...")
    assert reason[:-4].split()[-1] in ("locked", "again")  # whole words only
    assert len(reason) <= 300 + 4 and "second line" not in reason


def test_redacts_password_in_warnings():
    assert tracking._redact("http://user:secret@host:5000/x") == "http://user:***@host:5000/x"
    assert tracking._redact("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"


@pytest.mark.slow
def test_real_mlflow_server(tmp_path, capfd, monkeypatch):
    """Slower (~15 s: the server's start-up): params and metrics reach a real tracking server over HTTP."""
    # `memlm compare` run in this process by an earlier test turns MLflow's link printing off process-wide.
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # skips the job runner: faster start
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server-artifacts")],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"))
    try:
        deadline = time.monotonic() + 45
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not answer /health"
            time.sleep(0.25)

        cfg = make_config(uri)
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "note.txt").write_text("hello")
        tracker = Tracker(cfg.tracking, run_dir, 0, cfg)
        for step in range(5):
            tracker.log_metrics(step, {"loss": float(step)})
        tracker.log_artifact(run_dir / "note.txt")
        capfd.readouterr()
        tracker.finish()
        assert tracker.run_id
        # MLflow prints "View run NAME at: URL" when a run on a server ends: into the run's library.log.
        printed = capfd.readouterr()
        assert "View run" not in printed.out + printed.err, printed
        link = f"/#/experiments/{tracker_experiment(uri)}/runs/{tracker.run_id}"
        assert link in (run_dir / "library.log").read_text()

        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(tracker.run_id)
        assert run.info.status == "FINISHED"
        assert run.data.params["model.arch"] == "txl" and run.data.tags["arch"] == "txl"
        assert metric_values(client, tracker.run_id, "loss") == [(s, float(s)) for s in range(5)]
        assert [a.path for a in client.list_artifacts(tracker.run_id)] == ["note.txt"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=5)


@pytest.mark.slow
def test_parallel_trainings_share_a_fresh_sqlite_store(tmp_path):
    """Three processes open the same not-yet-existing ./mlflow.db at once (the demo's parallel trainings): the
    first creates and migrates it under a lock, none finds it half-migrated, all create their runs in it."""
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = ("import sys; from memlm.trainer.config.run_config import TrackingConfig; "
            "from memlm.trainer.tracking.tracker import ensure_experiment, open_client; c = open_client(sys.argv[1]); "
            "e = ensure_experiment(TrackingConfig(experiment='shared', uri=sys.argv[1]), c); "
            "print(c.create_run(e).info.run_id)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    procs = [subprocess.Popen([sys.executable, "-c", code, uri], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("shared")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on its runs in the UI
    assert {r.info.run_id for r in client.search_runs([experiment.experiment_id])} == {o.strip() for o, _ in outs}
