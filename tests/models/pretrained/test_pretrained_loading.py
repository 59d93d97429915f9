"""A pretrained backbone from a local folder as save_pretrained writes it, and every refusal in one line before
anything runs: pickled weights only, no backbone or two, a config that is not a causal LM, memlm's own width keys,
a data vocabulary the backbone does not read, memory rows past the position table."""

from __future__ import annotations

import pytest
import torch

from memlm.models import ConfigError, ModelConfig, build_model

transformers = pytest.importorskip("transformers")

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 16, "n_head": 2, "n_positions": 32, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def saved_gpt2(folder, vocab: int = 50, **settings):
    """A random GPT-2 saved as save_pretrained writes it (config.json and model.safetensors)."""
    config = transformers.GPT2Config(vocab_size=vocab, n_layer=2, n_embd=16, n_head=2, n_positions=32, **settings)
    lm = transformers.GPT2LMHeadModel(config)
    lm.save_pretrained(folder)
    return lm


def rmt(**keys) -> ModelConfig:
    return ModelConfig(**{"arch": "hf_rmt", "vocab_size": 50, "tgt_len": 6, "mem_len": 0, "num_mem_tokens": 2, **keys})


def test_a_saved_folder_loads_with_its_weights_and_reads_as_the_backbone(tmp_path):
    torch.manual_seed(0)
    lm = saved_gpt2(tmp_path).eval()
    model = build_model(ModelConfig(arch="hf", vocab_size=50, tgt_len=6, mem_len=0, backbone=str(tmp_path))).eval()
    for name, value in lm.state_dict().items():
        torch.testing.assert_close(model.lm.state_dict()[name], value, rtol=0, atol=0)
    tokens = torch.randint(0, 50, (2, 6))
    out = model(tokens, model.init_memory(2), targets=tokens, return_logits=True)
    torch.testing.assert_close(out.logits, torch.log_softmax(lm(tokens).logits, -1), rtol=0, atol=1e-6)


def test_pickled_weights_are_refused_with_how_to_convert_them(tmp_path):
    saved_gpt2(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")  # what an old save leaves
    with pytest.raises(ConfigError, match=r"pickled weights only \(pytorch_model.bin\).*save_pretrained"):
        rmt(backbone=str(tmp_path)).validate()


@pytest.mark.parametrize("keys,message", [
    ({}, "needs exactly one of model.backbone"),
    ({"backbone": "x", "backbone_config": GPT2}, "both are set"),
    ({"backbone": "/nowhere/at/all"}, "is not a folder"),
    ({"backbone_config": {"n_layer": 2}}, "has no model_type"),
    ({"backbone_config": GPT2, "d_model": 64}, "model.d_model is memlm's own layers'"),
    ({"backbone_config": {**GPT2, "vocab_size": 99}}, "vocab_size is 99 and the data's vocabulary 50"),
    ({"backbone_config": GPT2, "tgt_len": 30}, "34 positions and the backbone's position table holds 32"),
    ({"backbone_config": GPT2, "backbone_train": "half"}, "backbone_train: unknown value 'half'"),
    ({"backbone_config": GPT2, "lora_rank": 4}, "only applies to model.backbone_train=lora"),
])
def test_bad_settings_are_one_line_naming_the_key(keys, message):
    with pytest.raises(ConfigError, match=message) as caught:
        rmt(**keys).validate()
    assert "\n" not in str(caught.value)


def test_a_config_that_is_not_a_causal_lm_is_refused_before_building():
    vision = {"model_type": "vit", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 32}
    with pytest.raises(ConfigError, match="'vit' is not a causal language model"):
        build_model(ModelConfig(arch="hf", vocab_size=50, tgt_len=6, mem_len=0, backbone_config=vision))


def test_data_with_another_tokenizers_vocabulary_is_refused(tmp_path):
    saved_gpt2(tmp_path, vocab=64)
    with pytest.raises(ConfigError, match=r"vocab_size is 50 .* reads 64 tokens: prepare the data with the backbone"):
        rmt(backbone=str(tmp_path)).validate()


def test_a_tokenizer_json_in_memlms_own_format_is_not_read_as_the_backbones(tmp_path):
    """memlm's tokenizer.json names its model file ("model": "spm.model"); only Hugging Face's holds a vocab."""
    saved_gpt2(tmp_path, vocab=64)
    (tmp_path / "tokenizer.json").write_text('{"format": "memlm-tokenizer", "model": "spm.model"}')
    with pytest.raises(ConfigError, match=r"the backbone \S+ reads 64 tokens"):
        rmt(backbone=str(tmp_path)).validate()
