"""`train.init_from` (a run's weights start another run), the trainer's early stop (`stop_when`) and `memlm curriculum`
(stages over samples spanning more and more segments, each from the previous stage's weights, each ended by its
held-out answers): real training, real task corpora. The stop rule and the stage samples' measures are checked
against rows and references written here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from support.training import make_data, train_in_process

ROOT = Path(__file__).resolve().parents[3]
WIKITEXT2 = ROOT.parent / "shared" / "data" / "wikitext-2"


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from memlm.trainer.checkpoint.store import find_checkpoint
    from memlm.trainer.checkpoint.weights import load_weights

    return load_weights(*find_checkpoint(run_dir, None))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("init_from"))


def test_a_run_starts_from_another_runs_weights(data, tmp_path):
    first = tmp_path / "first"
    train_in_process("txl", data, first, train__steps=3)
    # One step at a learning rate of 1e-12 leaves the weights where they started: the first run's.
    common = dict(train__steps=1, train__lr=1e-12, train__warmup_steps=0)
    started = tmp_path / "started"
    train_in_process("txl", data, started, train__init_from=str(first), **common)
    fresh = tmp_path / "fresh"
    train_in_process("txl", data, fresh, **common)
    a, b, c = weights(first), weights(started), weights(fresh)
    assert all(torch.allclose(a[k], b[k], atol=1e-7) for k in a)
    assert not all(torch.allclose(a[k], c[k], atol=1e-4) for k in a)


def test_weights_of_another_model_are_one_line(data, tmp_path, capsys):
    from memlm.cli import main

    first = tmp_path / "first"
    train_in_process("txl", data, first, train__steps=2)
    capsys.readouterr()
    rc = main(["train", "tiny/txl", f"data.path={data}", "model.d_model=48", "train.steps=2",
               f"train.init_from={first}", "--out", str(tmp_path / "other")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"train.init_from={first}: its weights" in err and "do not fit this model (" in err
    assert "there," in err and "here" in err  # the first parameter whose shape differs, named
    rc = main(["train", "tiny/txl", f"data.path={data}", "train.steps=2", f"train.init_from={tmp_path / 'none'}",
               "--out", str(tmp_path / "other2")])
    assert rc == 2 and "has no checkpoint" in capsys.readouterr().err


def test_stop_when_ends_a_run_at_that_step_as_its_last(data, tmp_path):
    """The trainer's early stop: asked after every validation pass with that pass's figures; a reason ends the run
    there with a checkpoint and a FINISHED run, as train.steps would."""
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.train import run

    asked = []

    def stop_when(trainer, valid):
        asked.append((valid["step"], trainer.step, "valid_nll" in valid))
        return "enough" if valid["step"] >= 4 else None

    out = tmp_path / "run"
    cfg = load_config("tiny/txl", [f"data.path={data}", "train.steps=10", "train.eval_every=2", "train.log_every=1",
                                   "train.save_every=0", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    run(cfg, out, stop_when=stop_when)
    assert asked == [(2, 2, True), (4, 4, True)]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 4 and (out / "checkpoints" / "latest").read_text().strip() == "global_step4"
    assert (out / "mlflow_run_status").read_text().strip() == "FINISHED"


def rows(*values) -> list[dict]:
    """Check rows every 250 steps from (accuracy, answer loss) pairs."""
    return [{"step": 250 * (i + 1), "accuracy": a, "answer_nll": n} for i, (a, n) in enumerate(values)]


def first_stop(rule, checks: list[dict]) -> tuple[int, str] | None:
    """The step at which a stage with these checks ends, and why (the checks arriving one by one)."""
    from memlm.trainer.loop.curriculum_stop import decide

    for i in range(1, len(checks) + 1):
        decision = decide(rule, checks[:i])
        if decision:
            return checks[i - 1]["step"], decision[0]
    return None


def test_stop_rule_learned_plateau_and_the_late_jump():
    from memlm.trainer.loop.curriculum_stop import StopRule, decide

    rule = StopRule(steps=3000, check_every=250, target=0.99, patience=3, min_steps=1000, min_gain=0.02)
    assert decide(rule, rows((0.0, 2.3), (0.995, 0.01)))[0] == "learned"
    flat = rows(*[(0.1, 2.0)] * 4)  # nothing moves after the first check
    assert decide(rule, flat[:3]) is None  # 2 checks without a gain, and step 750 < min_steps
    kind, reason = decide(rule, flat)  # step 1,000: 3 checks without a gain
    assert kind == "plateau" and "no gain in 3 checks (750 steps)" in reason and "10.0% at step 250" in reason
    late = StopRule(steps=3000, check_every=250, patience=2, min_steps=1500)
    assert decide(late, flat) is None  # patience is spent, but no plateau before min_steps
    capped = StopRule(steps=1000, check_every=250, patience=3, min_steps=500)
    assert decide(capped, flat) is None  # the last check is at the cap: the cap ended the stage, not a plateau
    # The run-up to a late jump: accuracy flat at 0, the loss falling 1.5% a check. Against the loss at the last gain
    # that is a gain every second check, so the stage goes on.
    assert first_stop(rule, rows(*[(0.0, 2.3 * 0.985 ** i) for i in range(12)])) is None
    # The same loss falling 0.5% a check is a plateau: a 2% fall takes 5 checks.
    assert first_stop(rule, rows(*[(0.0, 2.3 * 0.995 ** i) for i in range(12)])) == (1000, "plateau")
    # Accuracy creeping up by 2 points a check is a gain each time, until it is learned.
    assert first_stop(rule, rows(*[(0.02 * i, 2.0) for i in range(60)])) == (250 * 51, "learned")
    fixed = StopRule(steps=3000, check_every=250, fixed=True)
    assert decide(fixed, rows((1.0, 0.0))) is None and decide(fixed, flat) is None


def test_a_resumed_stage_reads_its_checks_before_its_step(tmp_path):
    from memlm.trainer.loop.curriculum_stop import CHECKS, StageCheck, StopRule

    (tmp_path / CHECKS).write_text("".join(json.dumps(r) + "\n" for r in rows((0.1, 2.0), (0.2, 1.9), (0.3, 1.8))))
    check = StageCheck(StopRule(), tmp_path, [], boundary_id=10, label="stage 0")
    assert [r["step"] for r in check.history(750)] == [250, 500]  # the row at 750 came after the checkpoint
    assert [r["step"] for r in check.history(1000)] == [250, 500, 750]


def reference_passkey_apart(text: str, tgt_len: int) -> int:
    """Written here: the passkey's last number, read as input at byte index + 1, against the answer's first byte."""
    prompt, _, answer = text.rpartition(">")
    last = [m.start() for m in re.finditer(r"\d+", prompt) if m.group() == answer][-1]
    return (len(prompt) + 1) // tgt_len - (last + 1) // tgt_len + 1


def reference_qa1_apart(text: str, tgt_len: int) -> int:
    """Written here: the asked person's last move ("<name> <verb> to the <place>.") must name the answer."""
    prompt, _, answer = text.rpartition(">")
    name = re.search(r"Where is (\w+)\?$", prompt).group(1)
    moves = list(re.finditer(rf"(?<![A-Za-z]){name} (?:went back|went|moved|journeyed|travelled) to the (\w+)\.",
                             prompt))
    assert moves[-1].group(1) == answer
    return (len(prompt) + 1) // tgt_len - (moves[-1].start() + 1) // tgt_len + 1


