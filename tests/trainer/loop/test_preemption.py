"""SIGTERM and Ctrl-C as users and schedulers send them (trainer/loop/preemption.py, memlm/cli.py).

The signal arrives at a chosen point through the trainer's test hook (MEMLM_TEST_KILL with MEMLM_TEST_SIGNAL), as
from a scheduler or a terminal; bit-exact resume after each is in tests/trainer/checkpoint/test_kill_matrix.py. Here:
the MLflow run
ends KILLED and the resume brings it back to FINISHED; a SIGTERM whose step boundary does not come within
train.stop_grace_s leaves without a checkpoint and the previous one intact; Ctrl-C in `memlm eval` is one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memlm.cli import main
from support.training import REPO, child_env, eval_signalled, make_data, metrics, overrides, preset

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("preemption_data"))


def train_cmd(data, run, **extra) -> list[str]:
    return [sys.executable, "-m", "memlm", "train", preset("txl"), *overrides(data, **extra), "--out", str(run)]


def memlm_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("memlm")]


def test_sigterm_saves_exits_143_and_marks_the_mlflow_run_killed_until_resumed(data, tmp_path, capsys):
    from mlflow import MlflowClient

    run, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    settings = dict(train__steps=6, train__save_every=100, tracking__enabled="true", tracking__uri=uri,
                    tracking__experiment="preemption")
    hook = {"MEMLM_TEST_KILL": "step:3", "MEMLM_TEST_SIGNAL": "TERM"}
    proc = subprocess.run(train_cmd(data, run, **settings), cwd=REPO, env=child_env(hook), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = memlm_lines(proc.stderr)
    assert lines[-3:] == [
        "memlm train: SIGTERM received: saving a checkpoint at the end of this step (within 30 s, train.stop_grace_s)",
        f"memlm train: checkpoint saved at step 3: {run / 'checkpoints' / 'global_step3'}",
        f"memlm train: stopped by SIGTERM after step 3; the last checkpoint is {run / 'checkpoints' / 'global_step3'}: "
        "rerun with --resume to continue"], lines
    client = MlflowClient(uri)
    run_id = (run / "mlflow_run_id").read_text().strip()
    assert client.get_run(run_id).info.status == "KILLED"

    capsys.readouterr()
    assert main(["train", preset("txl"), *overrides(data, **settings), "--out", str(run), "--resume"]) == 0
    assert (run / "mlflow_run_id").read_text().strip() == run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [row["step"] for row in metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_a_trial_stopped_from_outside_ends_its_mlflow_run_killed(data, tmp_path):
    """Ray Tune stops a trial (ASHA at a rung) by sys.exit(0) inside tune.report, in the trainer's reporter call:
    the trainer's own end of the MLflow run must say KILLED (ended from outside), never FAILED. The sweep settles
    the same status afterwards, but the trial's thread may write after it."""
    from mlflow import MlflowClient

    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.train import run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(preset("txl"), overrides(data, train__steps=6, train__eval_every=2, train__eval_batches=1,
                                               tracking__enabled="true", tracking__uri=uri,
                                               tracking__experiment="stopped-trial"))

    def tune_report_that_stops(row: dict) -> None:
        if "valid_ppl" in row:
            raise SystemExit(0)  # what ray.tune.report does in a trial the scheduler stopped

    with pytest.raises(SystemExit):
        run(cfg, tmp_path / "run", reporter=tune_report_that_stops)
    run_id = (tmp_path / "run" / "mlflow_run_id").read_text().strip()
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"


def test_sigterm_without_a_step_boundary_within_the_grace_leaves_the_last_checkpoint(data, tmp_path):
    """SIGTERM mid-step 3, then the save it asks for hangs (a test hook sleeps inside it) past a 1 s grace: exit
    143 with one line, no checkpoint 3 (its aside folder is never published), `latest` still names step 2."""
    run = tmp_path / "run"
    hook = {"MEMLM_TEST_KILL": "step:3", "MEMLM_TEST_SIGNAL": "TERM", "MEMLM_TEST_SLEEP_IN_SAVE": "3:120"}
    proc = subprocess.run(train_cmd(data, run, train__steps=6, train__save_every=2, train__stop_grace_s=1),
                          cwd=REPO, env=child_env(hook), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert memlm_lines(proc.stderr)[-1] == (
        f"memlm train: no step boundary within 1 s of SIGTERM: leaving without a new checkpoint; the last checkpoint "
        f"is {run / 'checkpoints' / 'global_step2'}: rerun with --resume to continue")
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step2"
    assert not (run / "checkpoints" / "global_step3").exists()


def test_ctrl_c_during_memlm_eval_is_one_line_and_exit_130(data, tmp_path):
    """SIGINT arrives while the third evaluation batch is read (a stream that sends it to its own process, as a
    terminal's Ctrl-C would reach it): one line, exit 130, no traceback, no result file."""
    run = tmp_path / "run"
    assert main(["train", preset("txl"), *overrides(data, train__steps=2), "--out", str(run)]) == 0
    target = tmp_path / "result.json"
    proc = eval_signalled(run, target, "SIGINT")
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert memlm_lines(proc.stderr)[-1] == "memlm eval: interrupted (Ctrl-C)"
    assert not target.exists()
