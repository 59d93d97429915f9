"""`memlm longeval` end to end (real runs trained on a real qa1 corpus, the session's local Ray, MLflow on SQLite),
and its scorer on hand-made cases (an oracle model whose every prediction is chosen by the test)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from support.training import make_data, train_in_process

# `-m 'not slow'` leaves these out: Ray evaluations of trained runs, 86 s on 2 busy cores (load 5)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT2 = ROOT.parent / "shared" / "data" / "wikitext-2"


# ---------------------------------------------------------------- the scorer, against an oracle


@dataclass
class Position:
    seen: torch.Tensor  # [B] tokens read so far in the lane's sample


class Oracle(torch.nn.Module):
    """Predicts, at every position, the true next byte of the lane's sample (it is given the samples), except at
    the absolute positions in `mistakes[lane]`, where it predicts byte 0. It counts positions in its memory, which
    the scorer must reset at each sample's start and carry across segments."""

    def __init__(self, docs, mistakes, tgt_len):
        super().__init__()
        self.docs, self.mistakes = docs, mistakes
        self.cfg = type("Cfg", (), {"tgt_len": tgt_len})()
        self.group, self.next_group = 0, 0  # the first sample of the lanes the scorer is on, and of the next ones

    def init_memory(self, batch_size, device="cpu"):  # the scorer starts a group of lanes
        self.group, self.next_group = self.next_group, self.next_group + batch_size
        return Position(torch.zeros(batch_size, dtype=torch.long))

    def forward(self, tokens, memory, reset=None, targets=None, return_logits=False):
        from memlm.models.output import ModelOutput

        B, N = tokens.shape
        seen = torch.where(reset, 0, memory.seen)
        logits = torch.full((B, N, 256), -10.0)
        for lane in range(B):
            doc, bad = self.docs[self.group + lane], self.mistakes[self.group + lane]
            for t in range(N):
                at = int(seen[lane]) + t  # the input at this slot is doc[at - 1]: its target is doc[at]
                guess = 0 if at in bad or at >= len(doc) else int(doc[at])
                logits[lane, t, guess] = 0.0
        return ModelOutput(nll=torch.zeros(B, N), logits=logits, memory=Position(seen + N))


def test_the_scorer_counts_an_answer_right_only_when_every_answer_byte_is_predicted():
    from memlm.trainer.inference.longeval import answer_correct

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 256, size=n) for n in (37, 20, 61, 5, 16)]
    answers = [3, 1, 6, 2, 4]
    # lane 0 right; lane 1 wrong on its only answer byte; lane 2 wrong in the prompt only (still right);
    # lane 3 wrong on the first of its 2 answer bytes; lane 4 right (the second group of lanes)
    mistakes = [set(), {19}, {10, 40}, {3}, set()]
    model = Oracle(docs, mistakes, tgt_len=8)
    got = answer_correct(model, list(zip(docs, answers)), lanes=4, boundary_id=10)
    assert got == [True, False, True, False, True]


# ---------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from memlm.data_pipeline.prepare import prepare

    root = tmp_path_factory.mktemp("longeval")
    data = root / "qa1"
    prepare("task", None, data, task="qa1", task_options={"docs": "30,4,4", "length": 300,
                                                           "background": str(WIKITEXT2)}, workers=1, progress=False)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    out = {"txl": root / "runs" / "txl", "armt": root / "runs" / "armt"}
    train_in_process("txl", data, out["txl"], train__steps=3, tracking__enabled="true", tracking__uri=uri,
                     tracking__experiment="train")
    train_in_process("armt", data, out["armt"], train__steps=3)
    return {"root": root, "uri": uri, "runs": out, "text": make_data(root / "text")}


