"""A pretrained backbone's config in the run config: the tiny presets' inline GPT-2 is tiny and fits its memory rows,
one key of it changes by a dotted override (model.backbone_config.KEY=VALUE, typed as YAML reads it), a folder
replaces it on the command line, and a run names its backbone by folder or as "inline MODEL_TYPE". Torch-free."""

from __future__ import annotations

import pytest

from memlm.models.pretrained.shape import backbone_name
from memlm.trainer.config.run_config import ConfigError, dump_yaml, load_config

HF_PRESETS = ("hf", "hf_rmt", "hf_armt")


@pytest.mark.parametrize("arch", HF_PRESETS)
def test_the_tiny_backbone_presets_are_a_tiny_gpt2_with_room_for_their_memory_rows(arch):
    cfg = load_config(f"tiny/{arch}")
    m, inline = cfg.model, cfg.model.backbone_config
    assert m.arch == arch and not m.backbone and m.mem_len == 0 and m.tgt_len == 8
    assert (inline["model_type"], inline["n_layer"], inline["n_embd"], inline["n_head"]) == ("gpt2", 2, 32, 2)
    assert inline["resid_pdrop"] == inline["embd_pdrop"] == inline["attn_pdrop"] == 0.0
    memory_rows = {"hf": 0, "hf_rmt": 2 * m.num_mem_tokens, "hf_armt": m.num_mem_tokens}[arch]  # read+write / write
    assert m.tgt_len + memory_rows <= inline["n_positions"]
    if arch != "hf":
        assert m.num_mem_tokens >= 1 and m.bptt_depth >= 1 and m.bptt_mode == "window"
    assert cfg.train.steps <= 50 and cfg.deepspeed.precision == "fp32"


def test_a_dotted_override_sets_one_key_of_the_inline_backbone_config_with_its_yaml_type(tmp_path):
    cfg = load_config("tiny/hf_rmt", ["model.backbone_config.n_layer=3", "model.backbone_config.resid_pdrop=0.1",
                                      "model.backbone_config.activation_function=relu",
                                      "model.backbone_config.scale_attn_weights=false"])
    inline = cfg.model.backbone_config
    assert inline["n_layer"] == 3 and isinstance(inline["n_layer"], int)
    assert inline["resid_pdrop"] == 0.1 and inline["activation_function"] == "relu"
    assert inline["scale_attn_weights"] is False
    assert (inline["model_type"], inline["n_embd"], inline["n_positions"]) == ("gpt2", 32, 32)  # the rest kept
    # a key the preset leaves out is transformers' to check: it goes through as written
    assert load_config("tiny/hf", ["model.backbone_config.n_inner=48"]).model.backbone_config["n_inner"] == 48
    # the config.yaml a run writes reloads to the same config
    assert load_config(dump_yaml(cfg, tmp_path / "config.yaml")) == cfg


def test_an_override_that_breaks_the_backbone_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as info:
        load_config("tiny/hf_rmt", ["model.backbone_config.n_positions=8"])  # 8 tokens + 2 x 2 memory rows
    assert "model.tgt_len 8 with 4 memory rows is 12 positions" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config("tiny/hf_rmt", ["model.backbone_config=[1, 2]"])
    assert str(info.value) == "model.backbone_config: expected a mapping of keys, got [1, 2] (list)"


def test_a_folder_replaces_the_inline_config_from_the_command_line(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, '
                                        '"n_positions": 32, "vocab_size": 256}')
    (folder / "model.safetensors").write_bytes(b"")  # the checks look for the file; nothing is loaded here
    cfg = load_config("tiny/hf_rmt", [f"model.backbone={folder}", "model.backbone_config={}"])
    assert cfg.model.backbone == str(folder) and cfg.model.backbone_config == {}
    with pytest.raises(ConfigError) as info:
        load_config("tiny/hf_rmt", [f"model.backbone={folder}"])  # the preset's inline config still there
    assert "needs exactly one of model.backbone" in str(info.value) and "both are set" in str(info.value)
    # the run's MLflow tag and its export's marker name the folder, absolute
    assert backbone_name(cfg.model) == str(folder.resolve())


def test_a_run_names_its_backbone_inline_by_its_model_type_and_an_arch_without_one_by_nothing():
    assert backbone_name(load_config("tiny/hf_armt").model) == "inline gpt2"
    assert backbone_name(load_config("tiny/rmt").model) == ""
