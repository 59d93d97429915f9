"""`memlm compare` on real MLflow stores (docs/design.md §5), and `memlm eval` logging to the training run.

One module fixture trains three tiny tracked runs (transformer, lamemo, rmt; 8 steps, validation every 4) into a
SQLite store, evaluates the LaMemo run on the test split (as trained, and once with a longer memory), and adds the
runs a real experiment also holds that must not become rows: an extrapolation run (kind tag) and a sweep parent
whose child is the RMT run. Every expected cell is computed here from the run folders, independently of the
code under test: parameters as sum(p.numel()) of a model built from config.yaml, FLOPs from models.flops on that
config, tokens/s as the median of metrics.jsonl, perplexities from the eval JSON files.

The slow test starts a real `mlflow server` on 127.0.0.1 over the same SQLite file and checks that compare reads
the same table through it. Cost: ~25 s of training and evaluation, ~20 s for the server on 2 cores.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from support.training import child_env, make_data, metrics, train_in_process

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")
# One xdist worker runs the whole file (scripts/test.sh: --dist loadgroup), so the module fixture is built once.
pytestmark = pytest.mark.xdist_group("compare")
EXPERIMENT = "cmp-test"
ARCHS = ("transformer", "lamemo", "rmt")
STEPS = 8
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """{'uri', 'root', 'runs': {arch: run_dir}, 'others': {...}} after training, evaluating and decoys."""
    from mlflow import MlflowClient

    from memlm.cli import main

    root = tmp_path_factory.mktemp("compare")
    data = make_data(root)
    (root / "store").mkdir()
    uri = f"sqlite:///{root / 'store' / 'mlflow.db'}"
    runs = {}
    for arch in ARCHS:
        runs[arch] = root / f"run-{arch}"
        cheaper = {"model__bptt_depth": 0} if arch == "rmt" else {}  # one segment per step, not three
        train_in_process(arch, data, runs[arch], **cheaper, tracking__enabled="true", tracking__uri=uri,
                         tracking__experiment=EXPERIMENT, train__steps=STEPS, train__eval_every=4,
                         train__eval_batches=2, train__save_every=0, train__log_every=1)
    lamemo = runs["lamemo"]
    assert main(["eval", str(lamemo), "--split", "test", "--lanes", "6", "--json", str(root / "test.json")]) == 0
    assert main(["eval", str(lamemo), "--split", "test", "--lanes", "6", "--mem-len", "16",
                 "--json", str(root / "test16.json")]) == 0

    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    extrapolation = client.create_run(experiment_id, run_name="extrapolate-lamemo", tags={"kind": "extrapolation"})
    parent = client.create_run(experiment_id, run_name="sweep")
    client.log_param(parent.info.run_id, "model.arch", "txl")  # a sweep parent may log its base config too
    client.set_tag(_run_id(runs["rmt"]), "mlflow.parentRunId", parent.info.run_id)
    sweep = client.create_run(experiment_id, run_name="sweep-no-trials-yet", tags={"memlm.kind": "sweep"})
    client.log_param(sweep.info.run_id, "model.arch", "lamemo")
    client.create_experiment("cmp-empty")
    return {"uri": uri, "root": root, "runs": runs, "client": client,
            "decoys": {extrapolation.info.run_id, parent.info.run_id, sweep.info.run_id}}


@pytest.fixture(scope="module")
def compared(store, tmp_path_factory):
    """One `memlm compare` over the SQLite store, run from a fresh folder with the default --out."""
    from memlm.cli import main

    cwd = tmp_path_factory.mktemp("cwd")
    old = os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    os.chdir(cwd)
    try:
        from contextlib import redirect_stderr, redirect_stdout

        with redirect_stdout(out), redirect_stderr(err):
            rc = main(["compare", "--experiment", EXPERIMENT, "--uri", store["uri"]])
    finally:
        os.chdir(old)
    assert rc == 0, err.getvalue()
    return {"dir": cwd / "compare" / EXPERIMENT, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _run_id(run_dir: Path) -> str:
    return (run_dir / "mlflow_run_id").read_text().strip()


def _run_name(run_dir: Path) -> str:
    """The default MLflow run name: the folder's name (it holds the arch here) and the run id's first 6 characters."""
    return f"{run_dir.name}-{_run_id(run_dir)[:6]}"


def _expected_rows(store) -> dict[str, dict]:
    """Every table cell, from the run folders alone."""
    from memlm.models import build_model
    from memlm.models.flops import flops_per_token
    from memlm.trainer.config.run_config import load_config

    rows = {}
    for arch, run_dir in store["runs"].items():
        cfg = load_config(run_dir / "config.yaml").model
        model = build_model(cfg)
        lines = metrics(run_dir)
        last_valid = json.loads((run_dir / "eval" / f"step{STEPS}.json").read_text())
        test = json.loads((store["root"] / "test.json").read_text()) if arch == "lamemo" else None
        longer = json.loads((store["root"] / "test16.json").read_text()) if arch == "lamemo" else None
        rows[_run_name(run_dir)] = {
            "run_id": _run_id(run_dir), "arch": arch,
            "params": sum(p.numel() for p in model.parameters()),
            "mem_len": cfg.mem_len, "mem_tokens": cfg.num_mem_tokens,
            "flops_per_token": flops_per_token(cfg)["total"],
            "dev_ppl": last_valid["ppl"], "dev_bpc": last_valid["bpc"], "test_ppl": test["ppl"] if test else None,
            "test_ppl_mem16": longer["ppl"] if longer else None,
            "tokens_per_s": statistics.median(line["tokens_per_s"] for line in lines),
            "steps": lines[-1]["step"], "tokens": lines[-1]["tokens"],
        }
    return rows


def test_eval_logs_to_the_training_run(store):
    client = store["client"]
    run_id = _run_id(store["runs"]["lamemo"])
    as_trained = json.loads((store["root"] / "test.json").read_text())
    longer = json.loads((store["root"] / "test16.json").read_text())
    assert as_trained["mem_len"] == 8 and longer["mem_len"] == 16 and as_trained["step"] == STEPS
    for key in ("nll", "ppl", "bpc"):
        history = client.get_metric_history(run_id, f"test_{key}")
        assert [(m.step, m.value) for m in history] == [(STEPS, as_trained[key])], key
        # a longer memory is another measurement: its own name, never the run's test_ppl
        history = client.get_metric_history(run_id, f"test_{key}_tgt8_mem16")
        assert [(m.step, m.value) for m in history] == [(STEPS, longer[key])], key
    logged = {a.path for a in client.list_artifacts(run_id, "eval")}
    assert {"eval/test.json", "eval/test16.json"} <= logged, logged
    # untracked runs (tracking off) are not touched: the transformer run's store has no test metrics
    assert client.get_metric_history(_run_id(store["runs"]["transformer"]), "test_ppl") == []


def test_eval_with_a_broken_tracking_link_still_evaluates(store, tmp_path, caplog, capsys):
    from memlm.cli import main

    copy = tmp_path / "run-copy"
    shutil.copytree(store["runs"]["transformer"], copy)
    (copy / "mlflow_run_id").write_text("0" * 32 + "\n")  # a run id the store does not hold
    with caplog.at_level(logging.WARNING, logger="memlm.trainer.tracking.tracker"):
        assert main(["eval", str(copy), "--split", "valid", "--lanes", "6", "--json", str(tmp_path / "v.json")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ppl"] > 1 and (tmp_path / "v.json").is_file()
    warned = [r.getMessage() for r in caplog.records if r.name == "memlm.trainer.tracking.tracker"]
    assert len(warned) == 1 and "not logged" in warned[0], warned


def test_csv_rows_equal_the_runs(store, compared):
    expected = _expected_rows(store)
    with open(compared["dir"] / "table.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert [row["run"] for row in got] == [_run_name(store["runs"][a]) for a in ("transformer", "lamemo", "rmt")]
    assert not store["decoys"] & {row["run_id"] for row in got}  # paper order; no decoys
    assert not store["decoys"] & {row["run_id"] for row in got}
    for row in got:
        want = expected[row["run"]]
        assert row["run_id"] == want["run_id"] and row["arch"] == want["arch"] and row["status"] == "FINISHED"
        assert int(row["params"]) == want["params"], row["run"]
        assert int(row["mem_len"]) == want["mem_len"] and int(row["mem_tokens"]) == want["mem_tokens"]
        assert float(row["flops_per_token"]) == want["flops_per_token"]
        assert float(row["dev_ppl"]) == want["dev_ppl"]
        assert (float(row["test_ppl"]) if row["test_ppl"] else None) == want["test_ppl"]
        # the evaluation with a longer memory: its own CSV column, exact, named by its settings
        longer = f"tgt8_mem16={want['test_ppl_mem16']!r}" if want["test_ppl_mem16"] else ""
        assert row["test_ppl_other"] == longer
        assert float(row["tokens_per_s"]) == want["tokens_per_s"]
        assert int(row["steps"]) == want["steps"] == STEPS
        assert int(row["tokens"]) == want["tokens"]
        assert float(row["dev_bpc"]) == want["dev_bpc"]  # byte-level data: bits per token are bits per character
    names = {arch: _run_name(run_dir) for arch, run_dir in store["runs"].items()}
    assert expected[names["rmt"]]["mem_tokens"] == 2 and expected[names["transformer"]]["mem_len"] == 0


def test_markdown_table_matches_and_is_printed(store, compared):
    expected = _expected_rows(store)
    markdown = (compared["dir"] / "table.md").read_text()
    assert compared["stdout"] == markdown
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["run", "arch", "params", "mem", "FLOPs/token", "dev ppl", "test ppl", "test ppl, other lengths",
                      "tokens/s", "steps"]
    body = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]
    assert [row["run"] for row in body] == [_run_name(store["runs"][a]) for a in ("transformer", "lamemo", "rmt")]
    for row in body:
        want = expected[row["run"]]
        assert row["arch"] == want["arch"]
        assert _read_si(row["params"]) == pytest.approx(want["params"], rel=5e-3)
        assert _read_si(row["FLOPs/token"]) == pytest.approx(want["flops_per_token"], rel=5e-3)
        assert float(row["dev ppl"]) == pytest.approx(want["dev_ppl"], abs=0.006)
        assert (float(row["test ppl"]) if row["test ppl"] else None) == pytest.approx(want["test_ppl"], abs=0.006)
        longer = want["test_ppl_mem16"]
        assert row["test ppl, other lengths"] == (f"{longer:.2f} (N=8 M=16)" if longer else "")
        assert float(row["tokens/s"].replace(",", "")) == pytest.approx(want["tokens_per_s"], abs=0.51)
        assert int(row["steps"]) == STEPS
    assert [row["mem"] for row in body] == ["0", "8", "0 + 2 tokens"]
    assert "Not rows: 1 extrapolation run, 1 parent (sweep) run, 1 sweep run." in markdown


def test_plots_and_artifacts_logged_to_mlflow(store, compared):
    client = store["client"]
    for name in ("loss.png", "valid_ppl.png"):
        assert (compared["dir"] / name).read_bytes()[:8] == PNG_MAGIC, name
    # Snapshots go to EXPERIMENT-comparisons: the experiment's own runs table lists its training runs only.
    experiment_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    assert not client.search_runs([experiment_id], filter_string="tags.kind = 'comparison'")
    snapshots = client.get_experiment_by_name(f"{EXPERIMENT}-comparisons")
    assert snapshots.tags["mlflow.experimentKind"] == "custom_model_development"
    # The training runs' experiment has memlm's saved view of its runs table; the snapshots have no such metrics.
    from memlm.trainer.tracking.tracker import RUNS_VIEW_TAG

    assert RUNS_VIEW_TAG in client.get_experiment(experiment_id).tags and RUNS_VIEW_TAG not in snapshots.tags
    comparisons = client.search_runs([snapshots.experiment_id], filter_string="tags.kind = 'comparison'")
    assert len(comparisons) >= 1
    run = max(comparisons, key=lambda r: r.info.start_time)
    assert run.info.status == "FINISHED" and run.info.run_id in compared["stderr"]
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "compare")}
    assert logged == {f"compare/{n}" for n in ("table.md", "table.csv", "loss.png", "valid_ppl.png")}, logged
    local = Path(client.download_artifacts(run.info.run_id, "compare/table.csv", str(compared["dir"].parent)))
    assert local.read_bytes() == (compared["dir"] / "table.csv").read_bytes()
    assert run.data.tags["mlflow.note.content"] == (compared["dir"] / "table.md").read_text()
    assert set(run.data.params["run_ids"].split(",")) == {_run_id(d) for d in store["runs"].values()}


@pytest.mark.parametrize("argv, words", [
    (["--experiment", "no-such-experiment"], ["no-such-experiment", EXPERIMENT, "cmp-empty"]),
    (["--experiment", "cmp-empty"], ["cmp-empty", "no training runs"]),
])
def test_bad_experiment_is_one_line(store, capsys, argv, words):
    from memlm.cli import main

    assert main(["compare", *argv, "--uri", store["uri"], "--out", str(store["root"] / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("memlm: error:"), err
    assert all(word in err for word in words), err


def test_unreachable_or_missing_store_is_one_line(tmp_path, capsys):
    from memlm.cli import main
    from memlm.trainer.runtime.distributed import free_port

    started = time.monotonic()
    assert main(["compare", "--experiment", "x", "--uri", f"http://127.0.0.1:{free_port()}"]) == 2
    assert time.monotonic() - started < 30  # no minutes of retries against a dead server
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot read the MLflow store http://127.0.0.1:" in err, err
    missing = tmp_path / "nowhere" / "mlflow.db"
    assert main(["compare", "--experiment", "x", "--uri", f"sqlite:///{missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing) in err and "--uri" in err, err
    assert not missing.exists()  # reading never creates a store


@pytest.mark.slow
def test_server_gives_the_same_table_as_sqlite(store, compared, tmp_path, capfd):
    """A real `mlflow server` on 127.0.0.1 over the same SQLite file: the CSV read through it is identical, and
    stdout is the table alone (MLflow prints "View run ... at: URL" when a run on a server ends)."""
    from memlm.cli import main
    from memlm.trainer.runtime.distributed import free_port

    port = free_port()
    env = child_env({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"})
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store["uri"], "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "server.log").open("wb"),
        start_new_session=True)  # a file, not a pipe: a full pipe would block the server
    try:
        _wait_for_health(server, port, tmp_path / "server.log")
        out = tmp_path / "via-server"
        capfd.readouterr()
        assert main(["compare", "--experiment", EXPERIMENT, "--uri", f"http://127.0.0.1:{port}",
                     "--out", str(out)]) == 0
        assert (out / "table.csv").read_text() == (compared["dir"] / "table.csv").read_text()
        printed = capfd.readouterr()
        assert printed.out == (out / "table.md").read_text() and "View run" not in printed.err, printed
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def _wait_for_health(server: subprocess.Popen, port: int, log: Path, limit: float = 60.0) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"mlflow server exited {server.returncode}: {log.read_text()[-2000:]}")
        try:
            with opener.open(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"mlflow server did not answer on port {port} within {limit:.0f} s")


def _read_si(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return float(text[:-1]) * scale[text[-1]] if text[-1] in scale else float(text)


def test_bpc_only_for_byte_level_runs():
    """bits per token are bits per character only when a token is a byte: word or subword runs get no bpc."""
    from memlm.trainer.tracking.compare_runs import RunRecord
    from memlm.trainer.tracking.compare_table import build_row

    def row(tokenizer):
        return build_row(RunRecord(run_id="r", name="r", status="FINISHED", params={"model.arch": "txl"},
                                   metrics={"valid_ppl": 100.0, "valid_bpc": 6.64, "test_bpc": 6.7},
                                   tags={"tokenizer": tokenizer}))

    assert (row("bytes").dev_bpc, row("bytes").test_bpc) == (6.64, 6.7)
    assert (row("word").dev_bpc, row("word").test_bpc) == (None, None)
    assert row("spm-unigram").dev_bpc is None and row("word").dev_ppl == 100.0


def test_evaluations_at_other_lengths_get_their_own_column():
    """`memlm eval --mem-mult 4` logs test_ppl_tgt8_mem32: shown beside the as-trained test ppl, never as it, and
    the column appears only when some run has such an evaluation."""
    from memlm.trainer.tracking.compare_runs import RunRecord
    from memlm.trainer.tracking.compare_table import build_row, to_markdown

    def row(metrics):
        return build_row(RunRecord(run_id="r", name="lamemo-3f9a2c", status="FINISHED",
                                   params={"model.arch": "lamemo"}, metrics=metrics, tags={}))

    plain = row({"test_ppl": 40.0, "test_nll_tgt8_mem32": 3.6})
    assert plain.test_ppl_other == [] and "other lengths" not in to_markdown([plain])
    extended = row({"test_ppl_tgt8_mem32": 37.5, "test_ppl_tgt8_mem16": 38.25,
                    "test_ppl_tgt64_mem256_clamp100_same": 9.0, "valid_ppl_tgt8_mem32": 41.0})
    assert extended.test_ppl is None  # not the run's own test perplexity
    assert extended.test_ppl_other == [("tgt8_mem16", 38.25), ("tgt8_mem32", 37.5),
                                       ("tgt64_mem256_clamp100_same", 9.0)]
    table = to_markdown([plain, extended])
    assert "| test ppl | test ppl, other lengths |" in table
    assert "|  | 38.25 (N=8 M=16); 37.50 (N=8 M=32); 9.00 (N=64 M=256 clamp 100 same length) |" in table


def test_a_column_no_run_has_is_left_out():
    """Issue 32: the demo's runs never validate, and their table showed an empty "dev ppl" column. A column no run
    has a value for is left out of the Markdown (the CSV keeps it); one that some run has stays, blank elsewhere."""
    from memlm.trainer.tracking.compare_runs import RunRecord
    from memlm.trainer.tracking.compare_table import build_row, to_csv, to_markdown

    def row(name, metrics):
        return build_row(RunRecord(run_id=name, name=name, status="FINISHED", params={"model.arch": "txl"},
                                   metrics=metrics, tags={}))

    demo = [row("demo-txl", {"test_ppl": 5.4}), row("demo-lamemo", {"test_ppl": 5.3})]
    header = to_markdown(demo).splitlines()[0]
    assert header == "| run | arch | params | mem | FLOPs/token | test ppl |", header
    assert "dev_ppl" in to_csv(demo).splitlines()[0]
    mixed = to_markdown([*demo, row("validated", {"valid_ppl": 6.0})])
    assert "| dev ppl | test ppl |" in mixed and "| demo-txl | txl |" in mixed


def test_a_pretrained_backbone_run_is_a_row_as_logged():
    """An hf_rmt run logs its inline backbone config as model.backbone_config.* params, strings like every param the
    Tracker logs: compare reads them back typed, so the row's parameters, memory tokens and FLOPs are the model's
    (an untied head read back as the string 'False' would be counted as tied, its table once)."""
    import dataclasses

    from memlm.models import ARCHITECTURES, build_model
    from memlm.models.flops import flops_per_token
    from memlm.trainer.config.run_config import RunConfig, flatten
    from memlm.trainer.tracking.compare_runs import RunRecord
    from memlm.trainer.tracking.compare_table import build_row, to_markdown
    from support.models import registry_config

    spec = ARCHITECTURES["hf_rmt"]
    untied = {**dict(spec.test_settings)["backbone_config"], "tie_word_embeddings": False}
    cfg = registry_config(spec, backbone_config=untied, backbone_train="lora", lora_rank=2, num_mem_tokens=3)
    params = {key: str(value) for key, value in flatten(dataclasses.replace(RunConfig(), model=cfg)).items()}
    row = build_row(RunRecord(run_id="r", name="hf_rmt-1", status="FINISHED", params=params,
                              metrics={"test_ppl": 50.0}, tags={}))
    assert row.note == "", row.note
    assert row.params == sum(p.numel() for p in build_model(cfg).parameters())
    assert (row.mem_len, row.mem_tokens) == (0, 3)
    assert row.flops_per_token == flops_per_token(cfg)["total"]
    assert "| hf_rmt-1 | hf_rmt |" in to_markdown([row])
