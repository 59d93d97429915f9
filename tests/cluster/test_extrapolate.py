"""`memlm extrapolate` end to end: real runs trained by the real trainer, a real local Ray, MLflow on SQLite.

Two tiny runs (Transformer-XL and LaMemo, N = M = 8, a few steps) are trained once per module; the txl run logs its
training to the same MLflow store, so the extrapolation run must link to it. The reference for every (run, m) is
the slow obvious one: a direct evaluate_run in this process, one after another.

The Ray tests share the session's local Ray (`local_ray`, 2 CPUs; xdist group "ray"): the command finds Ray
running and leaves it. Usage-error tests need no Ray. The retry test SIGKILLs the Ray worker running a task (a
real crash, no mock). Cost on 2 cores: ~45-55 s for the file when the machine is otherwise idle (~20 s training;
the first DeepSpeed start on a machine also builds its shm op, ~1 min, once; ~10 s Ray start if no earlier test
started it; ~20 s of tasks and references), ~110 s with other test suites running beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from support.training import make_data, train_in_process

# `-m 'not slow'` leaves these out: Ray evaluations of trained runs, 2.7 min in all on 2 busy cores
pytestmark = pytest.mark.slow

MULTS = (1, 2, 3)
N = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("extrapolate")
    data = make_data(root)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    runs = {"txl": root / "runs" / "txl", "lamemo": root / "runs" / "lamemo"}
    # Only txl tracks its training: the lamemo run then has no mlflow_run_id and must not get the link tag.
    train_in_process("txl", data, runs["txl"], train__steps=4, tracking__enabled="true", tracking__uri=uri,
                     tracking__experiment="train")
    train_in_process("lamemo", data, runs["lamemo"], train__steps=4)
    manifest = json.loads((data / "manifest.json").read_text())
    return {"root": root, "data": data, "uri": uri, "runs": runs, "test_tokens": manifest["splits"]["test"]["tokens"]}


def extrapolate(run_dirs, out: Path, uri: str, *extra: str) -> int:
    from memlm.cli import main

    # No --tgt-len: N defaults to the length the runs were trained with (N = 8 here, not a fixed 64).
    return main(["extrapolate", *map(str, run_dirs), "--mult", "1-3", "--out", str(out),
                 "--uri", uri, "--experiment", "extrap", *extra])


def result_file(out: Path, name: str, m: int) -> Path:
    return out / name / f"test-tgt{N}-m{m}.json"


def reference(run_dir: Path, m: int, tmp: Path) -> dict:
    from memlm.trainer.inference.evaluate import evaluate_run

    return evaluate_run(run_dir, split="test", tgt_len=N, mem_len=m * N, json_path=tmp / f"ref-{run_dir.name}-{m}.json")


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
def test_two_runs_one_result_per_run_and_m(setup, tmp_path, capsys):
    out = tmp_path / "out"
    # its own experiment: the other tests of this module log their runs to "extrap"
    assert extrapolate(setup["runs"].values(), out, setup["uri"], "--experiment", "extrap-two") == 0
    printed = capsys.readouterr().out
    assert "6 evaluation(s) to run" in printed

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"txl", "lamemo"} and summary["mults"] == list(MULTS)
    for name, run_dir in setup["runs"].items():
        assert [row["m"] for row in summary["runs"][name]["results"]] == list(MULTS)
        for m in MULTS:
            got = json.loads(result_file(out, name, m).read_text())
            assert set(got) == {"split", "documents", "tokens", "nll", "ppl", "bpc", "tgt_len", "mem_len", "arch",
                                "step"}
            assert got["tokens"] == setup["test_tokens"] and got["mem_len"] == m * N and got["tgt_len"] == N
            assert got["arch"] == name and got["step"] == 4 and got["split"] == "test"
            ref = reference(run_dir, m, tmp_path)
            assert got["nll"] == pytest.approx(ref["nll"], rel=1e-9), (name, m)
            assert got["tokens"] == ref["tokens"] and got["documents"] == ref["documents"]
    # memory matters: a longer memory changes the loss of a memory model (else the sweep over m is meaningless)
    txl = [row["nll"] for row in summary["runs"]["txl"]["results"]]
    assert len(set(txl)) == len(txl)

    png = (out / "extrapolation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    rows = (out / "extrapolation.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * len(MULTS) and rows[0].startswith("run,arch,step,m,")
    assert "m=3" in printed and f"{summary['runs']['lamemo']['results'][2]['ppl']:.2f}" in printed  # the table

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=setup["uri"])
    exp = client.get_experiment_by_name("extrap-two")
    view = json.loads(json.loads(exp.tags["mlflow.sharedViewState.memlm"])["state"])  # the UI's saved runs view
    assert "metrics.`extrapolate_ppl`" in view["selectedColumns"] and "metrics.`loss`" not in view["selectedColumns"]
    found = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(found) == {"txl", "lamemo"}
    train_id = (setup["runs"]["txl"] / "mlflow_run_id").read_text().strip()
    for name, run in found.items():
        assert run.info.status == "FINISHED"
        assert run.data.tags["kind"] == "extrapolation" and run.data.tags["arch"] == name
        assert run.data.tags["run_dir"] == str(setup["runs"][name].resolve())
        history = client.get_metric_history(run.info.run_id, "extrapolate_ppl")
        assert sorted(h.step for h in history) == list(MULTS)
        by_m = {h.step: h.value for h in history}
        for m in MULTS:
            assert by_m[m] == pytest.approx(json.loads(result_file(out, name, m).read_text())["ppl"], rel=1e-12)
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"extrapolation.png", "summary.json"} <= artifacts
    assert found["txl"].data.tags.get("memlm.train_run_id") == train_id
    assert "memlm.train_run_id" not in found["lamemo"].data.tags


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
def test_rerun_evaluates_only_what_is_missing(setup, tmp_path, capsys):
    out = tmp_path / "out"
    runs = [setup["runs"]["txl"]]
    assert extrapolate(runs, out, setup["uri"]) == 0
    kept = result_file(out, "txl", 1)
    before = kept.stat().st_mtime_ns
    result_file(out, "txl", 2).unlink()  # as if the command had died before this task finished
    capsys.readouterr()
    assert extrapolate(runs, out, setup["uri"]) == 0
    printed = capsys.readouterr().out
    assert "1 evaluation(s) to run" in printed and "reusing 2 of 3" in printed
    assert kept.stat().st_mtime_ns == before
    assert result_file(out, "txl", 2).is_file()
    assert len(json.loads((out / "summary.json").read_text())["runs"]["txl"]["results"]) == 3


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
def test_broken_checkpoint_is_reported_and_other_results_kept(setup, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(setup["runs"]["lamemo"], broken)
    for states in (broken / "checkpoints").rglob("mp_rank_*_model_states.pt"):
        states.write_bytes(b"not a checkpoint")  # a real torch.load failure in the worker, every attempt
    out = tmp_path / "out"
    rc = extrapolate([setup["runs"]["txl"], broken], out, setup["uri"], "--max-retries", "1")
    assert rc == 1
    err = capsys.readouterr().err
    for m in MULTS:
        assert f"extrapolation of broken at m={m} (memory {m * N}) failed" in err
        assert result_file(out, "txl", m).is_file() and not result_file(out, "broken", m).exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"]["broken"]["missing_m"] == list(MULTS) and len(summary["runs"]["txl"]["results"]) == 3
    assert (out / "extrapolation.png").is_file()


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("retries", [2, 0])
def test_killed_worker_is_retried(setup, tmp_path, capsys, retries):
    """SIGKILL the worker process while it runs the task (found by the process title Ray gives it). With retries
    the task runs again in another worker and gives the reference result; without, the command reports the crash.

    A kill can land after the task has returned its result but before Ray renamed the worker (seen under load:
    rc 0 without retries): such an attempt exercised nothing and is made again, at most 3 times."""
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        rc, workers = _run_and_kill_the_worker(setup, out, retries)
        assert workers, "the task finished before it could be killed; the test did not exercise a retry"
        err = capsys.readouterr().err
        if (retries == 0 and rc == 1) or (retries > 0 and len(workers) > 1):
            break  # the kill ended the running task: without retries the crash, with them a second worker
    else:
        pytest.fail(f"3 kills, none while the task ran: rc {rc}, workers that ran it {workers}")
    path = result_file(out, "lamemo", 3)
    if retries == 0:
        assert not path.exists()
        assert "lamemo at m=3 (memory 24) failed (retries allowed: 0): WorkerCrashedError" in err
        return
    assert rc == 0
    got = json.loads(path.read_text())
    assert got["nll"] == pytest.approx(reference(setup["runs"]["lamemo"], 3, tmp_path)["nll"], rel=1e-9)


def _run_and_kill_the_worker(setup, out, retries) -> tuple[int, list[int]]:
    """(exit code, pids of the workers seen running the task): the first one is SIGKILLed when seen."""
    import psutil

    workers: list[int] = []
    stop = threading.Event()

    def killer():
        while not stop.is_set():
            for proc in psutil.process_iter(["pid", "cmdline"]):
                pid = proc.info["pid"]
                if pid not in workers and " ".join(proc.info["cmdline"] or []).startswith(
                        "ray::extrapolate:lamemo:m3"):
                    workers.append(pid)
                    if len(workers) == 1:
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.002)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        # one lane: a longer task, so the killer sees it running
        rc = extrapolate([setup["runs"]["lamemo"]], out, setup["uri"], "--mult", "3", "--lanes", "1",
                         "--max-retries", str(retries))
    finally:
        stop.set()
        thread.join()
    return rc, workers


@pytest.mark.parametrize("mult", ["x", "3-1", "0", "1-", "1,,2"])
def test_bad_mult_is_one_line(mult, tmp_path, capsys):
    from memlm.cli import main

    assert main(["extrapolate", str(tmp_path), "--mult", mult]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("memlm: error: --mult") and "Traceback" not in err


def test_run_without_checkpoint_is_one_line(setup, tmp_path, capsys):
    from memlm.cli import main

    run = tmp_path / "untrained"
    run.mkdir()
    shutil.copy(setup["runs"]["txl"] / "config.yaml", run / "config.yaml")
    assert main(["extrapolate", str(setup["runs"]["txl"]), str(run), "--mult", "1-3", "--out", str(tmp_path / "o"),
                 "--uri", setup["uri"]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no checkpoint" in err and str(run) in err
    assert not (tmp_path / "o").exists()  # nothing was started or written


def test_runs_of_different_target_lengths_need_tgt_len(tmp_path, capsys):
    """No common trained N: one line asking for --tgt-len, before Ray starts."""
    from memlm.cli import main
    from memlm.trainer.config.run_config import dump_yaml, load_config

    for name, n in (("a", 8), ("b", 16)):
        (tmp_path / name).mkdir()
        dump_yaml(load_config("tiny/txl", [f"model.tgt_len={n}"]), tmp_path / name / "config.yaml")
    assert main(["extrapolate", str(tmp_path / "a"), str(tmp_path / "b"), "--mult", "1-2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "different target lengths" in err and "--tgt-len" in err, err


def test_tasks_that_cannot_fit_are_refused_before_ray_starts(setup, tmp_path, capsys, monkeypatch):
    """Ray would queue a task no node can hold forever: refused in one line before a local Ray starts (its
    resources are known beforehand), naming what a task asks, what Ray would have and the flags to change."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for Ray, also on a machine that has one
    out = tmp_path / "out"
    assert extrapolate([setup["runs"]["txl"]], out, setup["uri"], "--gpus-per-task", "1", "--num-cpus", "2") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("memlm: error: each evaluation asks for 1 CPU and 1 GPU"), err
    assert "the local Ray would have 2 CPUs and 0 GPUs" in err and "--gpus-per-task 0" in err, err
    assert extrapolate([setup["runs"]["txl"]], out, setup["uri"], "--cpus-per-task", "3", "--num-cpus", "2") == 2
    err = capsys.readouterr().err.strip()
    assert "asks for 3 CPUs" in err and "--cpus-per-task 2" in err and "--num-cpus 3" in err, err
    assert not out.exists()


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
def test_cluster_without_the_tasks_resources_is_refused(setup, tmp_path, capsys):
    """--address: checked right after connecting (the session's local Ray: 2 CPUs, no GPU), before any task."""
    out = tmp_path / "out"
    assert extrapolate([setup["runs"]["txl"]], out, setup["uri"], "--gpus-per-task", "1", "--address", "auto") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the Ray cluster at auto has 2 CPUs and 0 GPUs" in err and "--gpus-per-task 0" in err
    assert not list(out.glob("*/*.json"))

