"""Files that cannot run code: everything memlm writes loads weights-only; a checkpoint file carrying a pickle that
would run code is refused in one line naming the file, and nothing in it runs (a marker file the payload would
create stays absent, while the same file opened with a full unpickler creates it); an older memlm's rank file is
refused with the conversion command, which converts it into a file that resumes bit-identically. Plus an audit of
the source: YAML through a SafeLoader only, no shell=True, no full unpickling outside the explicit converter, and
services on 127.0.0.1 unless asked.
"""

from __future__ import annotations

import ast
import contextlib
import shutil
from pathlib import Path

import pytest
import torch

from memlm.cli import main
from support.training import REPO, losses, make_data, overrides, preset, train_in_process

STEPS = 4


class Payload:
    """Unpickling this creates `marker` (io.open in write mode): the stand-in for any code a hostile file runs."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("safe_data"))


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """An RMT window run (ZeRO-2: optimizer partition files) stopped at step 2, and the same run uninterrupted."""
    root = tmp_path_factory.mktemp("safe_runs")
    common = dict(deepspeed__zero_stage=2, train__steps=STEPS, train__save_every=2, train__grad_accum=2)
    train_in_process("rmt", data, root / "full", **common)
    train_in_process("rmt", data, root / "stopped", stop_at=2, **common)
    return {"full": root / "full", "stopped": root / "stopped", "common": common}


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def _ckpt(run: Path) -> Path:
    return run / "checkpoints" / "global_step2"


def _resume(data, run: Path, common: dict) -> int:
    return main(["train", preset("rmt"), *overrides(data, **common), "--out", str(run), "--resume"])


def test_everything_memlm_writes_loads_weights_only(runs):
    from torch.serialization import get_unsafe_globals_in_checkpoint

    from memlm.trainer.checkpoint.safe_load import deepspeed_safe_types

    files = sorted(_ckpt(runs["stopped"]).glob("*.pt"))
    assert {f.name for f in files} >= {"rank0.pt", "mp_rank_00_model_states.pt"}
    assert any(f.name.endswith("optim_states.pt") for f in files)
    for path in files:
        if path.name.startswith("rank"):  # memlm's own: tensors and plain values, nothing else
            assert get_unsafe_globals_in_checkpoint(path) == []
            state = torch.load(path, weights_only=True)
            assert len(state["recurrence"]["window"]) == 2  # RMT's replay window is in it, as plain dicts
        else:  # DeepSpeed's: only its plain record types besides
            with torch.serialization.safe_globals(deepspeed_safe_types()):
                torch.load(path, weights_only=True, mmap=True)


def _poison(path: Path, marker: Path) -> None:
    """Keep the file's real content (so a full unpickler would load it and carry on) and add the payload."""
    from memlm.trainer.checkpoint.safe_load import deepspeed_safe_types

    with torch.serialization.safe_globals(deepspeed_safe_types()):
        state = torch.load(path, weights_only=True)
    state["extra"] = Payload(marker)
    torch.save(state, path)


@pytest.mark.parametrize("victim", ["rank0.pt", "mp_rank_00_model_states.pt", "optim"])
def test_a_checkpoint_file_that_would_run_code_is_refused_and_nothing_runs(victim, runs, data, tmp_path, capsys):
    run = _copy(runs["stopped"], tmp_path / "run")
    folder = _ckpt(run)
    path = next(folder.glob("*optim_states.pt")) if victim == "optim" else folder / victim
    marker = tmp_path / "marker"
    _poison(path, marker)

    # The payload is live: a full unpickler (what DeepSpeed and zero_to_fp32 use) runs it.
    control = tmp_path / "control"
    shutil.copy(path, control)
    torch.load(control, weights_only=False)
    assert marker.exists()
    marker.unlink()

    commands = [["train", preset("rmt"), *overrides(data, **runs["common"]), "--out", str(run), "--resume"]]
    if victim != "rank0.pt":  # evaluation reads DeepSpeed's files only
        commands.append(["eval", str(run)])
    for argv in commands:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("memlm: error: refusing to load "), err
        assert str(path) in err[0] and "io.open" in err[0] and "nothing in it was run" in err[0]
        assert not marker.exists(), f"memlm {argv[0]} ran the payload"
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step2"  # nothing changed on disk


