"""The reproduction experiments (bench/reproduce/) end to end at seconds-long sizes, and the answer accuracy the
task experiments read from `memlm eval`.

The smoke runs prove the pipeline: every file is written, perplexities are over every token of the split and
accuracies over the answer tokens only. They never judge quality (3 training steps). Each experiment is first
stopped as a user would stop it (Ctrl-C at the terminal, or SIGTERM to the script), then run again to its end
with the same command: the stop is one line, leaves no process behind, and the rerun keeps the finished runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import psutil
import pytest
import torch

# `-m 'not slow'` leaves these out: the experiments' smoke runs, 2-6 min each on 2 busy cores
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    script = subprocess.Popen([sys.executable, str(ROOT / "bench" / "reproduce" / name), *args], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = script.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        script.terminate()  # not kill(): the script stops its children (their own sessions) before it exits
        stdout, stderr = script.communicate()
    proc = subprocess.CompletedProcess(script.args, script.returncode, stdout, stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc


class Stopped(NamedTuple):
    status: int
    stdout: str
    stop_line: str  # stderr, asserted to be this one line


def _stop(console: Path, name: str, args: tuple[str, ...], signum: int, *, terminal: bool,
          ready: Callable[[list[psutil.Process], str], bool]) -> Stopped:
    """Start a reproduction script as a shell starts a job (a process group of its own) and, once
    ready(its descendants, its stdout so far) holds, send SIGNUM: to the whole group as a terminal's Ctrl-C
    does (terminal=True), or to the script alone as `kill` does. Asserts that nothing it started outlives it."""
    out, err = console / f"{name}.out", console / f"{name}.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "reproduce" / name), *args], cwd=ROOT, env=ENV,
                                stdout=stdout, stderr=stderr, start_new_session=True)
    script = psutil.Process(proc.pid)
    deadline = time.monotonic() + 600
    while not ready(_descendants(script), out.read_text()):
        assert proc.poll() is None, f"{name} ended before the moment to stop it: {out.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{name}: the moment to stop it never came: {out.read_text()[-2000:]}"
        time.sleep(0.1)
    seen = _descendants(script)
    sessions = {os.getsid(p.pid) for p in seen} - {proc.pid}  # the children's own sessions
    (os.killpg if terminal else os.kill)(proc.pid, signum)
    status = proc.wait(timeout=300)
    left = [p for p in seen if _alive(p)] + [p for p in map(_process, psutil.pids()) if p and _alive(p) and
                                            _sid(p) in sessions]
    survivors = [" ".join(p.cmdline())[:120] for p in left]
    for p in left:  # noted: now a failing run of this test leaves nothing behind either
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    assert not survivors, f"still running after {name} exited: {survivors}"
    stop_lines = err.read_text().strip().splitlines()
    assert len(stop_lines) == 1, err.read_text()
    assert "Traceback" not in out.read_text()
    return Stopped(status, out.read_text(), stop_lines[0])


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sid(proc: psutil.Process) -> int | None:
    try:
        return os.getsid(proc.pid)
    except OSError:
        return None


def _running(procs: list[psutil.Process], command: str) -> bool:
    """Whether one of PROCS runs COMMAND ("memlm train", "raylet")."""
    for proc in procs:
        try:
            if command in " ".join(proc.cmdline()):
                return True
        except psutil.Error:
            pass
    return False


def _finished(work: Path) -> list[str]:
    return sorted(p.parent.name for p in (work / "runs").glob("*/reproduce_row.json"))


def _finite_numbers(payload) -> bool:
    text = json.dumps(payload)
    return "NaN" not in text and "Infinity" not in text


def test_wikitext2_and_extrapolation_smoke(tmp_path):
    work = tmp_path / "wt2"
    # The two variants the extrapolation below reads (the no-memory baseline is one more row of the same kind).
    command = ("--profile", "smoke", "--work", str(work), "--variants", "txl,lamemo", "--progress-every", "1")
    # Ctrl-C once a run is finished, the next one is training and a progress line is out (one job at a time: the
    # rerun below then has the other one to do, what the whole experiment costs without the stop).
    stop = _stop(tmp_path, "wikitext2.py", (*command, "--jobs", "1"), signal.SIGINT, terminal=True,
                 ready=lambda kids, out: (bool(_finished(work)) and _running(kids, "memlm train")
                                          and "] running " in out))
    finished = _finished(work)
    assert stop.status == 130
    assert re.fullmatch(r"wikitext2: stopped by Ctrl-C: ended lamemo-s1 \(train (for \d+:\d\d|step \d/3)\); 1 of 2 "
                        r"runs finished; rerun the same command to resume: finished runs are kept, interrupted ones "
                        r"start over", stop.stop_line), stop.stop_line
    # The run the Ctrl-C ended is neither finished nor failed (no row, exit 130).
    assert finished == ["txl-s1"] and "start lamemo-s1" in stop.stdout
    # Progress: the trainings under way, with their step out of 3 (and an ETA) once they have logged one.
    assert any(" train for " in line or " train step " in line for line in stop.stdout.splitlines()
               if "] running " in line)

    rerun = _script("wikitext2.py", *command)
    assert "skip txl-s1: finished by an earlier invocation" in rerun.stdout
    assert "start lamemo-s1: train 3 steps, then eval" in rerun.stdout
    result = json.loads((work / "reproduce_wt2_smoke.json").read_text())
    assert (work / "reproduce_wt2_smoke.png").is_file() and _finite_numbers(result)
    manifest = json.loads((work / "data" / "manifest.json").read_text())["splits"]
    assert [r["variant"] for r in result["table"]] == ["txl", "lamemo"]
    for run in result["runs"]:
        # Equal steps and tokens for every variant; perplexity over every token of each split, once.
        assert run["steps"] == 3 and run["tokens_seen"] == result["runs"][0]["tokens_seen"]
        assert run["test_tokens"] == manifest["test"]["tokens"] and run["valid_tokens"] == manifest["valid"]["tokens"]
        evaluated = json.loads((ROOT / run["run_dir"] if not Path(run["run_dir"]).is_absolute()
                                else Path(run["run_dir"])).joinpath("eval", "test.json").read_text())
        assert abs(np.exp(evaluated["nll"]) - run["test_ppl"]) < 1e-6 * run["test_ppl"]
    for row in result["table"]:  # one seed: the mean is that seed's number, the spread zero
        assert row["test_ppl"] == row["test_ppl_per_seed"][0] and row["test_ppl_spread"] == 0

    command = ("--profile", "smoke", "--work", str(work), "--num-cpus", "1")
    # Ctrl-C once the local Ray is up: memlm extrapolate and every Ray process it started end with the script.
    stop = _stop(tmp_path, "extrapolate.py", command, signal.SIGINT, terminal=True,
                 ready=lambda kids, out: _running(kids, "raylet"))
    assert stop.status == 130
    assert stop.stop_line.startswith("extrapolate: stopped by Ctrl-C: ended extrapolation (extrapolate for ")
    _script("extrapolate.py", *command)
    extrapolation = json.loads((work / "reproduce_extrapolate_smoke.json").read_text())
    assert (work / "reproduce_extrapolate_smoke.png").is_file() and _finite_numbers(extrapolation)
    assert [r["m"] for r in extrapolation["table"]] == [1, 2]
    assert [r["mem_len"] for r in extrapolation["table"]] == [8, 16]
    for row in extrapolation["table"]:
        assert row["tokens"] == manifest["test"]["tokens"]
        assert abs(row["lamemo_minus_txl"] - (row["lamemo_ppl"] - row["txl_ppl"])) < 1e-9


def test_rmt_tasks_smoke(tmp_path):
    """The paper-setting script (copy 24 -> 48 in 3 segments of 24, memory 24), Transformer-XL and RMT with BPTT
    (the two gradient paths: grad_accum over the segments, chunk BPTT over the sample): stopped by SIGTERM while it
    trains, then run to its end; every optimizer step sees whole samples and only the answer is scored."""
    work = tmp_path / "rmt"
    command = ("--profile", "smoke", "--work", str(work), "--tasks", "copy", "--segments", "3", "--archs",
               "txl,rmt_bptt")
    # SIGTERM to the script alone (`kill PID`, a scheduler's preemption) while it trains: its children stop too.
    stop = _stop(tmp_path, "rmt_tasks.py", command, signal.SIGTERM, terminal=False,
                 ready=lambda kids, out: _running(kids, "memlm train"))
    assert stop.status == 143
    assert stop.stop_line.startswith("rmt_tasks: stopped by SIGTERM: ended copy-S3")
    assert "; 0 of 2 runs finished; rerun the same command to resume" in stop.stop_line and _finished(work) == []
    _script("rmt_tasks.py", *command)
    result = json.loads((work / "reproduce_rmt_tasks_smoke.json").read_text())
    assert (work / "reproduce_rmt_tasks_smoke.png").is_file() and _finite_numbers(result)
    assert sorted(r["arch"] for r in result["runs"]) == ["rmt_bptt", "txl"]
    for run in result["runs"]:
        assert (run["segments"], run["segment_len"]) == (3, 24)
        assert run["scored_tokens"] == 16 * 48 and 0.0 <= run["accuracy"] <= 1.0  # 16 test samples x 48 answers
        steps = [json.loads(line) for line in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        # Each optimizer step takes the 4 lanes' whole samples: 4 x 48 answer tokens, whatever the model.
        assert [row["tokens"] for row in steps] == [4 * 48, 2 * 4 * 48]


def test_longctx_smoke(tmp_path):
    """The long-context experiment at seconds-long sizes (the no-memory model and ARMT on passkey): curriculum stages
    of 1 and 2 segments, then every stage's model and the last one on the stage's own test samples, bucketed by the
    segments from fact to answer, with the baselines on the same samples; a rerun trains and evaluates nothing."""
    work = tmp_path / "longctx"
    command = ("--profile", "smoke", "--work", str(work), "--tasks", "passkey")
    first = _script("longctx.py", *command)
    result = json.loads((work / "reproduce_longctx_smoke.json").read_text())
    assert _finite_numbers(result) and result["version"] == 2
    runs = result["results"]["passkey"]
    assert [r["arch"] for r in runs] == ["transformer", "armt"]
    for run in runs:
        assert [stage["segments"] for stage in run["stages"]] == [1, 2]
        for stage in run["stages"]:
            # 4 test samples of S segments, each measured S segments from fact to answer
            for model in ("own", "final"):
                assert stage[model]["samples"] == 4 and 0.0 <= stage[model]["accuracy"] <= 1.0
                assert list(stage[model]["by_apart"]) == [str(stage["segments"])]
                assert stage[model]["by_apart"][str(stage["segments"])]["samples"] == 4
            assert (stage["stop"], stage["stop_step"], stage["own"]["step"], stage["final"]["step"]) == (
                "budget", 2, 2, 2)
            assert stage["baselines"] == {"chance": 1 / 90000}  # passkey: 5-digit keys, no heuristic
            assert stage["held_out_answer_nll"] > 0  # the stage's last check, from the curriculum's record
    assert len(result["figures"]) == 1 and all((work / Path(p).name).is_file() for p in result["figures"].values())
    assert "start transformer-passkey" in first.stdout and "| *chance* | *0.001* | *0.001* |" in first.stdout
    again = _script("longctx.py", *command)
    assert "skip transformer-passkey" in again.stdout and "skip armt-passkey" in again.stdout


@pytest.mark.parametrize("arch, expected", [
    ("transformer", (0, 0, 3, 0, "window")), ("txl", (24, 0, 3, 0, "window")), ("rmt", (0, 24, 3, 0, "window")),
    ("rmt_bptt", (0, 24, 1, 2, "chunk"))])
def test_rmt_tasks_models(arch, expected):
    """What each of the four models of rmt_tasks.py trains with at 3 segments of 24, read back from the config
    `memlm train` would load: cache, memory tokens, micro-batches per step, BPTT depth and mode."""
    from memlm.bench.reproduce.rmt_tasks import PRESETS, TASKS, arch_overrides, segment_len
    from memlm.trainer.config.run_config import load_config

    n = segment_len("copy", 3)
    cfg = load_config(PRESETS / TASKS["copy"].preset, [*arch_overrides(arch, 3, n), f"model.tgt_len={n}"])
    model = cfg.model
    got = (model.mem_len, model.num_mem_tokens, cfg.train.grad_accum, model.bptt_depth, model.bptt_mode)
    assert got == expected and model.tgt_len == 24
    assert (model.n_layer, model.d_model, model.n_head, model.d_head, model.d_inner) == (4, 128, 4, 64, 256)


def test_tasks_small_smoke(tmp_path):
    """The earlier small setting (N = 8, the task length grows with the segments), kept as the `small` profile: the
    curriculum run at 4 segments, which first trains the plain RMT at 2 and starts from its weights."""
    work = tmp_path / "tasks"
    _script("tasks_small.py", "--profile", "smoke", "--work", str(work), "--tasks", "reverse", "--archs", "rmt_cur")
    result = json.loads((work / "reproduce_tasks_smoke.json").read_text())
    assert (work / "reproduce_tasks_smoke.png").is_file() and _finite_numbers(result)
    assert {(r["segments"], r["arch"]) for r in result["runs"]} == {(2, "rmt"), (4, "rmt_cur")}
    (cur,) = [r for r in result["runs"] if r["arch"] == "rmt_cur"]
    assert cur["init_from"].endswith("reverse-S2-rmt")
    from memlm.data_pipeline.tasks import generate

    for run in result["runs"]:
        # Accuracy is over the answer tokens only: test samples x answer length.
        answers = sum(len(s.answer) for s in generate("reverse", "test", {"length": run["task_length"],
                                                                         "docs": "64,16,16", "seed": 0}))
        assert run["scored_tokens"] == answers and 0.0 <= run["accuracy"] <= 1.0
        assert run["segments_spanned"] == run["segments"]  # L was chosen so a sample spans exactly S segments


def test_progress_line_reads_the_step_and_rate_of_a_training(tmp_path):
    """The ETA comes from the run's metrics.jsonl: steps between two rows over the time between their writes."""
    from memlm.bench.reproduce.children import Child

    metrics = tmp_path / "metrics.jsonl"
    child = Child("txl-s1", "train", proc=None, run_dir=tmp_path, steps=100, started=1000.0)
    assert child.position().startswith("txl-s1 train for ")  # no row yet: the time since it started
    metrics.write_text(json.dumps({"step": 10, "loss": 5.0}) + "\n")
    os.utime(metrics, (1010.0, 1010.0))
    assert child.position() == "txl-s1 train step 10/100, ETA 1:30"  # 10 steps in its first 10 s, start-up included
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 30, "loss": 4.0}) + "\n")
    os.utime(metrics, (1050.0, 1050.0))
    assert child.position() == "txl-s1 train step 30/100, ETA 2:20"  # 20 steps in the 40 s since the first row
    assert child.position(eta=False) == "txl-s1 train step 30/100"


