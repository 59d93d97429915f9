"""A run folder holds one run (trainer/checkpoint/run_folder.py): a second `train` into it without --resume is refused
in one
line and changes nothing, --overwrite starts over, a resume rewinds metrics and evaluations to its checkpoint, and
no save deletes the checkpoint `latest` names. Plus the command line's handling of overrides after an option."""

from __future__ import annotations

import json

import pytest

from memlm.cli import main
from support.training import make_data, metrics, overrides, preset

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("run_folder_data"))


def snapshot(run) -> dict:
    """Every file of the folder with its bytes: what "nothing changed" means."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_second_train_is_refused_in_one_line_and_overwrite_starts_over(data, tmp_path, capsys):
    run = tmp_path / "run"
    # Overrides after the option, as users type them.
    assert main(["train", preset("txl"), "--out", str(run), *overrides(data, train__steps=3)]) == 0
    before = snapshot(run)
    capsys.readouterr()

    assert main(["train", preset("lamemo"), *overrides(data, train__steps=2), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"memlm: error: {run} already holds a run (checkpoints up to step 3, 3 metrics rows): "
                                "pass --resume to continue it, or --out NEW_DIR to start a new run (--overwrite "
                                "deletes this one first)"]
    assert snapshot(run) == before

    assert main(["train", preset("txl"), *overrides(data), "--out", str(run), "--resume", "--overwrite"]) == 2
    assert "pass one of them" in capsys.readouterr().err
    assert snapshot(run) == before

    assert main(["train", preset("txl"), *overrides(data, train__steps=2), "--out", str(run), "--overwrite"]) == 0
    assert [row["step"] for row in metrics(run)] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["global_step2", "latest"]


def test_resume_rewinds_metrics_and_evaluations_and_never_prunes_latest(data, tmp_path, capsys):
    """Checkpoints 2 and 4, then `latest` edited back to 2 (what the error messages suggest when a checkpoint is
    damaged) and a resume to step 3 with keep_last=1: rows and evaluations of steps 3-4 from the first pass are
    gone, step 3 appears once, and the save of step 3 keeps itself (`latest`) whatever keep_last says."""
    run = tmp_path / "run"
    common = overrides(data, train__steps=4, train__save_every=2, train__keep_last=2, train__eval_every=1,
                       train__eval_batches=1)
    assert main(["train", preset("txl"), *common, "--out", str(run)]) == 0
    assert [row["step"] for row in metrics(run)] == [1, 2, 3, 4]
    (run / "checkpoints" / "latest").write_text("global_step2\n")
    capsys.readouterr()

    assert main(["train", preset("txl"), *common, "train.keep_last=1", "--out", str(run), "--resume",
                 "--stop-at", "3"]) == 0
    err = capsys.readouterr().err
    assert f"memlm train: resumed from {run / 'checkpoints' / 'global_step2'} at step 2" in err.splitlines()
    assert [row["step"] for row in metrics(run)] == [1, 2, 3]
    assert sorted(p.name for p in (run / "eval").glob("step*.json")) == ["step1.json", "step2.json", "step3.json"]
    assert json.loads((run / "eval" / "step3.json").read_text())["step"] == 3
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "global_step3"
    assert (ckpts / "global_step3" / "meta.json").is_file()
    # The abandoned pass's later checkpoint is nobody's `latest`; it is left alone, the older one is pruned.
    assert sorted(p.name for p in ckpts.glob("global_step*")) == ["global_step3", "global_step4"]


def test_an_unknown_argument_is_one_line_without_a_doubled_prefix(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "cfg.yaml", "--out", "x", "bogus"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "memlm: error: train: unrecognized arguments: bogus (see `memlm train --help`)"]