def test_a_truncated_checkpoint_file_is_one_line(runs, data, tmp_path, capsys):
    run = _copy(runs["stopped"], tmp_path / "run")
    path = _ckpt(run) / "rank0.pt"
    path.write_bytes(path.read_bytes()[:2000])
    capsys.readouterr()
    assert _resume(data, run, runs["common"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot read checkpoint file {path}" in err[0] and "truncated" in err[0], err


def _write_legacy(path: Path, run: Path) -> None:
    """rank0.pt as memlm wrote it before: memory dataclasses, Segment objects, numpy's RNG tuple (an ndarray)."""
    import numpy as np

    from memlm.models import build_model
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.recurrence import make_recurrence

    state = torch.load(path, weights_only=True)
    cfg = load_config(run / "config.yaml")
    recurrence = make_recurrence(cfg.model, build_model(cfg.model).init_memory(cfg.data.batch_size), "cpu")
    recurrence.load_state_dict(state["recurrence"])
    state["recurrence"] = {"kind": recurrence.kind, "memory": recurrence.memory, "window": recurrence.window}
    rng = state["rng"]["numpy"]
    state["rng"]["numpy"] = (rng["kind"], rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                             rng["cached_gaussian"])
    with _under_old_module_names(state):
        torch.save(state, path)


@contextlib.contextmanager
def _under_old_module_names(state):
    """Pickle memlm's classes by the names older memlm installed them under (models.txl.TXLMemory,
    trainer.recurrence.Segment), as the files it wrote name them."""
    import dataclasses
    import sys

    classes = set()

    def walk(value):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            classes.add(type(value))
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name))
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(state)
    renamed = {}
    for cls in classes:
        if cls.__module__.startswith("memlm."):
            old = {"memlm.trainer.loop.recurrence": "trainer.recurrence"}.get(cls.__module__,
                                                                               cls.__module__[len("memlm."):])
            renamed[cls] = cls.__module__
            sys.modules.setdefault(old, sys.modules[cls.__module__])
            cls.__module__ = old
    try:
        yield
    finally:
        for cls, module in renamed.items():
            sys.modules.pop(cls.__module__, None)
            cls.__module__ = module