def _accuracy_reference(model, data: Path, split: str) -> tuple[int, int]:
    """(correct, scored): every document alone from an empty memory, one position at a time in Python."""
    from memlm.data_pipeline.shards import read_shard

    manifest = json.loads((data / "manifest.json").read_text())
    boundary = manifest["tokenizer"]["boundary_id"]
    n = model.cfg.tgt_len
    correct = scored = 0
    with torch.no_grad():
        for shard in manifest["splits"][split]["shards"]:
            for doc in read_shard(data / shard["path"]):
                ids = [int(t) for t in doc["tokens"]]
                mask = [int(m) for m in doc["mask"]]
                inputs = [boundary] + ids[:-1]
                memory = model.init_memory(batch_size=1)
                for start in range(0, len(ids), n):
                    chunk = inputs[start:start + n]
                    x = torch.tensor([chunk + [0] * (n - len(chunk))])
                    out = model(x, memory, reset=torch.tensor([start == 0]), return_logits=True)
                    memory = out.memory
                    for i in range(len(chunk)):
                        if mask[start + i]:
                            scored += 1
                            row = out.logits[0, i].tolist()
                            correct += int(max(range(len(row)), key=row.__getitem__) == ids[start + i])
    return correct, scored


def test_eval_accuracy_matches_a_per_position_reference(tmp_path):
    from memlm.data_pipeline.prepare import prepare
    from memlm.models import build_model
    from memlm.models.config import ModelConfig
    from memlm.trainer.inference.evaluate import evaluate

    data = tmp_path / "reverse"
    prepare("task", None, data, task="reverse", task_options={"length": 5, "docs": "8,6,6", "seed": 3},
            workers=1, progress=False)
    torch.manual_seed(0)
    for arch, extra in (("txl", {"mem_len": 4}), ("rmt", {"mem_len": 0, "num_mem_tokens": 2})):
        cfg = ModelConfig(arch=arch, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, vocab_size=256,
                          tgt_len=4, **extra)
        model = build_model(cfg).eval()
        correct, scored = _accuracy_reference(model, data, "test")
        result = evaluate(model, data, "test", lanes=3, seg_len=4, accuracy=True)
        assert result["tokens"] == scored == 6 * 5 and correct > 0  # an untrained model still hits some letters
        assert result["accuracy"] == correct / scored, (arch, result["accuracy"], correct, scored)
        assert "accuracy" not in evaluate(model, data, "test", lanes=3, seg_len=4)
