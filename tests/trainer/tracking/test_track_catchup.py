"""Nothing lost when the MLflow server is away: a real `mlflow server` on 127.0.0.1, stopped and started again while
tiny in-process trainings run (their reporter, called after each metrics row is logged, flips the server at chosen
steps), and `memlm track RUN_DIR`.

The record is the run folder: metrics.jsonl (every key of every row but `step`, None values excepted) and
eval/stepN.json (valid_nll/ppl/bpc at step N). After the catch-up, the MLflow run holds exactly that: every key,
every step, once, with the same value. Three server starts (~5-10 s each) over one SQLite file in tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from support.training import make_data, overrides, preset

# `-m 'not slow'` leaves these out: a real mlflow server stopped and restarted, 69 s on 2 busy cores
pytestmark = pytest.mark.slow

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default ./mlflow.db would land here, not in the checkout
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")


class Server:
    """`mlflow server` on one port over one SQLite file, started and stopped as often as a test needs."""

    def __init__(self, root: Path, port: int):
        self.root, self.port = root, port
        self.uri = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts: list[float] = []  # seconds each start took until /health answered

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        began = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
             "--artifacts-destination", str(self.root / "server-artifacts")],
            cwd=self.root, env=env, stdout=subprocess.DEVNULL, stderr=(self.root / "server.log").open("ab"),
            start_new_session=True)  # its own process group: stop() ends the server and its workers together
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
            try:
                with opener.open(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() - began < 90, "mlflow server did not answer /health"
            time.sleep(0.25)
        self.starts.append(time.monotonic() - began)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None


def train(data: Path, out: Path, uri: str, steps: int, at_step: dict | None = None) -> list[float]:
    """A tiny txl run tracked at `uri`, in this process; at_step[N]() runs once step N's row has been logged.
    Returns how long each of the tracker's log_metrics calls took (seconds)."""
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.train import run
    from memlm.trainer.tracking.tracker import Tracker

    cfg = load_config(preset("txl"), overrides(
        data, tracking__enabled="true", tracking__uri=uri, tracking__experiment="catchup", train__steps=steps,
        train__save_every=0, train__eval_every=4, train__eval_batches=1, train__log_every=1))
    durations: list[float] = []
    original = Tracker.log_metrics

    def timed(self, step, metrics):
        began = time.perf_counter()
        original(self, step, metrics)
        durations.append(time.perf_counter() - began)

    def reporter(row: dict) -> None:
        if "loss" in row and row["step"] in (at_step or {}):
            at_step[row["step"]]()

    Tracker.log_metrics = timed
    try:
        run(cfg, out, reporter=reporter)
    finally:
        Tracker.log_metrics = original
    return durations


