"""`memlm sweep`: real Ray Tune trials running the real trainer, real MLflow on SQLite in tmp_path.

Cost: each Tune trial process takes 10-15 s to start here (docs/design.md §9), so the sweeps are tiny (10 steps, 2
trials at a time) and the crash test shares the 4-trial grid sweep: one trial is SIGKILLed for real after its
first checkpoint and must be retried from that checkpoint while the sweep goes on. The in-process sweeps use the
session's local Ray (`local_ray`, xdist group "ray"); the resume test runs `memlm sweep` as a subprocess with its
own local Ray, because it interrupts the whole command (Ctrl-C) and runs it again.
The first DeepSpeed start on a machine JIT-builds its shared-memory op (~1 min, cached afterwards).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from memlm.cluster.sweep_config import load_sweep
from memlm.trainer.config.run_config import ConfigError
from support.ray_listeners import ListenerWatch, address_namespace
from support.training import REPO, child_env, make_data

# `-m 'not slow'` leaves these out: Ray Tune sweeps of real trainings, 7 min in all on 2 busy cores
pytestmark = pytest.mark.slow

CONFIGS = REPO / "configs"
SWEEP_PRESETS = sorted((CONFIGS / "sweeps").glob("*.yaml"))
TINY_SWEEP = CONFIGS / "sweeps" / "tiny_grid.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("sweep_data"))


def mlflow_runs(db: Path, experiment: str):
    """The sweep's parent run and its children, from the sweep's own experiment (sweep-<name> by default)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name(experiment)
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("memlm.kind") == "sweep"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return parents[0], children


def trials_table(sweep_dir: Path) -> list[dict]:
    with (sweep_dir / "trials.csv").open() as f:
        return list(csv.DictReader(f))


# --- the sweep file --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", SWEEP_PRESETS, ids=lambda p: p.stem)
def test_every_sweep_preset_parses(preset):
    sweep = load_sweep(preset)  # builds and validates the run config at every extreme of the space
    assert sweep.space and sweep.base_path.is_file()
    # configs/sweeps/'s one naming rule: a file is named after its sweep (name: tiny-grid -> tiny_grid.yaml)
    assert preset.stem == sweep.name.replace("-", "_")


def test_a_sweep_preset_loads_by_name_as_by_path():
    by_name, by_path = load_sweep("sweeps/tiny_grid"), load_sweep(TINY_SWEEP)
    assert by_name.path == TINY_SWEEP.resolve() == by_path.path
    assert by_name.signature() == by_path.signature() and by_name.base_tree == by_path.base_tree
    assert by_name.base_path == (CONFIGS / "tiny" / "lamemo.yaml").resolve()  # its `base: tiny/lamemo`


def test_base_is_a_file_beside_the_sweep_file_before_a_preset(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "lamemo").write_text("inherit: tiny/lamemo\nmodel: {n_layer: 3}\n")  # a file, no suffix
    (tmp_path / "sweep.yaml").write_text("base: tiny/lamemo\nspace:\n  train.lr: {choice: [1.0e-3]}\n")
    sweep = load_sweep(tmp_path / "sweep.yaml")
    assert sweep.base_path == (tmp_path / "tiny" / "lamemo").resolve() and sweep.base_tree["model"]["n_layer"] == 3
    assert sweep.base_tree["model"]["arch"] == "lamemo"  # its own inherit: is the preset


def test_an_unknown_base_names_the_closest_presets(tmp_path):
    (tmp_path / "sweep.yaml").write_text("base: tiny/lamemoo\nspace:\n  train.lr: {choice: [1.0e-3]}\n")
    with pytest.raises(ConfigError) as info:
        load_sweep(tmp_path / "sweep.yaml")
    message = str(info.value)
    assert "\n" not in message and "'base: tiny/lamemoo'" in message, message
    assert "closest presets: tiny/lamemo" in message and "memlm config --list" in message, message


