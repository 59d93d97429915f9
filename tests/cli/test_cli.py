"""The `memlm` command line, run as a real process: resolved config on stdout, user mistakes as one line + exit 2.

Each `config` process imports torch (through models) for about a second, so one process per kind of mistake
(unknown key, bad type, missing file, YAML syntax); further mistakes call the same main() in this process.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from memlm import cli
from memlm.trainer.config.run_config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = "tiny/txl"  # a preset's name, as users type it
TINY_PATH = ROOT / "configs" / "tiny" / "txl.yaml"

# The installed console script when `pip install -e .` has run, else the same entry through `python -m memlm`.
_SCRIPT = Path(sys.executable).parent / "memlm"
MEMLM = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "memlm"]

# name -> (argv after the program, text the one-line error must contain); one real process each
MISTAKES = {
    "unknown_override_key": (["config", TINY, "model.mem_lenn=4"], "did you mean 'model.mem_len'"),
    "bad_override_type": (["config", TINY, "model.n_layer=two"], "model.n_layer: expected int"),
    "missing_file": (["config", "configs/no_such_preset.yaml"], "not found"),
    "unknown_preset": (["config", "tiny/tx"], "closest presets: tiny/txl"),
    "yaml_syntax": (["config", "{tmp}/bad.yaml"], "YAML syntax error"),
    "unknown_key_in_file": (["config", "{tmp}/typo.yaml"], "'train.stpes'"),
}
# more mistakes, checked in this process (the same main(), without another second of torch import each)
MORE_MISTAKES = {
    "bad_choice": (["config", TINY, "deepspeed.precision=fp8"], "not one of fp32 | bf16 | fp16"),
    "impossible_combo": (["config", "tiny/transformer", "model.mem_len=8"], "model.mem_len must be 0"),
    "moved_preset": (["config", "configs/wt103_base_lamemo.yaml"], "closest presets: paper/wt103/lamemo,"),
    "list_and_config": (["config", "--list", TINY], "--list takes no CONFIG"),
    "no_config": (["config"], "or --list"),
    "cross_section": (["config", TINY, "eval.mem_len=8", "eval.mem_mult=2"], "eval.mem_mult=2.0 are both set"),
    "not_key_value": (["config", TINY, "model.mem_len"], "dotted.key=value"),
    "folder_as_config": (["config", "configs"], "folder"),
    "unset_data_path": (["train", TINY], "data.path is not set: prepare a corpus"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "bad.yaml").write_text("model:\n  arch: [txl\n")
    (tmp / "typo.yaml").write_text(f"inherit: {TINY}\ntrain:\n  stpes: 3\n")
    return tmp


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)


# `python -m memlm` as well when the console script is what MEMLM runs
ENTRIES = [MEMLM] + ([[sys.executable, "-m", "memlm"]] if MEMLM[0] != sys.executable else [])


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: Path(e[-1]).name)
def test_config_prints_the_resolved_yaml(entry, tmp_path):
    proc = run(entry + ["config", TINY, "model.mem_len=4"])
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["model"]["mem_len"] == 4 and printed["model"]["arch"] == "txl"
    (tmp_path / "printed.yaml").write_text(proc.stdout)
    assert load_config(tmp_path / "printed.yaml") == load_config(TINY_PATH, ["model.mem_len=4"])


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_user_mistakes_are_one_line_and_exit_2(files, name):
    argv, expected = MISTAKES[name]
    proc = run(MEMLM + [a.format(tmp=files) for a in argv])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memlm: error: "), proc.stderr
    assert expected in lines[0]


@pytest.mark.parametrize("name", sorted(MORE_MISTAKES))
def test_more_user_mistakes_in_process(name, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv, expected = MORE_MISTAKES[name]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("memlm: error: ") and expected in captured.err


def test_no_command_is_a_usage_error():
    proc = run(MEMLM)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "memlm: error: the following arguments are required: COMMAND (see `memlm --help`)"]
    proc = run(MEMLM + ["train", TINY, "--stop-at", "soon"])  # a bad flag value: one line too
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("memlm: error: train: argument --stop-at") and "--help" in proc.stderr


def test_the_command_line_does_not_import_heavy_packages():
    # Building the whole parser (every command, the cluster ones included) must not load torch, DeepSpeed, Ray,
    # MLflow or the pretrained backbones' transformers and peft: `memlm --help` stays instant and training never
    # needs Ray (docs/design.md §1).
    code = ("import sys, memlm.cli; memlm.cli.build_parser(); "
            "heavy = [m for m in ('torch', 'deepspeed', 'ray', 'mlflow', 'transformers', 'peft') if m in sys.modules]; "
            "assert not heavy, heavy")
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr


def test_demo_dispatches_to_the_demo_module(monkeypatch):
    calls = []
    fake = types.ModuleType("memlm.demo")
    fake.main = lambda args: calls.append(args) or 0
    monkeypatch.setitem(sys.modules, "memlm.demo", fake)
    import memlm

    monkeypatch.setattr(memlm, "demo", fake, raising=False)
    assert cli.main(["demo"]) == 0
    assert cli.main(["demo", "--steps", "25", "--out", "somewhere"]) == 0
    assert (calls[0].steps, calls[0].out) == (None, "runs/demo")  # None: the demo's measured default
    assert (calls[1].steps, calls[1].out) == (25, "somewhere")


def test_config_errors_raised_inside_a_command_become_one_line(monkeypatch, capsys):
    from memlm.models.config import ConfigError

    fake = types.ModuleType("memlm.demo")

    def fail(args):
        raise ConfigError("data.path: no manifest.json in /nowhere")

    fake.main = fail
    monkeypatch.setitem(sys.modules, "memlm.demo", fake)
    import memlm

    monkeypatch.setattr(memlm, "demo", fake, raising=False)
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == "memlm: error: data.path: no manifest.json in /nowhere\n"
