"""`memlm demo` end to end with a tiny budget: stdlib corpus, DeepSpeed training, test evaluation, MLflow runs."""

from __future__ import annotations

import json
import re
from argparse import Namespace

import pytest


@pytest.mark.slow
def test_a_second_demo_into_the_same_folder_starts_over(tmp_path, monkeypatch, capsys):
    """The demo run twice into one folder (one arch, 1 step, small corpus caps): the second replaces the demo's own
    corpus, data and runs, and its MLflow run is new and named apart from the first's. The demo as written (three
    archs: its table, memory-effect lines, MLflow runs, console and hints) is checked by tests/cli/test_readme.py
    (check_demo_output)."""
    from mlflow import MlflowClient

    from memlm import demo

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MEMLM_DEMO_WIKITEXT", raising=False)
    monkeypatch.setattr(demo, "TRAIN_BYTES", 100_000)  # the default demo reads a few MB
    monkeypatch.setattr(demo, "HELD_OUT_BYTES", 6_000)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    names = []
    for steps in (2, 1):
        assert demo.main(Namespace(steps=steps, out="runs/demo", archs=("txl",))) == 0
        out = capsys.readouterr().out
        m = re.search(r"^txl\s+([\d,]+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", out, re.M)
        assert m and int(m.group(2)) == steps, out
        results = json.loads((tmp_path / "runs/demo/results.json").read_text())
        assert [r["arch"] for r in results] == ["txl"] and results[0]["tokens"] == steps * 8 * 64
        exp = client.get_experiment_by_name("memlm-demo")
        latest = max(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)
        assert latest.info.status == "FINISHED" and latest.data.tags.get("arch") == "txl"
        assert re.fullmatch(r"demo-txl-stdlib-bytes-[0-9a-f]{6}", latest.info.run_name) and latest.info.run_name in out
        names.append(latest.info.run_name)
    # the second demo's rows are its own: 1 step in metrics.jsonl, not the first demo's 2 followed by 1
    steps_logged = [json.loads(line)["step"] for line in (tmp_path / "runs/demo/runs/txl/metrics.jsonl").open()]
    assert steps_logged == [1], steps_logged
    assert len(client.search_runs([exp.experiment_id])) == 2 and len(set(names)) == 2, names


def test_memory_effect_and_tail_loss_are_computed_from_the_rows():
    from memlm import demo

    rows = [{"arch": "transformer", "test_nll": 2.0}, {"arch": "txl", "test_nll": 1.9},
            {"arch": "lamemo", "test_nll": 2.1}]
    text = demo.memory_effect(rows, steps=3000)
    assert "txl        -0.100 nats/token (-5.0%)  better" in text
    assert "lamemo     +0.100 nats/token (+5.0%)  not better" in text
    assert "has not paid off" not in text
    rows[1]["test_nll"] = 2.05
    assert "At 10 steps memory has not paid off yet" in demo.memory_effect(rows, steps=10)
    metrics = [{"step": s, "loss": float(s)} for s in range(10, 101, 10)]
    assert demo.tail_mean_loss(metrics, 100) == 100.0  # the last tenth: steps 91..100 -> the step-100 row
    assert demo.tail_mean_loss(metrics, 200) == 100.0  # a short run: its last row


def test_the_token_count_is_the_trained_one():
    """Issue 32: the demo announced 3,000 x 8 x 64 = 1,536,000 tokens and trained 1,534,347 (a document's last
    segment is padded, and padding is not trained on): the results' heading gives the trained count, the one
    metrics.jsonl and MLflow have, and says where the rest went."""
    from memlm.demo import equal_tokens_line

    rows = [{"arch": arch, "tokens": 1_534_347} for arch in ("transformer", "txl", "lamemo")]
    assert equal_tokens_line(3000, 1_536_000, rows) == (
        "Equal steps and tokens for every arch (3,000 steps, 1,534,347 training tokens each; the other 1,653 of the "
        "1,536,000 positions were documents' end padding):")
    assert equal_tokens_line(3, 1536, [{"arch": "txl", "tokens": 1536}]) == (
        "Equal steps and tokens for every arch (3 steps, 1,536 training tokens each):")