def test_lamemo_table5_space_is_the_papers():
    sweep = load_sweep("sweeps/lamemo_table5")
    assert sweep.base_path == (CONFIGS / "paper" / "wt103" / "lamemo.yaml").resolve()
    assert {d.key: (d.kind, d.values) for d in sweep.space} == {
        "train.lr": ("choice", [1e-4, 2.5e-4, 5e-4]),
        "train.schedule": ("choice", ["linear", "cosine"]),
        "train.warmup_steps": ("choice", [0, 1000, 2000]),
        "train.clip": ("choice", [0.25, 0.5, 1.0]),
        "model.interp_eps": ("choice", [1e-6, 1e-5, 1e-4]),
    }
    assert (sweep.file.num_samples, sweep.file.metric, sweep.file.mode) == (10, "valid_ppl", "min")
    assert sweep.file.scheduler.type == "none"  # the paper used no early stopping


BAD_FILES = {
    "unknown_key": ("metrik: valid_ppl\n", "unknown key 'metrik' (did you mean 'metric'?)"),
    "unknown_space_key": ("space:\n  train.lrr: {choice: [1.0e-3]}\n", "unknown key 'train.lrr'"),
    "empty_space": ("space: {}\n", "'space' is empty"),
    "bad_kind": ("space:\n  train.lr: {choise: [1.0e-3]}\n", "did you mean"),
    "wrong_type": ("space:\n  train.steps: {choice: [10, ten]}\n", "train.steps"),
    "impossible_trial": ("space:\n  train.warmup_steps: {grid: [0, 500]}\n", "warmup_steps=500 exceeds"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_sweep_file_is_one_line_before_ray(case, tmp_path, capsys, data):
    from memlm.cli import main

    body, expected = BAD_FILES[case]
    path = tmp_path / "bad.yaml"
    space = "" if "space:" in body else "space:\n  train.lr: {choice: [1.0e-3]}\n"
    path.write_text(f"base: tiny/lamemo\noverrides: {{train.steps: 10, train.eval_every: 5}}\n"
                    f"{body}{space}")
    out = tmp_path / "sweep"
    started = time.monotonic()
    rc = main(["sweep", str(path), f"data.path={data}", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert "\n" not in err and err.startswith("memlm: error: ") and expected in err, err
    assert time.monotonic() - started < 10  # no Ray start, no trial
    assert not out.exists()  # nothing made: no Tune experiment, no MLflow parent run


def test_wrong_data_path_is_one_line(tmp_path, capsys):
    from memlm.cli import main

    rc = main(["sweep", str(TINY_SWEEP), f"data.path={tmp_path / 'nowhere'}", "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "manifest.json is missing" in err, err


# --- trials that cannot fit the machine or cluster --------------------------------------------------------------


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("memlm: error: "), err
    return err


def test_trials_that_cannot_fit_are_refused_before_ray_starts(tmp_path, capsys, data, monkeypatch):
    """The shipped Table 5 sweep asks for a GPU per trial: on a machine without one Ray would queue the trials
    forever. It is refused in one line naming what is asked, what the local Ray would have and the fix."""
    from memlm.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for Ray, also on a machine that has one
    out = tmp_path / "sweep"
    table5 = "sweeps/lamemo_table5"
    assert main(["sweep", table5, f"data.path={data}", "--out", str(out), "--num-cpus", "4"]) == 2
    err = one_error_line(capsys)
    assert "each trial asks for 4 CPUs and 1 GPU" in err and "the local Ray would have 4 CPUs and 0 GPUs" in err
    assert "resources.gpus=0" in err and not out.exists(), err
    # More CPUs than the local Ray gets: the fix names both ways, smaller trials or a bigger local Ray.
    assert main(["sweep", str(TINY_SWEEP), f"data.path={data}", "resources.cpus=3", "--num-cpus", "2",
                 "--out", str(out)]) == 2
    err = one_error_line(capsys)
    assert "asks for 3 CPUs" in err and "resources.cpus=2" in err and "--num-cpus 3" in err and not out.exists()


def test_sweep_file_keys_can_be_overridden_on_the_command_line():
    sweep = load_sweep("sweeps/lamemo_table5", ["resources.gpus=0", "resources.cpus=2",
                                                                "max_concurrent=1", "train.steps=5000"])
    assert (sweep.file.resources.gpus, sweep.file.resources.cpus, sweep.file.max_concurrent) == (0, 2, 1)
    assert sweep.fixed["train.steps"] == 5000  # a run-config key still goes to every trial
    with pytest.raises(ConfigError, match="did you mean 'resources.gpus'"):
        load_sweep("sweeps/lamemo_table5", ["resources.gpu=0"])


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
def test_cluster_without_the_trials_resources_is_refused_before_tune(tmp_path, data, capsys, monkeypatch):
    """--address: the cluster's resources are read right after connecting (here the session's local Ray, 2 CPUs,
    no GPU); nothing runs and no MLflow run is made."""
    from memlm.cli import main

    monkeypatch.chdir(tmp_path)
    rc = main(["sweep", str(TINY_SWEEP), f"data.path={data}", "resources.gpus=1", "--address", "auto",
               "--out", str(tmp_path / "sweep")])
    assert rc == 2
    err = one_error_line(capsys)
    assert "asks for 1 CPU and 1 GPU" in err and "the Ray cluster at auto has 2 CPUs and 0 GPUs" in err, err
    assert not (tmp_path / "mlflow.db").exists()


# --- a 4-trial grid sweep, one trial killed once ---------------------------------------------------------------


class TrialKiller(threading.Thread):
    """SIGKILLs the Ray process of the first trial whose run folder gets a checkpoint (the crash is real: no
    exception, no cleanup). Trial processes are descendants of this test process (the local Ray's raylet is
    our child); Tune runs each trial in a working folder named after the trial id (trial_dirname)."""

    def __init__(self, sweep_dir: Path):
        super().__init__(daemon=True)
        self.sweep_dir = sweep_dir
        self.killed: tuple[str, str] | None = None  # (trial id, checkpoint tag at the kill)
        self.error = ""
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        deadline = time.monotonic() + 240
        while not self.stop.is_set() and time.monotonic() < deadline:
            for latest in sorted(self.sweep_dir.glob("trials/*/checkpoints/latest")):
                trial_id = latest.parents[1].name
                for proc in psutil.Process().children(recursive=True):
                    try:
                        if proc.cwd().endswith(trial_id):
                            proc.send_signal(signal.SIGSTOP)  # freeze first: the tag we read is then final
                            tag = latest.read_text().strip()
                            proc.kill()
                            self.killed = (trial_id, tag)
                            return
                    except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
                        continue
                self.error = f"no process found for trial {trial_id}"
            time.sleep(0.02)


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
def test_grid_sweep_with_a_killed_trial(tmp_path, data, capsys, monkeypatch):
    from memlm.cli import main

    monkeypatch.chdir(tmp_path)  # the default MLflow store: ./mlflow.db, made absolute for the trials
    sweep_dir = tmp_path / "sweep"
    killer = TrialKiller(sweep_dir)
    killer.start()
    rc = main(["sweep", str(TINY_SWEEP), f"data.path={data}", "--out", str(sweep_dir)])
    killer.stop.set()
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert killer.killed is not None, killer.error or "the killer never found a checkpoint"

    # Tune: 4 finished trials; the killed one failed once and was retried.
    table = trials_table(sweep_dir)
    assert len(table) == 4 and {r["status"] for r in table} == {"TERMINATED"}
    assert {(float(r["train.lr"]), int(r["model.mem_len"])) for r in table} == {(1e-3, 4), (1e-3, 16), (3e-3, 4),
                                                                                (3e-3, 16)}
    killed_id, tag = killer.killed
    failures = {r["trial_id"]: int(r["failures"]) for r in table}
    assert failures[killed_id] == 1 and sum(failures.values()) == 1
    (failed,) = [line for line in out.splitlines() if line.startswith(f"trial {killed_id} failed")]
    # one line with the reason (the worker died), not Tune's traceback
    assert failed.startswith(f"trial {killed_id} failed (") and failed.endswith(
        "); retrying from its last checkpoint (failure 1)") and "Traceback" not in out, out[-3000:]

    # The retry continued from the checkpoint, not from step 0: after the crash, the steps go on at ckpt + 1.
    ckpt_step = int(tag.removeprefix("global_step"))
    assert 0 < ckpt_step < 10  # killed before it finished
    steps = [json.loads(line)["step"] for line in (sweep_dir / "trials" / killed_id / "metrics.jsonl").open()]
    assert steps.count(1) == 1 and set(steps) == set(range(1, 11)) and steps[-1] == 10, steps
    # Rows the killed process logged after its checkpoint are logged again by the retry, from ckpt + 1 on.
    assert [steps[i] for i in range(1, len(steps)) if steps[i] <= steps[i - 1]] in ([], [ckpt_step + 1]), steps

    # MLflow: one parent with the sweep's outcome, four children (one per trial) with params and metrics.
    parent, children = mlflow_runs(tmp_path / "mlflow.db", "sweep-tiny-grid")
    assert parent.info.status == "FINISHED" and len(children) == 4
    assert {c.data.tags["memlm.trial_id"] for c in children} == {r["trial_id"] for r in table}
    # Run names tell the trials apart in the UI: arch, sweep, the trial's number (Tune's id ends in it).
    assert {c.info.run_name for c in children} == {f"lamemo-tiny-grid-{r['trial_id'].rsplit('_', 1)[1]}"
                                                   for r in table}
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.params["train.steps"] == "10" and "train.lr" in child.data.params
        assert {"loss", "valid_ppl", "lr"} <= set(child.data.metrics)
    best_child = min(children, key=lambda c: c.data.metrics["valid_ppl"])
    best = json.loads((sweep_dir / "best.json").read_text())
    assert best["valid_ppl"] == pytest.approx(best_child.data.metrics["valid_ppl"])
    assert parent.data.metrics["best_valid_ppl"] == pytest.approx(best_child.data.metrics["valid_ppl"])
    assert parent.data.tags["best.trial_id"] == best["trial_id"]
    assert float(parent.data.tags["best.train.lr"]) == float(best_child.data.params["train.lr"])
    assert f"best: trial {best['trial_id']} valid_ppl=" in out
    assert {"sweep.yaml", "trials.csv", "best.json"} <= {
        Path(a.path).name for a in _artifacts(tmp_path / "mlflow.db", parent.info.run_id)}


def _artifacts(db: Path, run_id: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{db}").list_artifacts(run_id)


# --- an interrupted sweep resumes ------------------------------------------------------------------------------


def _sweep_cmd(sweep_file: Path, sweep_dir: Path, data: Path) -> list[str]:
    return [sys.executable, "-m", "memlm", "sweep", str(sweep_file), f"data.path={data}", "--out", str(sweep_dir),
            "--num-cpus", "2"]


# Two trials one after the other: the cheapest sweep that can be stopped with one trial finished and one under way.
# A tiny step takes ~25 ms: 100 steps with the first checkpoint at step 20 leave seconds to interrupt in (with 10
# steps the second trial could finish between two polls; 200 cost the suite 200 more steps for no check).
SERIAL_STEPS = 100
SERIAL_SWEEP = f"""\
name: serial
base: tiny/lamemo
overrides: {{train.steps: {SERIAL_STEPS}, train.eval_every: 50, train.save_every: 20, train.eval_batches: 2,
             train.warmup_steps: 0, train.log_every: 10}}
space:
  train.lr: {{grid: [1.0e-3, 3.0e-3]}}
max_concurrent: 1
"""


@pytest.mark.xdist_group("ray")
def test_interrupted_sweep_resumes_without_redoing_finished_trials(tmp_path, data):
    sweep_dir = tmp_path / "sweep"
    sweep_file = tmp_path / "serial.yaml"
    sweep_file.write_text(SERIAL_SWEEP)
    # The driver carries launcher variables, as a process that trained in-process does (trainer.runtime.distributed sets
    # them), with MASTER_PORT on a port that is taken: trials must not inherit them (each binds its own port).
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    env = child_env({"RAY_AUTH_MODE": "disabled", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy.getsockname()[1])})
    log = (tmp_path / "first.log").open("w+")
    # Both runs in a network where Ray would discover a non-loopback node address: every socket that the local
    # Ray, its workers and the trials open must still be on loopback (tests/support/ray_listeners.py).
    netns = address_namespace()
    cmd = _sweep_cmd(sweep_file, sweep_dir, data)
    proc = subprocess.Popen(netns + cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    watch = ListenerWatch(proc.pid)
    watch.start()
    try:
        # Interrupt once one trial finished and the other is under way with a checkpoint.
        # Generous: on a loaded 2-core machine the second trial's first checkpoint once came after more than 240 s.
        deadline, ready = time.monotonic() + 600, False
        while not ready and time.monotonic() < deadline and proc.poll() is None:
            log.seek(0)
            done = [line.split()[1] for line in log.read().splitlines() if " finished: valid_ppl=" in line]
            ongoing = [p.parents[1].name for p in sweep_dir.glob("trials/*/checkpoints/latest")
                       if p.parents[1].name not in done]
            ready = bool(done and ongoing)
            time.sleep(0 if ready else 0.2)
        assert proc.poll() is None, "the sweep ended before it could be interrupted"
        log.seek(0)
        assert ready, "no moment with one trial finished and the other checkpointed: " + log.read()[-2000:]
        proc.send_signal(signal.SIGINT)  # Ctrl-C to the driver: Tune saves its state and stops the running trials
        first_rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log.seek(0)
    first = log.read()
    assert "EADDRINUSE" not in first and "; retrying from its last checkpoint" not in first, first[-3000:]
    finished = [line.split()[1] for line in first.splitlines() if " finished: valid_ppl=" in line]
    assert len(finished) == 1 and first_rc == 130, first[-3000:]
    interrupted = [p.parents[1].name for p in sweep_dir.glob("trials/*/checkpoints/latest")
                   if p.parents[1].name not in finished]
    assert interrupted
    # The interrupted sweep's story: the finished trial with its own metric (and the best), the other one
    # interrupted (not PENDING, not best); memlm's line, not Ray's Tuner.restore hint (kept in library.log).
    (done,) = finished
    first_table = {r["trial_id"]: r for r in trials_table(sweep_dir)}
    assert first_table[done]["status"] == "TERMINATED" and first_table[done]["step"] == str(SERIAL_STEPS)
    assert float(first_table[done]["valid_ppl"]) == pytest.approx(own_valid_ppl(sweep_dir, done))
    assert {first_table[t]["status"] for t in interrupted} == {"INTERRUPTED"}
    assert json.loads((sweep_dir / "best.json").read_text())["trial_id"] == done
    assert "interrupted with 1 of 2 trials unfinished; rerun the same command to resume" in first
    assert "Tuner.restore" not in first and "Stop signal received" not in first, first[-3000:]
    assert "Tuner.restore" in (sweep_dir / "library.log").read_text()
    _, children = mlflow_runs(tmp_path / "mlflow.db", "sweep-serial")
    assert {c.data.tags["memlm.trial_id"]: c.info.status for c in children} == {
        done: "FINISHED", **{t: "KILLED" for t in interrupted}}  # not left RUNNING
    before = {t: (sweep_dir / "trials" / t / "metrics.jsonl").read_bytes() for t in finished}

    second_proc = subprocess.Popen(netns + cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    watch_second = ListenerWatch(second_proc.pid)
    watch_second.start()
    out, err = second_proc.communicate(timeout=300)
    second = subprocess.CompletedProcess(cmd, second_proc.returncode, out, err)
    busy.close()
    for run in (watch, watch_second):
        seen = run.finish()
        assert len(seen) >= 5, seen  # the watch saw the local Ray's servers (GCS, raylet, workers, agents)
        assert not run.not_loopback(), f"listening beyond loopback during a sweep: {run.not_loopback()}"
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming" in second.stdout
    started_again = {line.split()[1] for line in second.stdout.splitlines() if " started: " in line}
    assert not started_again & set(finished)  # finished trials were not run again ...
    for trial_id, content in before.items():  # ... nor their run folders touched
        assert (sweep_dir / "trials" / trial_id / "metrics.jsonl").read_bytes() == content
    for trial_id in interrupted:  # an interrupted trial continued from its checkpoint, not from step 0
        steps = [json.loads(line)["step"] for line in (sweep_dir / "trials" / trial_id / "metrics.jsonl").open()]
        assert steps.count(10) == 1 and steps[-1] == SERIAL_STEPS, steps
    table = trials_table(sweep_dir)
    assert len(table) == 2 and {r["status"] for r in table} == {"TERMINATED"}
    parent, children = mlflow_runs(tmp_path / "mlflow.db", "sweep-serial")
    assert parent.info.status == "FINISHED" and len(children) == 2  # a resumed trial keeps its MLflow run
    assert {c.info.status for c in children} == {"FINISHED"}

    # What the resumed sweep reports is each trial's own: status, step and metric as its run folder records
    # them; no "stopped early" (there is no scheduler); the best is the trial with the lower metric.
    own = {t: own_valid_ppl(sweep_dir, t) for t in (*finished, *interrupted)}
    assert {r["trial_id"]: (r["status"], r["step"]) for r in table} == {t: ("TERMINATED", str(SERIAL_STEPS))
                                                                           for t in own}
    assert {r["trial_id"]: float(r["valid_ppl"]) for r in table} == pytest.approx(own)
    for trial_id in interrupted:  # the resumed trial's own final result, as it finished
        assert f"trial {trial_id} finished: valid_ppl={own[trial_id]:.4g} at step {SERIAL_STEPS}" in second.stdout
    assert "stopped early" not in second.stdout + first and "ended before" not in second.stdout + first
    assert json.loads((sweep_dir / "best.json").read_text())["trial_id"] == min(own, key=own.get)
    assert {c.data.tags["memlm.trial_id"]: c.data.metrics["valid_ppl"] for c in children} == pytest.approx(own)
    assert "Tuner.restore" not in second.stdout + second.stderr
    assert "FileNotFoundError" not in second.stdout + second.stderr


def own_valid_ppl(sweep_dir: Path, trial_id: str) -> float:
    """A trial's validation perplexity at its last step, from its own run folder."""
    return json.loads((sweep_dir / "trials" / trial_id / "eval" / f"step{SERIAL_STEPS}.json").read_text())["ppl"]


# --- early stopping with ASHA ---------------------------------------------------------------------------------

# A strong trial first, then a hopeless one (lr 1e-5 barely moves): ASHA (rungs at steps 2 and 4 of 6) must stop
# the second at its first rung. One at a time, so the strong trial's results are in each rung first.
ASHA_SWEEP = """\
name: asha
base: tiny/lamemo
overrides: {train.steps: 6, train.eval_every: 2, train.save_every: 2, train.eval_batches: 2, train.warmup_steps: 0}
space:
  train.lr: {grid: [3.0e-2, 1.0e-5]}
scheduler: {type: asha, grace_period: 2, reduction_factor: 2}
max_concurrent: 1
"""


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
def test_asha_stops_the_weak_trial_and_the_strong_one_ends_cleanly(tmp_path, data, capsys, monkeypatch):
    from memlm.cli import main

    monkeypatch.chdir(tmp_path)
    sweep_file = tmp_path / "asha.yaml"
    sweep_file.write_text(ASHA_SWEEP)
    sweep_dir = tmp_path / "sweep"
    rc = main(["sweep", str(sweep_file), f"data.path={data}", "--out", str(sweep_dir)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    rows = {float(r["train.lr"]): r for r in trials_table(sweep_dir)}
    strong, weak = rows[3e-2], rows[1e-5]
    assert (strong["status"], strong["step"]) == ("TERMINATED", "6")
    assert weak["status"] == "STOPPED" and int(weak["step"]) < 6, weak
    assert f"trial {weak['trial_id']} stopped early by the scheduler" in out
    # ASHA stops every trial at max_t (= train.steps): that must come after the final checkpoint and MLflow end.
    latest = sweep_dir / "trials" / strong["trial_id"] / "checkpoints" / "latest"
    assert latest.read_text().strip() == "global_step6"
    _, children = mlflow_runs(tmp_path / "mlflow.db", "sweep-asha")
    status = {c.data.tags["memlm.trial_id"]: c for c in children}
    assert status[strong["trial_id"]].info.status == "FINISHED"
    assert status[weak["trial_id"]].info.status == "KILLED"
    assert status[weak["trial_id"]].data.tags["memlm.stopped_early"] == f"step {weak['step']}"
    assert json.loads((sweep_dir / "best.json").read_text())["trial_id"] == strong["trial_id"]


# --- several DeepSpeed ranks per trial through Ray Train -------------------------------------------------------


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("local_ray")
def test_trial_with_two_deepspeed_workers(tmp_path, data, capsys, monkeypatch):
    """resources.workers: 2 runs the trial as a Ray Train TorchTrainer of 2 gloo ranks, each calling the same
    trainer.loop.train.run (ZeRO-2 here); rank 0's rows reach Tune, so the trial reports its validation metric."""
    from memlm.cli import main

    monkeypatch.chdir(tmp_path)
    sweep_file = tmp_path / "workers.yaml"
    sweep_file.write_text(
        "base: tiny/lamemo\n"
        "overrides: {train.steps: 4, train.eval_every: 2, train.save_every: 2, train.eval_batches: 2, "
        "train.warmup_steps: 0, deepspeed.zero_stage: 2}\n"
        "space:\n  train.lr: {grid: [1.0e-3]}\n"
        "resources: {cpus: 0.9, workers: 2}\n"  # 2 x 0.9 + the waiting trial's 0.01 fit the test Ray's 2 CPUs
        "max_failures: 0\n")
    sweep_dir = tmp_path / "sweep"
    rc = main(["sweep", str(sweep_file), f"data.path={data}", "--out", str(sweep_dir)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    (row,) = trials_table(sweep_dir)
    assert row["status"] == "TERMINATED" and row["step"] == "4" and float(row["valid_ppl"]) > 1
    ckpt = sweep_dir / "trials" / row["trial_id"] / "checkpoints" / "global_step4"
    assert json.loads((ckpt / "meta.json").read_text())["world_size"] == 2
    assert (ckpt / "rank1.pt").is_file() and (ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    parent, (child,) = mlflow_runs(tmp_path / "mlflow.db", "sweep-workers")
    assert child.data.metrics["valid_ppl"] == pytest.approx(float(row["valid_ppl"]))
    assert child.data.params["deepspeed.zero_stage"] == "2"


# --- pieces without Ray running --------------------------------------------------------------------------------


def test_reporter_sends_rows_that_carry_the_metric_with_the_latest_loss():
    from memlm.cluster.sweep_trial import TuneReporter

    sent: list[dict] = []
    reporter = TuneReporter("valid_ppl", sent.append)
    for step in (1, 2):
        reporter({"step": step, "loss": 5.0 - step})
    reporter({"step": 2, "valid_nll": 4.0, "valid_ppl": 54.6, "valid_bpc": 5.8})
    reporter({"step": 3, "loss": 1.5})
    assert sent == [{"step": 2, "loss": 3.0, "valid_nll": 4.0, "valid_ppl": 54.6, "valid_bpc": 5.8}]
    reporter.final()  # training went on after the last validation: one final result at the last step
    assert sent[-1] == {"step": 3, "loss": 1.5, "valid_nll": 4.0, "valid_ppl": 54.6, "valid_bpc": 5.8}
    reporter.final()
    assert len(sent) == 2  # nothing new: no duplicate


def test_reporter_holds_the_last_steps_result_until_training_returned():
    from memlm.cluster.sweep_trial import TuneReporter

    sent: list[dict] = []
    reporter = TuneReporter("valid_ppl", sent.append, last_step=4)
    reporter({"step": 2, "loss": 3.0, "valid_ppl": 20.0})
    reporter({"step": 4, "loss": 2.0, "valid_ppl": 10.0})  # the last step: a stop here would skip the final save
    assert [r["step"] for r in sent] == [2]
    reporter.final()
    assert sent[-1] == {"step": 4, "loss": 2.0, "valid_ppl": 10.0} and len(sent) == 2


def test_reporter_final_sends_the_run_folders_result_when_nothing_was_trained():
    """A restored sweep restarts a trial that had trained its last step just before the interrupt: the trainer
    has nothing left to do, and the trial's result is what its run folder records, not Tune's stale one."""
    from memlm.cluster.sweep_trial import TuneReporter

    sent: list[dict] = []
    TuneReporter("valid_ppl", sent.append, last_step=10).final({"step": 10, "valid_ppl": 12.5})
    assert sent == [{"step": 10, "valid_ppl": 12.5}]
    reporter = TuneReporter("valid_ppl", sent.append, last_step=10)
    reporter({"step": 10, "loss": 2.0, "valid_ppl": 9.0})  # trained here: its own last row wins
    reporter.final({"step": 10, "valid_ppl": 12.5})
    assert sent[-1] == {"step": 10, "loss": 2.0, "valid_ppl": 9.0}


def test_trial_status_from_tune_and_the_run_folder(tmp_path):
    from memlm.cluster.sweep import trial_status
    from memlm.trainer.checkpoint.store import META

    def run_dir(name: str, step: int | None) -> Path:
        ckpt = tmp_path / name / "checkpoints"
        ckpt.mkdir(parents=True)
        if step is not None:
            (ckpt / f"global_step{step}").mkdir()
            (ckpt / f"global_step{step}" / META).write_text("{}")
            (ckpt / "latest").write_text(f"global_step{step}")
        return tmp_path / name

    final, partial, fresh = run_dir("final", 10), run_dir("partial", 5), run_dir("fresh", None)
    assert trial_status("TERMINATED", 10, 10, True, final) == "TERMINATED"
    assert trial_status("TERMINATED", 4, 10, True, partial) == "STOPPED"
    assert trial_status("TERMINATED", 4, 10, False, partial) == "TERMINATED"  # no scheduler: never "stopped"
    assert trial_status("ERROR", 4, 10, False, partial) == "ERROR"
    # Tune saved these as PENDING at Ctrl-C; the run folders say what they were
    assert trial_status("PENDING", 10, 10, False, final) == "TERMINATED"
    assert trial_status("PENDING", 5, 10, False, partial) == "INTERRUPTED"
    assert trial_status("PENDING", None, 10, False, fresh) == "PENDING"


@pytest.mark.parametrize("scheduled", [False, True])
def test_progress_says_stopped_early_only_with_a_scheduler(capsys, scheduled):
    from types import SimpleNamespace

    from memlm.cluster.sweep_progress import Progress

    trial = SimpleNamespace(trial_id="a_00001", last_result={"step": 4, "valid_ppl": 2.0}, config={})
    Progress("valid_ppl", 10, scheduled=scheduled).on_trial_complete(0, [], trial)
    reason = "stopped early by the scheduler" if scheduled else "ended before its last step"
    assert capsys.readouterr().out == f"trial a_00001 {reason}: valid_ppl=2 at step 4 of 10\n"


def test_search_space_kinds_and_asha(tmp_path):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from memlm.cluster.sweep import _param_space, _scheduler

    path = tmp_path / "s.yaml"
    path.write_text("base: tiny/lamemo\n"
                    "space:\n  train.lr: {loguniform: [1.0e-4, 1.0e-2]}\n  train.clip: {uniform: [0.1, 1.0]}\n"
                    "  model.mem_len: {randint: [4, 17]}\n  train.schedule: {choice: [linear, cosine]}\n"
                    "scheduler: {type: asha, grace_period: 5}\n")
    sweep = load_sweep(path)
    space = _param_space(sweep)
    assert isinstance(space["train.lr"], tune.search.sample.Float) and space["model.mem_len"].upper == 17
    asha = _scheduler(sweep)
    assert isinstance(asha, ASHAScheduler) and asha._time_attr == "step" and asha._max_t == 20  # tiny: 20 steps
    # randint's upper bound is excluded: the checked extreme is 16; an int key refuses a float range
    assert [d.candidates() for d in sweep.space if d.key == "model.mem_len"] == [[4, 16]]
    path.write_text("base: tiny/lamemo\nspace:\n  model.mem_len: {uniform: [4, 16]}\n")
    with pytest.raises(ConfigError, match="space.model.mem_len.uniform"):
        load_sweep(path)


def test_a_failed_trials_reason_is_read_from_tunes_text_error_file(tmp_path):
    """The reason in a trial's failure line comes from Tune's error.txt (never its pickled exception): the last
    "SomeError: message" of the newest failure's traceback, or a dead worker's bare message."""
    from types import SimpleNamespace

    from memlm.cluster.sweep_progress import _reason

    error = tmp_path / "error.txt"
    error.write_text("Failure # 1 (occurred at 2026-11-25_16-38-37)\nThe actor died unexpectedly before finishing "
                     "this task.\n\tclass_name: ImplicitFunc\n"
                     "Failure # 2 (occurred at 2026-11-25_16-39-01)\nray::ImplicitFunc.train() (pid=1, ip=127.0.0.1)\n"
                     "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
                     "data_pipeline.format.DataError: evaluating split 'valid': no tokens\n")
    assert _reason(SimpleNamespace(error_file=str(error))) == " (DataError: evaluating split 'valid': no tokens)"
    error.write_text("Failure # 1 (occurred at 2026-11-25_16-38-37)\nThe actor died unexpectedly before finishing "
                     "this task.\n\tpid: 15163\n")
    expected = " (The actor died unexpectedly before finishing this task.)"
    assert _reason(SimpleNamespace(error_file=str(error))) == expected
    assert _reason(SimpleNamespace(error_file=str(tmp_path / "absent.txt"))) == ""