def recorded(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """What the run folder says MLflow should hold: key -> [(step, value)] in step order."""
    found: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key != "step" and value is not None:
                found.setdefault(key, {})[row["step"]] = float(value)
    for path in (run_dir / "eval").glob("step*.json"):
        result = json.loads(path.read_text())
        for key in ("nll", "ppl", "bpc"):
            found.setdefault(f"valid_{key}", {})[result["step"]] = float(result[key])
    return {key: sorted(values.items()) for key, values in found.items()}


def held(uri: str, run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric of the run folder's MLflow run: key -> [(step, value)] in step order, repeats included."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    keys = client.get_run(run_id).data.metrics
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in keys}


def track(run_dir: Path, capsys) -> tuple[int, str]:
    from memlm.cli import main

    capsys.readouterr()
    rc = main(["track", str(run_dir)])
    printed = capsys.readouterr()
    return rc, (printed.out + printed.err).strip()


def sent(line: str) -> int:
    found = re.search(r": (\d+) metric values sent", line)
    assert found, line
    return int(found.group(1))


def assert_complete(uri: str, run_dir: Path, status: str) -> None:
    from mlflow import MlflowClient

    assert held(uri, run_dir) == recorded(run_dir)
    client = MlflowClient(tracking_uri=uri)
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == status
    assert run.data.params["train.steps"] and run.data.tags["arch"] == "txl"
    artifacts = {a.path for folder in (None, "eval") for a in client.list_artifacts(run_id, folder)}
    expected = {"config.yaml", "ds_config.json", "eval"} | {f"eval/{p.name}" for p in (run_dir / "eval").glob("*")}
    assert artifacts == expected
    assert len(client.search_runs([run.info.experiment_id], f"tags.run_dir = '{run_dir.resolve()}'")) == 1


@pytest.mark.slow
def test_server_away_at_start_in_the_middle_and_at_the_end(tmp_path, monkeypatch, capsys):
    from memlm.trainer.runtime.distributed import free_port
    from memlm.trainer.tracking import tracker

    monkeypatch.setattr(tracker, "RETRY_FIRST_SECONDS", 0.0)  # every call tries the server: the worst case
    monkeypatch.setattr(tracker, "RETRY_MAX_SECONDS", 0.0)
    data = make_data(tmp_path)
    server = Server(tmp_path, free_port())
    try:
        # B never reaches the server: no MLflow run at all, and `memlm track` changes nothing while it is away.
        never = tmp_path / "never"
        down = train(data, never, server.uri, steps=6)
        assert not (never / "mlflow_run_id").exists()
        assert (never / "mlflow_run_status").read_text().strip() == "FINISHED"
        rc, line = track(never, capsys)
        assert rc == 2 and len(line.splitlines()) == 1, line
        assert line.startswith(f"memlm: error: cannot reach MLflow at {server.uri} (cannot reach the server: "), line
        assert not (never / "mlflow_run_id").exists()

        # A: away at the start (the run is created at step 4, once it answers), away again from step 6 to 9 (the
        # steps missed go when it is back, live), away at the end (steps 12-13 and the status wait for `track`).
        live = tmp_path / "live"
        train(data, live, server.uri, steps=13, at_step={3: server.start, 6: server.stop, 9: server.start,
                                                         11: server.stop})
        assert (live / "mlflow_run_id").is_file()
        server.start()
        run_id = (live / "mlflow_run_id").read_text().strip()
        # Live: every step up to the last one sent before the server stopped at 11 (10, or 11 when the first try
        # after the restart met a dropped keep-alive connection), each once; row 11 may wait in the batch buffer.
        partial, last = held(server.uri, live), max(step for step, _ in held(server.uri, live)["loss"])
        assert last >= 10 and partial == {key: [s for s in values if s[0] <= last]
                                          for key, values in recorded(live).items()}
        rc, line = track(live, capsys)
        assert rc == 0 and sent(line) > 0 and "status FINISHED" in line, line
        assert (live / "mlflow_run_id").read_text().strip() == run_id
        assert_complete(server.uri, live, "FINISHED")

        rc, line = track(never, capsys)
        rows = len((never / "metrics.jsonl").read_text().splitlines())
        assert rc == 0 and "new MLflow run" in line, line
        assert sent(line) == sum(len(v) for v in recorded(never).values())
        assert_complete(server.uri, never, "FINISHED")
        for run_dir in (never, live):  # again: nothing to add
            before = held(server.uri, run_dir)
            rc, line = track(run_dir, capsys)
            assert rc == 0 and sent(line) == 0 and "0 artifacts" in line and "status" not in line, line
            assert held(server.uri, run_dir) == before
    finally:
        server.stop()
    with capsys.disabled():
        print(f"\ncatch-up figures: {rows} rows / {sent_total(never)} metric values of the never-reached run sent "
              f"by `memlm track`; server starts {[round(s, 1) for s in server.starts]} s; tracker calls with the "
              f"server down: median {sorted(down)[len(down) // 2] * 1e3:.1f} ms, max {max(down) * 1e3:.1f} ms "
              f"over {len(down)} calls", file=sys.stderr)


def sent_total(run_dir: Path) -> int:
    return sum(len(v) for v in recorded(run_dir).values())


def test_backlog_past_the_queue_limit_is_sent_from_the_run_folder(tmp_path, monkeypatch):
    """An outage longer than the queue holds (MAX_QUEUED_METRICS, shrunk here): the calls past it are dropped from
    memory, and when the store answers again their steps are sent from metrics.jsonl, once each, in step order."""
    from mlflow import MlflowClient

    from memlm.trainer.config.run_config import config_from_dict
    from memlm.trainer.tracking import tracker as tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config_from_dict({"model": {"arch": "txl"}, "tracking": {"uri": uri, "experiment": "test"}})
    run_dir = tmp_path / "run"
    tracker = tracking.Tracker(cfg.tracking, run_dir, 0, cfg)
    monkeypatch.setattr(tracking, "RETRY_FIRST_SECONDS", 0.0)
    monkeypatch.setattr(tracking, "MAX_QUEUED_METRICS", 6)  # three rows of two metrics
    original = MlflowClient.log_batch

    def locked(*args, **kwargs):
        raise RuntimeError("database is locked")

    def row(step: int) -> None:  # as the trainer does: the file first, then the tracker
        values = {"loss": 10.0 / step, "lr": step * 1e-4}
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        tracker.log_metrics(step, values)

    row(1)
    monkeypatch.setattr(MlflowClient, "log_batch", locked)
    for step in range(2, 9):  # steps 2-4 queued, 5-8 past the limit
        row(step)
    monkeypatch.setattr(MlflowClient, "log_batch", original)
    row(9)
    tracker.finish()
    assert held(uri, run_dir) == recorded(run_dir)
    assert [step for step, _ in held(uri, run_dir)["loss"]] == list(range(1, 10))
