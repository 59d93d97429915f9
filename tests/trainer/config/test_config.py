"""Run configuration: presets parse with the papers' numbers, mistakes are named, overrides and round trips work."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from memlm.trainer.config.run_config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    eval_model_config,
    flatten,
    load_config,
    override_config,
    validate_config,
)
from memlm.trainer.config.schema import build

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"
# Every run-config preset as a path (the sweep spaces under configs/sweeps/ are test_sweep.py's)
PRESETS = sorted(p for p in CONFIGS.rglob("*.yaml") if p.relative_to(CONFIGS).parts[0] != "sweeps")
TINY = CONFIGS / "tiny" / "txl.yaml"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def error_of(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message  # the command line prints it as one line
    return message


# --- presets ---------------------------------------------------------------------------------------------------


def name(path: Path) -> str:
    return path.relative_to(CONFIGS).with_suffix("").as_posix()


def test_presets_exist():
    names = {name(p) for p in PRESETS}
    for arch in ("transformer", "txl", "lamemo", "rmt"):
        assert f"tiny/{arch}" in names
    for arch in ("transformer", "txl", "lamemo"):
        assert f"paper/wt103/{arch}" in names


@pytest.mark.parametrize("preset", PRESETS, ids=name)
def test_every_preset_parses_and_round_trips(preset, tmp_path):
    cfg = load_config(preset)
    assert isinstance(cfg, RunConfig)
    assert load_config(dump_yaml(cfg, tmp_path / "config.yaml")) == cfg


@pytest.mark.parametrize("arch,mem_len", [("transformer", 0), ("txl", 150), ("lamemo", 150)])
def test_wt103_presets_follow_the_lamemo_paper(arch, mem_len):
    cfg = load_config(f"paper/wt103/{arch}")
    m = cfg.model
    assert (m.arch, m.n_layer, m.n_head, m.d_head, m.d_model, m.d_inner) == (arch, 16, 10, 41, 410, 2100)
    assert (m.tgt_len, m.mem_len) == (150, mem_len)
    assert (m.cutoffs, m.div_val, m.tie_weight, m.vocab_size) == ([20000, 40000, 200000], 1, True, 267735)
    assert (m.dropout, m.dropatt) == (0.1, 0.0)
    t = cfg.train
    assert (t.optimizer, t.lr, t.schedule, t.min_lr_ratio, t.warmup_steps, t.steps) == \
        ("adam", 2.5e-4, "cosine", 0.0, 0, 250000)
    assert cfg.data.batch_size * t.grad_accum == 64


@pytest.mark.parametrize("preset,arch,vocab", [("paper/enwik8/txl", "txl", 256),
                                               ("paper/enwik8/lamemo", "lamemo", 256),
                                               ("paper/text8/lamemo", "lamemo", 256)])
def test_character_presets_follow_the_lamemo_paper(preset, arch, vocab):
    cfg = load_config(preset)
    m = cfg.model
    assert (m.arch, m.n_layer, m.n_head, m.d_head, m.d_model, m.d_inner, m.vocab_size) == \
        (arch, 12, 8, 64, 512, 2048, vocab)
    assert (m.tgt_len, m.mem_len, m.dropout, m.dropatt) == (512, 512, 0.1, 0.0)
    assert (cfg.train.steps, cfg.data.batch_size * cfg.train.grad_accum, cfg.train.lr) == (100000, 40, 2.5e-4)


RMT_ROWS = {  # preset -> (N, cache M, memory tokens, BPTT, aux weight, steps, the paper's test ppl), RMT Tables 2/4
    "paper/wt103/rmt_bptt3_mem10": (150, 0, 10, 3, 0.0, 200000, "25.04"),
    "paper/wt103/rmt_bptt2_mem25": (150, 0, 25, 2, 0.0, 200000, "24.85"),
    "paper/wt103/rmt_n50_bptt1_mem1": (50, 0, 1, 1, 0.0, 200000, "28.71"),
    "paper/wt103/rmt_n50_bptt3_mem10": (50, 0, 10, 3, 0.0, 200000, "26.37"),
    "paper/wt103/txl_rmt_mem150_tok10": (150, 150, 10, 3, 0.01, 400000, "23.99"),
    "paper/wt103/txl_rmt_mem75_tok5": (150, 75, 5, 3, 0.01, 200000, "24.47"),
}


def test_every_shipped_rmt_preset_has_its_paper_row():
    shipped = {name(p) for p in PRESETS if load_config(p).model.arch == "rmt" and not name(p).startswith("tiny/")}
    assert shipped == set(RMT_ROWS)


@pytest.mark.parametrize("preset", sorted(RMT_ROWS))
def test_rmt_presets_follow_the_rmt_paper(preset):
    tgt_len, mem_len, tokens, bptt, aux, steps, ppl = RMT_ROWS[preset]
    cfg = load_config(preset)
    m = cfg.model
    assert (m.arch, m.n_layer, m.n_head, m.d_head, m.d_model, m.d_inner) == ("rmt", 16, 10, 41, 410, 2100)
    assert (m.tgt_len, m.mem_len, m.num_mem_tokens, m.bptt_depth, m.aux_loss_weight) == \
        (tgt_len, mem_len, tokens, bptt, aux)
    # The paper's training: BPTT over the last k segments for every loss, authors' Tr-XL + RMT options, 60 x N tokens
    # per step for `steps` steps at Transformer-XL's base rate.
    assert (m.bptt_mode, m.bptt_replay_loss, m.read_mem_from_cache, m.cache_memory_rows) == \
        ("window", False, False, True)
    assert (cfg.train.steps, cfg.data.batch_size * cfg.train.grad_accum, cfg.train.lr) == (steps, 60, 2.5e-4)
    lines = (CONFIGS / f"{preset}.yaml").read_text().splitlines()
    first_key = next(i for i, x in enumerate(lines) if not x.startswith("#"))
    header = " ".join(line.lstrip("# ") for line in lines[:first_key])
    assert header.startswith("RMT paper, Table 2") and f"-> {ppl} " in header, header


@pytest.mark.parametrize("arch", ["transformer", "txl", "lamemo", "rmt"])
def test_tiny_presets_are_tiny(arch):
    cfg = load_config(f"tiny/{arch}")
    m = cfg.model
    assert (m.arch, m.n_layer, m.d_model, m.n_head, m.d_head, m.d_inner, m.tgt_len) == (arch, 2, 32, 2, 16, 64, 8)
    assert m.mem_len == (0 if arch in ("transformer", "rmt") else 8)
    assert cfg.train.steps <= 50 and cfg.deepspeed.precision == "fp32"


# --- inherit ---------------------------------------------------------------------------------------------------


def test_inherit_merges_sections_and_resolves_relative_to_the_file(tmp_path):
    (tmp_path / "base").mkdir()
    write(tmp_path / "base" / "root.yaml", "model: {arch: txl, n_layer: 3, mem_len: 4}\ntrain: {steps: 7}\n")
    write(tmp_path / "base" / "mid.yaml", "inherit: root.yaml\nmodel: {n_layer: 5}\n")
    child = write(tmp_path / "child.yaml", "inherit: base/mid.yaml\nmodel: {mem_len: 6}\n")
    cfg = load_config(child)
    assert (cfg.model.n_layer, cfg.model.mem_len, cfg.train.steps) == (5, 6, 7)


def test_inherit_cycle_and_missing_parent_are_named(tmp_path):
    write(tmp_path / "a.yaml", "inherit: b.yaml\n")
    write(tmp_path / "b.yaml", "inherit: a.yaml\n")
    assert "cycle" in error_of(load_config, tmp_path / "a.yaml")
    missing = write(tmp_path / "c.yaml", "inherit: nowhere.yaml\n")
    assert "nowhere.yaml" in error_of(load_config, missing)


# --- unknown keys ----------------------------------------------------------------------------------------------


def test_unknown_top_level_key_suggests_and_lists():
    message = error_of(config_from_dict, {"modle": {"arch": "txl"}})
    assert "'modle'" in message and "did you mean 'model'" in message
    assert "model, data, train, deepspeed, tracking, eval" in message


def test_unknown_section_key_names_the_dotted_key():
    message = error_of(config_from_dict, {"model": {"mem_lenn": 4}})
    assert "'model.mem_lenn'" in message and "did you mean 'model.mem_len'" in message
    assert "num_mem_tokens" in message and "valid keys in 'model'" in message


def test_unknown_key_without_a_close_name_still_lists_the_valid_ones():
    message = error_of(config_from_dict, {"train": {"zzzz": 1}})
    assert "'train.zzzz'" in message and "did you mean" not in message and "grad_accum" in message


@dataclass
class Inner:
    depth: int = 1


@dataclass
class Middle:
    inner: Inner = field(default_factory=Inner)


@dataclass
class Outer:
    middle: Middle = field(default_factory=Middle)


def test_unknown_key_deep_in_a_nested_tree():
    message = error_of(build, Outer, {"middle": {"inner": {"dpeth": 2}}})
    assert "'middle.inner.dpeth'" in message and "'middle.inner.depth'" in message
    assert build(Outer, {"middle": {"inner": {"depth": 2}}}).middle.inner.depth == 2


def test_unknown_key_in_a_preset_file_names_it(tmp_path):
    path = write(tmp_path / "x.yaml", "inherit: " + str(TINY) + "\ndata:\n  batch_sise: 3\n")
    assert "'data.batch_sise'" in error_of(load_config, path)


# --- types -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("section,key,value,where,expected,shown", [
    ("model", "n_layer", "two", "model.n_layer", "expected int", "'two'"),
    ("model", "n_layer", 2.5, "model.n_layer", "expected int", "2.5"),
    ("model", "n_layer", True, "model.n_layer", "expected int", "True"),
    ("data", "shuffle", "maybe", "data.shuffle", "expected bool", "'maybe'"),
    ("data", "shuffle", 1, "data.shuffle", "expected bool", "1"),
    ("train", "lr", "fast", "train.lr", "expected float", "'fast'"),
    ("model", "cutoffs", 20, "model.cutoffs", "expected a list of int", "20"),
    ("train", "adam_betas", [0.9, "x"], "train.adam_betas[1]", "expected float", "'x'"),
    ("tracking", "experiment", 5, "tracking.experiment", "expected str", "5"),
    ("deepspeed", "precision", "fp8", "deepspeed.precision", "not one of fp32 | bf16 | fp16", "'fp8'"),
    ("model", "arch", "lamemoo", "model.arch", "did you mean 'lamemo'", "'lamemoo'"),
    ("train", "schedule", "cosin", "train.schedule", "cosine | linear | constant", "'cosin'"),
    ("train", "optimizer", "sgd", "train.optimizer", "adam | adamw", "'sgd'"),
])
def test_wrong_types_name_key_type_and_value(section, key, value, where, expected, shown):
    message = error_of(config_from_dict, {section: {key: value}})
    assert message.startswith(f"{where}:") and expected in message and shown in message


def test_a_section_must_be_a_mapping():
    assert "'model'" in error_of(config_from_dict, {"model": 3})


def test_ints_are_accepted_for_floats_and_yaml_exponents_are_floats(tmp_path):
    cfg = config_from_dict({"train": {"lr": 1}})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    path = write(tmp_path / "x.yaml", "train:\n  lr: 1e-3\n  adam_eps: 1e-9\n")  # PyYAML alone reads 1e-3 as a str
    assert load_config(path).train.lr == 1e-3


def test_optional_fields_take_null_or_their_type():
    assert config_from_dict({"eval": {"clamp_len": None, "same_length": True}}).eval.same_length is True
    assert "expected bool (true/false) or null" in error_of(config_from_dict, {"eval": {"same_length": "x"}})


# --- overrides -------------------------------------------------------------------------------------------------


def test_overrides_parse_yaml_values():
    cfg = load_config(TINY, ["model.mem_len=16", "model.cutoffs=[20, 40]", "data.shuffle=false", "train.lr=3e-4",
                             "train.adam_betas=[0.8,0.99]", "tracking.experiment=2024"])
    assert (cfg.model.mem_len, cfg.model.cutoffs, cfg.data.shuffle) == (16, [20, 40], False)
    assert (cfg.train.lr, cfg.train.adam_betas, cfg.tracking.experiment) == (3e-4, [0.8, 0.99], "2024")


def test_overrides_win_over_the_preset_and_its_parents():
    cfg = load_config("tiny/lamemo", ["model.n_layer=3"])
    assert (cfg.model.arch, cfg.model.n_layer) == ("lamemo", 3)


def test_mapping_overrides_for_code():
    cfg = override_config(load_config(TINY), {"model.mem_len": 2, "train.steps": 5})
    assert (cfg.model.mem_len, cfg.train.steps) == (2, 5)


@pytest.mark.parametrize("override,expected", [
    ("model.mem_lenn=4", "did you mean 'model.mem_len'"),
    ("modle.mem_len=4", "did you mean 'model'"),
    ("model.mem_len.x=4", "not a section"),
    ("model=4", "is a section"),
    ("model.mem_len", "dotted.key=value"),
    ("model.mem_len=four", "expected int"),
    ("model.cutoffs=[1,2", "cannot read"),
])
def test_bad_overrides_are_named(override, expected):
    message = error_of(load_config, TINY, [override])
    assert expected in message and override.split("=")[0] in message


# --- validation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,override,key", [
    ("tiny/txl", "model.num_mem_tokens=4", "model.num_mem_tokens"),
    ("tiny/transformer", "model.mem_len=8", "model.mem_len"),
    ("tiny/txl", "model.lookahead=false", "model.lookahead"),
    ("tiny/rmt", "model.num_mem_tokens=0", "model.num_mem_tokens"),
    ("tiny/txl", "data.batch_size=0", "data.batch_size"),
    ("tiny/txl", "train.grad_accum=0", "train.grad_accum"),
    ("tiny/txl", "train.warmup_steps=100", "train.warmup_steps"),
    ("tiny/txl", "train.adam_betas=[0.9]", "train.adam_betas"),
    ("tiny/txl", "deepspeed.zero_stage=4", "deepspeed.zero_stage"),
    ("tiny/txl", "deepspeed.offload_params=true", "deepspeed.offload_params"),
    ("tiny/txl", "deepspeed.offload_optimizer=true", "deepspeed.offload_optimizer"),
    ("tiny/txl", "deepspeed.reduce_bucket_size=1000000", "deepspeed.reduce_bucket_size"),  # ZeRO-0: no bucket
    ("tiny/txl", "deepspeed.reduce_bucket_size=-1", "deepspeed.reduce_bucket_size"),
    ("tiny/txl", "deepspeed.param_persistence_threshold=0", "deepspeed.param_persistence_threshold"),  # not ZeRO-3
    ("tiny/txl", "deepspeed.param_persistence_threshold=-5", "deepspeed.param_persistence_threshold"),
    ("tiny/txl", "eval.mem_len=-2", "eval.mem_len"),
])
def test_impossible_settings_name_their_key(preset, override, key):
    assert key in error_of(load_config, preset, [override])


def test_cross_section_checks():
    both = error_of(load_config, TINY, ["eval.mem_len=16", "eval.mem_mult=2"])
    assert "eval.mem_len" in both and "eval.mem_mult" in both
    no_memory = error_of(load_config, "tiny/transformer", ["eval.mem_len=8"])
    assert "eval.mem_len=8" in no_memory and "transformer" in no_memory
    lamemo = error_of(load_config, "tiny/lamemo", ["eval.mem_len=0"])
    assert "eval.mem_len=0" in lamemo
    for longer in ("eval.mem_len=80", "eval.mem_mult=10"):  # RMT's mem_len is the cache it was trained without
        rmt = error_of(load_config, "tiny/rmt", [longer])
        assert "without the Transformer-XL cache" in rmt and "num_mem_tokens" in rmt
    assert load_config("tiny/rmt", ["model.mem_len=8", "eval.mem_mult=10"]).eval.mem_mult == 10
    ok = load_config(TINY, ["deepspeed.zero_stage=3", "deepspeed.offload_params=true",
                            "deepspeed.offload_optimizer=true"])
    assert ok.deepspeed.offload_params


def test_data_value_errors_become_config_errors():
    with pytest.raises(ConfigError, match=r"data\.num_workers"):
        load_config(TINY, ["data.num_workers=-1"])


def test_validate_config_rechecks_configs_edited_in_code():
    cfg = load_config(TINY)
    bad = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layer="2"))
    assert "model.n_layer" in error_of(validate_config, bad)
    assert validate_config(cfg) is cfg


def test_eval_model_config_applies_the_eval_section():
    cfg = load_config(TINY, ["eval.mem_mult=2.5", "eval.tgt_len=4", "eval.same_length=true", "eval.clamp_len=6"])
    m = eval_model_config(cfg)
    assert (m.tgt_len, m.mem_len, m.same_length, m.clamp_len) == (4, 10, True, 6)
    assert eval_model_config(load_config(TINY)) == load_config(TINY).model


# --- files and the YAML reader ---------------------------------------------------------------------------------


def test_file_mistakes_are_one_line(tmp_path):
    assert "not found" in error_of(load_config, tmp_path / "missing.yaml")
    bad = write(tmp_path / "bad.yaml", "model:\n  arch: [txl\n")
    assert "bad.yaml" in (message := error_of(load_config, bad)) and "line" in message
    assert "mapping" in error_of(load_config, write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_an_empty_section_keeps_defaults(tmp_path):
    assert load_config(write(tmp_path / "x.yaml", "model:\ntrain:\n")) == config_from_dict({})


def test_round_trip_keeps_overridden_values(tmp_path):
    cfg = load_config("paper/wt103/txl_rmt_mem75_tok5", ["train.adam_eps=1e-9", "eval.same_length=false"])
    again = load_config(dump_yaml(cfg, tmp_path / "config.yaml"))
    assert again == cfg and again.train.adam_eps == 1e-9 and again.eval.same_length is False


# --- flatten and tracking --------------------------------------------------------------------------------------


def test_flatten_has_every_key_dotted():
    cfg = load_config(TINY)
    flat = flatten(cfg)
    assert flat["model.arch"] == "txl" and flat["train.adam_betas"] == [0.9, 0.999]
    assert flat["deepspeed.precision"] == "fp32" and flat["eval.clamp_len"] is None
    def leaves(tree: dict) -> int:  # a nested section (data.remote) counts its keys; an empty mapping is one value
        return sum(leaves(value) if isinstance(value, dict) and value else 1 for value in tree.values())

    assert len(flat) == leaves(config_to_dict(cfg)) and flat["data.remote.prefetch"] == 2
    # every flattened value works as a command-line override (str fields take the raw text, the rest YAML)
    texts = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in flat.items()]
    assert config_from_dict({}, texts) == cfg


def test_tracking_uri_defaults_to_sqlite_in_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracking = load_config(TINY).tracking
    assert tracking.resolved_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking.resolved_uri(tmp_path) == "http://127.0.0.1:5000"
    assert dataclasses.replace(tracking, uri="sqlite:///x.db").resolved_uri() == "sqlite:///x.db"


def test_data_config_imports_nothing_from_other_packages():
    code = ("import sys, memlm.data_pipeline.config; "
            "bad = [m for m in sys.modules if m.split('.')[:2] in (['memlm', 'models'], ['memlm', 'trainer'], "
            "['memlm', 'cluster'])]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