@pytest.mark.parametrize("task,options,reference", [
    ("passkey", {}, reference_passkey_apart),
    ("qa1", {"facts": 2, "background": str(WIKITEXT2)}, reference_qa1_apart)])
def test_stage_samples_span_their_segments_with_the_fact_in_the_first(task, options, reference):
    """Every S-segment stage sample is S x tgt_len bytes (less its answer's shortfall), the whole story in one segment
    at S = 1 and S segments from fact to answer beyond; the stage's own measure agrees with the references above on
    every sample."""
    import numpy as np

    from memlm.data_pipeline.tasks import generate
    from memlm.trainer.loop.curriculum_samples import describe, stage_options

    N = 128
    for S in (1, 2, 4, 8):
        o = stage_options(task, {**options, "docs": "200,1,1", "seed": 3}, S, N)
        texts = [s.text for s in generate(task, "train", o)]
        assert all(S * N - 4 <= len(t) <= S * N for t in texts)  # the answer's shortfall from the longest
        assert len({len(t.rpartition(">")[0]) for t in texts}) == 1  # the question's place tells nothing
        assert {reference(t, N) for t in texts} == {S}
        samples = [(np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64), len(t.rpartition(">")[2]))
                   for t in texts]
        summary = describe(task, samples, N)
        assert summary["segments"] == {str(S): 200} and summary["fact_segments_apart"] == {str(S): 200}


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_curriculum_stages_grow_and_start_from_the_previous_stage(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the stages track to the default ./mlflow.db: here, never in the checkout
    import memlm.trainer.loop.train as train_module
    from memlm.cli import main

    started_from = []
    real = train_module.load_initial_weights
    monkeypatch.setattr(train_module, "load_initial_weights",
                        lambda model, run_dir: started_from.append(Path(run_dir)) or real(model, run_dir))
    out = tmp_path / "cur"
    # qa1 with one fact: 64 bytes, one segment of 64 at stage 0, 2 segments at stage 1.
    command = ["curriculum", "tiny/armt", "model.tgt_len=64", "train.warmup_steps=0", "--task", "qa1",
               "--background", str(WIKITEXT2), "--task-option", "facts=1", "--segments", "1,2", "--steps", "4",
               "--check-every", "2", "--check-samples", "3", "--docs", "20,3,3", "--out", str(out)]
    assert main(command) == 0
    printed = capsys.readouterr().out
    stages = [out / "stage0-1seg", out / "stage1-2seg"]
    assert started_from == [stages[0]]  # stage 1 started from stage 0's weights; stage 0 from scratch
    summary = json.loads((out / "curriculum.json").read_text())
    for k, (stage, count) in enumerate(zip(stages, (1, 2))):
        assert read_rows(stage / "metrics.jsonl")[-1]["step"] == 4
        manifest = json.loads((out / "data" / f"qa1-{count}seg" / "manifest.json").read_text())
        assert manifest["corpus"]["options"]["length"] == count * 64  # segments x tgt_len bytes per sample
        checks = read_rows(stage / "curriculum_checks.jsonl")
        assert [c["step"] for c in checks] == [2, 4] and all(c["samples"] == 3 for c in checks)
        record = json.loads((stage / "curriculum_stage.json").read_text())
        assert record["stop"] == "budget" and record["step"] == 4 and record["segments"] == count
        assert record["data"]["segments"] == {str(count): 20} and record["data"]["fact_segments_apart"] == {
            str(count): 20}
        assert summary["stages"][k]["stop"] == "budget"
        # A whole sample per lane each step: ARMT backpropagates through all of its segments (chunk mode).
        model = json.loads(json.dumps(__import__("yaml").safe_load((stage / "config.yaml").read_text())))
        assert (model["model"]["bptt_mode"], model["model"]["bptt_depth"], model["train"]["grad_accum"],
                model["train"]["schedule"]) == ("chunk", count - 1, 1, "constant")
    assert "ended at step 4 (budget): the cap, --steps 4" in printed
    # 128 bytes less the answer's shortfall from the longest place (0-4 bytes): still 2 segments
    assert re.search(r"20 samples of 12[4-8]-128 bytes \(median 12[4-8](\.5)?\); 20 \(100%\) span 2 segment\(s\) of "
                     r"64; fact and answer 2 segment\(s\) apart in 20 \(100%\)", printed), printed
    # A rerun trains nothing again.
    assert main(command) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished earlier") == 2 and started_from == [stages[0]]


def test_a_stage_ends_when_learned_and_the_next_starts_from_there(tmp_path, capsys, monkeypatch):
    """--target 0: every check is 'learned', so each stage ends at its first check with that checkpoint, a FINISHED
    run and its reason on the console; --fixed-steps trains to the cap whatever the checks say."""
    monkeypatch.chdir(tmp_path)
    from memlm.cli import main

    out = tmp_path / "cur"
    base = ["curriculum", "tiny/txl", "model.tgt_len=96", "train.warmup_steps=0", "--task", "passkey", "--segments",
            "1,2", "--steps", "6", "--check-every", "2", "--check-samples", "2", "--docs", "12,2,2"]
    assert main([*base, "--target", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    for stage, count in ((out / "stage0-1seg", 1), (out / "stage1-2seg", 2)):
        record = json.loads((stage / "curriculum_stage.json").read_text())
        assert (record["stop"], record["step"], record["checks"]) == ("learned", 2, 1)
        assert (stage / "checkpoints" / "latest").read_text().strip() == "global_step2"
        assert (stage / "mlflow_run_status").read_text().strip() == "FINISHED"
        config = __import__("yaml").safe_load((stage / "config.yaml").read_text())
        assert config["train"]["grad_accum"] == count and config["train"]["schedule"] == "constant"
    assert "ended at step 2 (learned): held-out accuracy" in printed.out
    assert "stopping at step 2 of 6" in printed.err
    fixed = tmp_path / "fixed"
    assert main([*base, "--segments", "1", "--target", "0", "--fixed-steps", "--out", str(fixed)]) == 0
    record = json.loads((fixed / "stage0-1seg" / "curriculum_stage.json").read_text())
    assert (record["stop"], record["step"], record["checks"]) == ("budget", 6, 3)


@pytest.mark.parametrize("argv,named", [
    # the README's line before issue 32: tiny/armt's tgt_len 8 makes a 16-byte first stage; passkey needs 91
    (["tiny/armt", "--task", "passkey", "--segments", "2,4,8", "--steps", "500"],
     ["--segments 2 x model.tgt_len 8, is 16", "at least 91 bytes", "start --segments at 12", "model.tgt_len=46"]),
    (["tiny/armt", "model.tgt_len=128", "--task", "qa1", "--background", str(WIKITEXT2), "--task-option", "facts=3"],
     ["at least 132 bytes (3 facts and the question)", "model.tgt_len=132", "--task-option facts=N"]),
    (["tiny/armt", "--task", "qa1", "--segments", "8"], ["--background WIKITEXT_DIR"]),
    (["tiny/armt", "--task", "qa1", "--segments", "8", "--background", "{tmp}/nowhere"],
     ["--background {tmp}/nowhere: no wiki.train.tokens"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12", "--background", str(WIKITEXT2)],
     ["takes no --background"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12", "--docs", "10,0,1"], ["--docs '10,0,1'"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12", "--docs", "many"], ["--docs 'many'"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12", "--steps", "0"], ["--steps must be >= 1"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12", "--steps", "1000", "--check-every", "300"],
     ["--check-every 300 must divide --steps 1000", "e.g. --check-every 250"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12,24", "--steps", "100,200,300"],
     ["--steps '100,200,300': give one number for every stage or one per stage (2 for --segments)"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12,24", "--min-steps", "a"], ["--min-steps 'a'"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12", "--patience", "0"], ["--patience must be >= 1"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12", "--target", "99"], ["--target is a held-out accuracy"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12", "--task-option", "length=5"],
     ["--task-option 'length=5'", "--segments and model.tgt_len"]),
    (["tiny/armt", "--task", "passkey", "--segments", "12", "--task-option", "colour=red"],
     ["has no option 'colour'"]),
])
def test_refusals_name_curriculums_own_options_and_leave_nothing(argv, named, tmp_path, capsys):
    """Issue 32: the task's own check said `passkey: --task-length (the sample's bytes) must be >= 64, got 16`, an
    option curriculum does not have, after OUT/data/ was made. Every stage is checked first, in one line naming
    what to change."""
    from memlm.cli import main

    out = tmp_path / "cur"
    assert main(["curriculum", *[a.format(tmp=tmp_path) for a in argv], "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("memlm: error: "), err
    assert all(text.format(tmp=tmp_path) in err for text in named) and "--task-length" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("segments", ["4,2", "0,1", "a"])
def test_bad_segments_are_one_line(segments, tmp_path, capsys):
    from memlm.cli import main

    assert main(["curriculum", "tiny/armt", "--task", "passkey", "--segments", segments, "--out",
                 str(tmp_path)]) == 2
    assert "--segments" in capsys.readouterr().err


def test_a_stage_validates_whole_samples():
    """A task scores only its answer, in a sample's last segment: the trainer's validation pass of an 8-segment
    stage read the tiny presets' 4 batches and scored nothing (`memlm: error: evaluating split 'valid': 4 batch(es)
    ... scored no target`, the README's curriculum line). A stage reads at least its segments' count; the whole
    split (0) already does."""
    from memlm.trainer.loop.curriculum import whole_samples_validated

    assert whole_samples_validated(4, 8) == ["train.eval_batches=8"]
    assert whole_samples_validated(4, 2) == [] and whole_samples_validated(8, 8) == []
    assert whole_samples_validated(0, 8) == []
