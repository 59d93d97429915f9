"""Presets by name: every YAML file under configs/ is one, a name loads what its path loads, an existing file wins,
a mistyped name is one line naming the closest presets, and the wheel carries them all."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from memlm.cli import main
from memlm.cluster.sweep_config import load_sweep
from memlm.trainer.config import presets
from memlm.trainer.config.run_config import ConfigError, config_to_yaml, load_config

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"
FILES = sorted(CONFIGS.rglob("*.yaml"))
SWEEPS = CONFIGS / "sweeps"


def name_of(path: Path) -> str:
    return path.relative_to(CONFIGS).with_suffix("").as_posix()


def first_comment(path: Path) -> str:
    return next(line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#"))


def one_line_error(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


# --- names -----------------------------------------------------------------------------------------------------


def test_the_presets_are_the_yaml_files_under_configs():
    assert presets.root().resolve() == CONFIGS.resolve()  # a checkout (or an editable install) reads configs/
    assert presets.names() == sorted(name_of(path) for path in FILES)
    assert all(first_comment(path) for path in FILES)  # what `memlm config --list` shows for each


@pytest.mark.parametrize("path", [p for p in FILES if SWEEPS not in p.parents], ids=name_of)
def test_a_bare_name_loads_what_its_path_loads(path):
    assert load_config(name_of(path)) == load_config(path)


@pytest.mark.parametrize("path", sorted(SWEEPS.glob("*.yaml")), ids=name_of)
def test_a_sweep_name_loads_what_its_path_loads(path):
    by_name, by_path = load_sweep(name_of(path)), load_sweep(path)
    assert by_name.path == by_path.path and by_name.signature() == by_path.signature()


def test_an_existing_file_wins_over_a_preset_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "txl").write_text("model: {arch: txl, n_layer: 5}\n")
    assert load_config("tiny/txl").model.n_layer == 5
    assert load_config("tiny/lamemo").model.n_layer == 2  # no such file here: the preset


def test_inherit_takes_a_preset_name_and_a_file_beside_wins(tmp_path):
    (tmp_path / "child.yaml").write_text("inherit: tiny/lamemo\ntrain: {steps: 3}\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.model.arch, cfg.model.n_layer, cfg.train.steps) == ("lamemo", 2, 3)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "lamemo").write_text("inherit: tiny/lamemo\nmodel: {n_layer: 4}\n")  # beside child.yaml
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.model.arch, cfg.model.n_layer, cfg.train.steps) == ("lamemo", 4, 3)


# --- mistakes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("typed,closest", [
    ("tiny/tx", "tiny/txl"),
    ("paper/wt103/lamemmo", "paper/wt103/lamemo"),
    # a folder of presets: its first 4 by name (read from the folder: a new arch's preset may sort among them)
    ("tiny", ", ".join(sorted(name_of(path) for path in (CONFIGS / "tiny").glob("*.yaml"))[:4])),
    ("configs/e8_base_txl.yaml", "paper/enwik8/txl"),  # a file name from before the folders: where it went
])
def test_an_unknown_name_is_one_line_naming_the_closest_presets(typed, closest):
    message = one_line_error(load_config, typed)
    assert f"'{typed}' is neither a file nor a preset; closest presets: {closest}" in message, message
    assert "`memlm config --list`" in message


def test_an_unknown_inherited_name_names_the_file_and_the_closest_preset(tmp_path):
    (tmp_path / "child.yaml").write_text("inherit: tiny/lamem\n")
    message = one_line_error(load_config, tmp_path / "child.yaml")
    assert "child.yaml: 'inherit: tiny/lamem'" in message and f"a file in {tmp_path}" in message, message
    assert "closest presets: tiny/lamemo" in message


def test_a_name_never_leaves_the_presets_folder():
    assert (CONFIGS / "tiny" / ".." / "tiny" / "txl.yaml").is_file()
    assert "not found" in one_line_error(load_config, "tiny/../tiny/txl")


def test_a_preset_file_is_shown_by_its_name(tmp_path):
    assert presets.name_of(CONFIGS / "tiny" / "lamemo.yaml") == "tiny/lamemo"
    assert presets.name_of(tmp_path / "mine.yaml") == str(tmp_path / "mine.yaml")


def test_every_moved_name_points_at_a_preset():
    assert set(presets.MOVED.values()) <= set(presets.names())


# --- the command line ------------------------------------------------------------------------------------------


def test_config_list_shows_every_preset_once_with_its_whole_first_sentence(capsys):
    """Issue 32: the first comment line alone cut most descriptions mid-sentence ("... (keys of width 4, DPFP to
    24), window"); now each is its comment's whole first sentence, wrapped under itself within 120 columns."""
    assert main(["config", "--list"]) == 0
    printed = capsys.readouterr().out
    assert max(map(len, printed.splitlines())) <= 120
    rows: dict[str, str] = {}
    for line in printed.splitlines():
        if line.startswith(" "):  # a description's next line
            rows[list(rows)[-1]] += " " + line.strip()
        else:
            name, text = line.split(None, 1)
            rows[name] = text
    assert list(rows) == sorted(name_of(path) for path in FILES)  # each once, folder by folder
    for path in FILES:
        comment = " ".join(line[1:].strip() for line in itertools.takewhile(
            lambda line: line.startswith("#"), path.read_text().splitlines()))
        assert comment.startswith(rows[name_of(path)]) and rows[name_of(path)].endswith("."), rows[name_of(path)]
    assert rows["tiny/armt"].endswith("window BPTT over the last 2 segments as RMT's.")
    assert rows["sweeps/lamemo_table5"].startswith("The LaMemo paper's hyper-parameter search (App. ")  # not a stop


def test_a_preset_is_found_from_a_folder_outside_the_checkout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "memlm", "config", "tiny/txl", "model.mem_len=4"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == config_to_yaml(load_config(CONFIGS / "tiny" / "txl.yaml", ["model.mem_len=4"]))


# --- the wheel -------------------------------------------------------------------------------------------------

SOURCES = ("pyproject.toml", "README.md", "memlm", "models", "data_pipeline", "trainer", "cluster", "configs")


@pytest.mark.slow
def test_the_wheel_ships_every_preset_and_finds_them_installed(tmp_path):
    """Built as a user would (pip wheel), from a copy so the build's folders never land in the checkout; then
    unpacked as pip installs a pure-Python wheel, and asked for presets from elsewhere."""
    source = tmp_path / "source"
    source.mkdir()
    for item in SOURCES:
        if (ROOT / item).is_dir():
            shutil.copytree(ROOT / item, source / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / item, source / item)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("memlm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = sorted(n for n in archive.namelist() if n.startswith("memlm/configs/") and n.endswith(".yaml"))
        assert shipped == sorted(f"memlm/configs/{name_of(path)}.yaml" for path in FILES)
        archive.extractall(tmp_path / "site")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}  # ahead of the checkout's editable install

    def memlm(*args: str) -> str:
        proc = subprocess.run([sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    found = memlm("-c", "from memlm.trainer.config import presets; print(presets.root())").strip()
    assert Path(found) == tmp_path / "site" / "memlm" / "configs"  # the installed copy, not the checkout's
    assert memlm("-m", "memlm", "config", "--list") == presets.listing()
    assert memlm("-m", "memlm", "config", "paper/text8/lamemo") == config_to_yaml(load_config("paper/text8/lamemo"))