def test_an_older_rank_file_is_refused_with_the_conversion_then_converts_and_resumes_exactly(runs, data, tmp_path,
                                                                                             capsys):
    from memlm.trainer.checkpoint import convert as convert_checkpoint

    run = _copy(runs["stopped"], tmp_path / "run")
    path = _ckpt(run) / "rank0.pt"
    _write_legacy(path, run)
    capsys.readouterr()
    assert _resume(data, run, runs["common"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "python -m memlm.trainer.checkpoint.convert RUN_DIR" in err[0], err
    assert "trainer.recurrence.Segment" in err[0] and "numpy.ndarray" in err[0]
    # Evaluation reads only DeepSpeed's files: the old rank file does not stand in its way.
    assert main(["eval", str(run), "--json", str(tmp_path / "eval.json")]) == 0

    assert convert_checkpoint.main([str(run)]) == 0
    assert f"converted {path}" in capsys.readouterr().out
    assert _resume(data, run, runs["common"]) == 0
    assert losses(run) == losses(runs["full"])


def test_a_format_1_rank_file_resumes_exactly(runs, data, tmp_path):
    """Rank files of format 1 (before each piece saved itself: the trainer's counters at the top level, no version)
    resume into the same trajectory as the uninterrupted run."""
    from memlm.trainer.checkpoint.store import FORMAT_KEY

    run = _copy(runs["stopped"], tmp_path / "run")
    path = _ckpt(run) / "rank0.pt"
    state = torch.load(path, weights_only=True)
    old = {"recurrence": state["recurrence"], "stream": state["stream"], "rng": state["rng"],
           "step": state["trainer"]["step"], "tokens": state["trainer"]["tokens"],
           "skipped_steps": state["trainer"]["skipped_steps"], "world_size": 1, "arch": "rmt"}
    assert FORMAT_KEY in state and FORMAT_KEY not in old
    torch.save(old, path)
    assert _resume(data, run, runs["common"]) == 0
    assert losses(run) == losses(runs["full"])


def test_a_rank_file_of_a_newer_format_is_one_line(runs, data, tmp_path, capsys):
    from memlm.trainer.checkpoint.store import FORMAT_KEY, FORMAT_VERSION

    run = _copy(runs["stopped"], tmp_path / "run")
    path = _ckpt(run) / "rank0.pt"
    torch.save({**torch.load(path, weights_only=True), FORMAT_KEY: FORMAT_VERSION + 1}, path)
    capsys.readouterr()
    assert _resume(data, run, runs["common"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "newer memlm" in err[0], err


# ---------------------------------------------------------------------------------------------------------------
# Source audit

PACKAGES = ("trainer", "models", "data_pipeline", "cluster", "memlm", "bench", "scripts")


def _sources():
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "peers" in path.parts or "results" in path.parts:  # peers' code runs in its own venv
                continue
            yield path, ast.parse(path.read_text(), filename=str(path))


def _dotted(node) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _calls(tree):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def test_source_audit_yaml_subprocess_and_unpickling():
    import importlib

    import yaml

    checked = {"yaml": 0, "torch.load": 0}
    for path, tree in _sources():
        where = path.relative_to(REPO)
        names = {_dotted(n) for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Name))}
        banned = names & {"yaml.unsafe_load", "yaml.full_load", "yaml.Loader", "yaml.FullLoader", "yaml.UnsafeLoader",
                          "yaml.load_all", "os.system", "os.popen", "pickle.load", "pickle.loads",
                          "cloudpickle.load", "cloudpickle.loads"}
        assert not banned, f"{where} uses {banned}"
        for call in _calls(tree):
            name = _dotted(call.func)
            keywords = {k.arg: k.value for k in call.keywords}
            shell = keywords.get("shell")
            assert not (isinstance(shell, ast.Constant) and shell.value), f"{where}:{call.lineno} shell=True"
            if name == "yaml.load":
                loader = keywords.get("Loader")
                assert isinstance(loader, ast.Name), f"{where}:{call.lineno} yaml.load without a named Loader"
                parts = where.with_suffix("").parts
                module = importlib.import_module(".".join(parts if parts[0] == "memlm" else ("memlm", *parts)))
                assert issubclass(getattr(module, loader.id), yaml.SafeLoader), f"{where}:{call.lineno}"
                checked["yaml"] += 1
            if name == "torch.load" and where.as_posix() != "trainer/checkpoint/convert.py":
                flag = keywords.get("weights_only")
                assert isinstance(flag, ast.Constant) and flag.value is True, \
                    f"{where}:{call.lineno} torch.load without weights_only=True"
                checked["torch.load"] += 1
    assert checked["yaml"] >= 2 and checked["torch.load"] >= 1, checked  # the audit saw the real call sites


def test_services_bind_loopback_unless_asked(monkeypatch):
    """The defaults; the sockets themselves are read from real processes in tests/cluster/test_sweep.py (Ray) and
    tests/trainer/loop/test_train_process.py (a plain training run)."""
    from memlm.cli import build_parser

    assert build_parser().parse_args(["ui"]).host == "127.0.0.1"

    from memlm.trainer.runtime import distributed

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    distributed.setup_env()
    assert distributed.os.environ["MASTER_ADDR"] == "127.0.0.1"
