"""`memlm demo` end to end with a tiny budget: stdlib corpus, DeepSpeed training, test evaluation, MLflow runs."""

from __future__ import annotations

import math
import re
from argparse import Namespace


def test_demo_end_to_end(tmp_path, monkeypatch, capsys):
    from trainer import demo

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MEMLM_DEMO_WIKITEXT", raising=False)
    # Smaller caps keep the test quick; the default demo uses a few MB.
    monkeypatch.setattr(demo, "TRAIN_BYTES", 300_000)
    monkeypatch.setattr(demo, "HELD_OUT_BYTES", 12_000)
    args = Namespace(seconds=0.5, out="runs/demo", archs=("txl", "lamemo"))
    assert demo.main(args) == 0
    out = capsys.readouterr().out

    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(txl|lamemo)\s+([\d,]+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", line)
        if m:
            rows[m.group(1)] = [float(x.replace(",", "")) for x in m.groups()[1:]]
    assert set(rows) == {"txl", "lamemo"}, out
    for arch, values in rows.items():
        assert all(math.isfinite(v) for v in values), (arch, values)
        params, steps, loss, nll, bpc, rate = values
        assert params > 0 and steps >= demo.MIN_STEPS and 0 < nll < 10 and rate > 0
    assert "memlm ui   (http://127.0.0.1:5000)" in out and "memlm compare --experiment memlm-demo" in out

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("memlm-demo")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    by_arch = {r.data.tags.get("arch"): r for r in runs}
    assert {"txl", "lamemo"} <= set(by_arch)
    for r in by_arch.values():
        assert r.info.status == "FINISHED"
        assert "loss" in r.data.metrics and "test_nll" in r.data.metrics
    assert (tmp_path / "runs/demo/results.json").is_file()

    # A second run into the same folder replaces the demo's own corpus, data and runs.
    assert demo.main(Namespace(seconds=0.1, out="runs/demo", archs=("txl",))) == 0
