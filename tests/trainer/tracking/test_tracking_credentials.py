"""A data.path URL with a user:password@ and a ?token= (data_pipeline/remote/) reaches MLflow redacted: the params and
the config artifacts, while the run's own config.yaml (what --resume reads) keeps it."""

from __future__ import annotations

from pathlib import Path

import pytest

from memlm.trainer.config.run_config import config_to_yaml, load_config
from memlm.trainer.tracking.tracker import Tracker

SECRET, TOKEN = "pw-0f9e8d7c6b5a", "tok-a1b2c3d4e5f6"


@pytest.mark.slow  # an MLflow SQLite store: 9 s on 2 busy cores
def test_url_credentials_never_reach_mlflow(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    url = f"https://reader:{SECRET}@cdn.example/data/wt103?token={TOKEN}"
    cfg = load_config("tiny/txl", [f"data.path={url}", "tracking.enabled=true", f"tracking.uri={uri}",
                                   f"data.shards.train=https://cdn.example/x/train-{{0..1}}.tar?sig={TOKEN}"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    tracker = Tracker(cfg.tracking, run_dir, 0, cfg)
    tracker.log_artifact(run_dir / "config.yaml")
    tracker.finish()

    client = MlflowClient(tracking_uri=uri)
    params = client.get_run(tracker.run_id).data.params
    assert params["data.path"] == "https://***@cdn.example/data/wt103?token=***"
    assert params["data.shards.train"] == "https://cdn.example/x/train-{0..1}.tar?sig=***"
    logged = Path(client.download_artifacts(tracker.run_id, "config.yaml", str(tmp_path / "down"))).read_text()
    assert "https://***@cdn.example/data/wt103?token=***" in logged
    for text in (logged, *params.values()):
        assert SECRET not in text and TOKEN not in text
    assert SECRET in (run_dir / "config.yaml").read_text()  # the run folder's copy is the run's, unchanged
