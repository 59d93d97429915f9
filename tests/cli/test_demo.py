"""`memlm demo` end to end with a tiny budget: stdlib corpus, DeepSpeed training, test evaluation, MLflow runs."""

from __future__ import annotations

import json
import math
import re
from argparse import Namespace

import pytest


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, monkeypatch, capsys):
    """One arch, then a second demo into the same folder. The README's test runs the demo as written (three archs)
    and checks its table, memory-effect lines and MLflow runs (tests/cli/test_readme.py: check_demo_output)."""
    from memlm import demo

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MEMLM_DEMO_WIKITEXT", raising=False)
    # Smaller caps keep the test quick; the default demo uses a few MB.
    monkeypatch.setattr(demo, "TRAIN_BYTES", 300_000)
    monkeypatch.setattr(demo, "HELD_OUT_BYTES", 12_000)
    assert demo.main(Namespace(steps=3, out="runs/demo", archs=("txl",))) == 0
    captured = capsys.readouterr()
    out = captured.out
    # MLflow's start-up lines (a fresh store: "Creating initial MLflow database tables") go to OUT/library.log.
    assert "INFO mlflow" not in captured.out + captured.err, captured.err
    assert "Creating initial MLflow database tables" in (tmp_path / "runs/demo/library.log").read_text()
    m = re.search(r"^txl\s+([\d,]+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", out, re.M)
    assert m, out
    params, steps, loss, nll, bpc, rate = (float(x.replace(",", "")) for x in m.groups())
    assert all(math.isfinite(v) for v in (params, loss, nll, bpc, rate)) and steps == 3 and 0 < nll < 10
    assert "Equal steps and tokens for every arch (3 steps, 1,536 training tokens each)" in out
    results = json.loads((tmp_path / "runs/demo/results.json").read_text())
    assert {r["tokens"] for r in results} == {3 * 8 * 64}
    from mlflow import MlflowClient

    from memlm.invocation import memlm_command

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("memlm-demo")
    view = (f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs?viewStateShareKey=memlm"
            "&workflowType=machine_learning")
    assert f"{memlm_command()} ui   (then {view})" in out  # memlm's saved view of the runs table
    assert f"{memlm_command()} compare --experiment memlm-demo" in out
    (first,) = client.search_runs([exp.experiment_id])
    assert first.info.status == "FINISHED" and first.data.tags.get("arch") == "txl"
    assert re.fullmatch(r"demo-txl-stdlib-bytes-[0-9a-f]{6}", first.info.run_name) and first.info.run_name in out

    # A second run into the same folder replaces the demo's own corpus, data and runs; its MLflow run is new and
    # named apart from the first demo's.
    assert demo.main(Namespace(steps=2, out="runs/demo", archs=("txl",))) == 0
    names_now = [r.info.run_name for r in client.search_runs([exp.experiment_id])]
    assert len(names_now) == 2 and len(set(names_now)) == 2, names_now


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
