"""`memlm train` with MLflow tracking on (docs/design.md §4): a SQLite store in tmp_path holds the run's flattened
config
params, metrics at logged steps, artifacts (config.yaml, ds_config.json, eval JSON) and tags (arch, git revision);
a dead tracking server costs one warning, never the training (metrics.jsonl stays complete). In-process runs.
"""

from __future__ import annotations

import logging
import os

import pytest

from support.training import make_data, metrics, train_in_process

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")
STEPS = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("tracking_data"))


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default ./mlflow.db or ./mlruns would land here, not in the checkout
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")


def test_tracked_run_holds_params_metrics_artifacts_tags(data, tmp_path):
    from mlflow import MlflowClient

    from memlm.trainer.config.run_config import flatten, load_config
    from support.training import overrides, preset

    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    out = tmp_path / "run"
    extra = dict(tracking__enabled="true", tracking__uri=uri, tracking__experiment="launch-test",
                 train__steps=STEPS, train__save_every=0, train__eval_every=2, train__eval_batches=2,
                 train__log_every=1)
    rows = train_in_process("txl", data, out, **extra)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))

    run_id = (out / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    cfg = load_config(preset("txl"), overrides(data, **extra))
    expected = {k: str(v)[:6000] for k, v in flatten(cfg).items()}
    assert run.data.params == expected
    assert run.data.params["model.arch"] == "txl" and run.data.params["train.steps"] == str(STEPS)

    for key in ("loss", "lr", "tokens_per_s", "grad_norm", "ppl"):
        history = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), key
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert losses == pytest.approx({r["step"]: r["loss"] for r in rows})
    assert sorted(m.step for m in client.get_metric_history(run_id, "valid_nll")) == [2, 4]

    tags = run.data.tags
    assert tags["arch"] == "txl"
    assert tags["git_revision"] and tags["git_revision"] == tags["mlflow.source.git.commit"]

    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "ds_config.json", "eval"} <= top, top
    evals = {a.path for a in client.list_artifacts(run_id, "eval")}
    assert evals == {"eval/step2.json", "eval/step4.json"}, evals


def test_dead_tracking_server_never_stops_training(data, tmp_path, caplog):
    from memlm.trainer.runtime.distributed import free_port

    out = tmp_path / "run"
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="memlm.trainer.tracking.tracker"):
        rows = train_in_process("txl", data, out, tracking__enabled="true", tracking__uri=uri,
                                train__steps=STEPS, train__save_every=0, train__log_every=1)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert metrics(out) == rows
    warned = [r for r in caplog.records if r.name == "memlm.trainer.tracking.tracker" and r.levelno == logging.WARNING]
    messages = [r.getMessage() for r in warned]
    assert len(warned) == 2 and "training goes on" in messages[0] and "memlm track" in messages[1], messages
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{STEPS}"


def test_eval_from_another_folder_logs_to_the_runs_own_store(data, tmp_path, monkeypatch):
    """A run tracked in the default ./mlflow.db of folder A, evaluated from folder B: the test metrics land on the
    run in A's store (the run folder records its store), and B gets no store of its own."""
    from mlflow import MlflowClient

    from memlm.cli import main

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    out = tmp_path / "run"
    train_in_process("txl", data, out, tracking__enabled="true", tracking__experiment="default-store",
                     train__steps=2, train__save_every=0)
    monkeypatch.chdir(tmp_path / "b")
    assert main(["eval", str(out), "--split", "test", "--json", str(tmp_path / "test.json")]) == 0

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}")
    run = client.get_run((out / "mlflow_run_id").read_text().strip())
    assert {"test_nll", "test_ppl", "test_bpc"} <= set(run.data.metrics)
    assert not (tmp_path / "b" / "mlflow.db").exists()