def longeval(run_dirs, out: Path, uri: str, *extra: str) -> int:
    from memlm.cli import main

    return main(["longeval", *map(str, run_dirs), "--lengths", "256,400", "--depths", "2", "--samples", "3",
                 "--out", str(out), "--uri", uri, "--experiment", "long", *extra])


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
def test_every_run_and_length_is_evaluated_written_logged_and_reused(runs, tmp_path, capsys):
    from mlflow import MlflowClient

    from memlm.trainer.inference.longeval import evaluate_length

    out = tmp_path / "out"
    assert longeval(runs["runs"].values(), out, runs["uri"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "qa1" and summary["lengths"] == [256, 400]  # the task the runs were trained on
    for name, run_dir in runs["runs"].items():
        for length in (256, 400):
            got = json.loads((out / name / f"qa1-test-len{length}.json").read_text())
            # The reference: the same evaluation in this process, one after another.
            want = evaluate_length(run_dir, "qa1", {"background": str(WIKITEXT2), "facts": 6}, length, 2, 3)
            assert {k: got[k] for k in want} == want
            assert got["samples"] == 6 and [c["depth_min"] for c in got["by_depth"]] == [0.0, 0.5]
        assert (out / name / "heatmap.png").stat().st_size > 0
    # Baselines of the same samples beside every accuracy: in each result, the summary, the CSV and the table.
    txl_results = {r["length"]: r for r in summary["runs"]["txl"]["results"]}
    assert [{k: row[k] for k in ("chance", "last_mentioned", "most_frequent")} for row in summary["baselines"]] == [
        {k: txl_results[n]["baselines"][k] for k in ("chance", "last_mentioned", "most_frequent")} for n in (256, 400)]
    assert all(r["baselines"] == txl_results[r["length"]]["baselines"] for r in summary["runs"]["armt"]["results"])
    rows = list(csv.DictReader((out / "longeval.csv").open()))
    assert len(rows) == 2 * 2 * 2 and {r["run"] for r in rows} == {"txl", "armt"}
    assert {r["baseline_chance"] for r in rows} == {"0.125"} and all(r["baseline_most_frequent"] for r in rows)
    assert "qa1 answer accuracy by sample length" in printed and "| txl |" in printed
    assert "| baseline: chance (1 / possible answers) | 12.5% | 12.5% |" in printed
    assert "| baseline: last answer word mentioned |" in printed
    client = MlflowClient(tracking_uri=runs["uri"])
    experiment = client.get_experiment_by_name("long")
    logged = client.search_runs([experiment.experiment_id])
    assert {r.info.run_name for r in logged} == {"txl-qa1", "armt-qa1"}
    for r in logged:
        history = client.get_metric_history(r.info.run_id, "longeval_acc")
        assert sorted(m.step for m in history) == [256, 400] and r.info.status == "FINISHED"
        floor = client.get_metric_history(r.info.run_id, "longeval_baseline_last_mentioned")
        assert {m.step: m.value for m in floor} == {n: txl_results[n]["baselines"]["last_mentioned"]
                                                    for n in (256, 400)}
    txl = next(r for r in logged if r.info.run_name == "txl-qa1")
    assert txl.data.tags["memlm.train_run_id"] == (runs["runs"]["txl"] / "mlflow_run_id").read_text().strip()
    # A rerun with the same settings evaluates nothing again.
    assert longeval(runs["runs"].values(), out, runs["uri"]) == 0
    assert "0 evaluation(s) to run" in capsys.readouterr().out


def test_a_run_of_a_text_corpus_needs_a_task(runs, tmp_path, capsys):
    from memlm.cli import main

    plain = tmp_path / "plain"
    train_in_process("txl", runs["text"], plain, train__steps=2)
    assert main(["longeval", str(plain), "--out", str(tmp_path / "o"), "--uri", runs["uri"]]) == 2
    err = capsys.readouterr().err
    assert "was trained on a text corpus, not a generated long-context task; pass --task" in err


@pytest.mark.parametrize("lengths,message", [("1k,abc", "--lengths '1k,abc': give sizes like"),
                                             ("32", "every length must be >= 64 tokens")])
def test_bad_lengths_are_one_line(runs, tmp_path, capsys, lengths, message):
    from memlm.cli import main

    rc = main(["longeval", str(runs["runs"]["txl"]), "--lengths", lengths, "--out", str(tmp_path)])
    assert rc == 2 and message in capsys.readouterr().err


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
def test_babilongs_own_files_are_scored_by_their_rule_and_logged(runs, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from mlflow import MlflowClient

    from memlm.cli import main
    from memlm.trainer.inference.longeval_babilong import evaluate_babilong

    rooms = ["bathroom", "bedroom", "garden", "hallway", "kitchen", "office"]
    folder = tmp_path / "babilong"
    for label, noise in (("0k", 0), ("1k", 12)):
        records = [{"input": "The wind blew. " * noise + f"Mary went to the {rooms[i]}. John went to the "
                    f"{rooms[i - 1]}.\nThe end.", "question": "Where is Mary?", "target": rooms[i]} for i in range(4)]
        (folder / label).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(records), folder / label / "qa1-00000-of-00001.parquet")
    out = tmp_path / "out"
    txl = runs["runs"]["txl"]
    assert main(["longeval", str(txl), "--babilong", str(folder), "--samples", "3", "--out", str(out), "--uri",
                 runs["uri"], "--experiment", "babilong"]) == 0  # qa1: the task the run was trained on
    printed = capsys.readouterr().out
    for label in ("0k", "1k"):
        got = json.loads((out / "txl" / f"babilong-qa1-{label}.json").read_text())
        want = evaluate_babilong(txl, folder, "qa1", label, 3)  # the same evaluation in this process
        assert {k: got[k] for k in want} == want and got["samples"] == 3
        # John is always the last name, his room the last place: that heuristic is always wrong here
        assert got["baselines"] == {"chance": 1 / 6, "last_mentioned": 0.0, "most_frequent": 0.0}
    assert "BABILong qa1 accuracy by length (BABILong's labels and scoring" in printed and "| txl |" in printed
    client = MlflowClient(tracking_uri=runs["uri"])
    (logged,) = client.search_runs([client.get_experiment_by_name("babilong").experiment_id])
    assert logged.info.run_name == "txl-babilong-qa1" and logged.data.params["source"] == "babilong"
    assert sorted(m.step for m in client.get_metric_history(logged.info.run_id, "longeval_baseline_chance")) == [
        0, 1000]
