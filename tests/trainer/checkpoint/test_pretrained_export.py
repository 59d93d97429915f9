"""`memlm export` of a run around a pretrained backbone, and what reads it back (tiny random GPT-2s, no hub).

The backbone here is a folder as save_pretrained writes it (config.json and model.safetensors), trained with LoRA
adapters (so the export holds base weights, adapters and memory). The export holds model.safetensors (every
weight), backbone/config.json (the backbone's transformers config) and config.yaml (memlm's, the memory's settings
included); with the backbone's folder gone, `memlm.load_pretrained` builds the model from backbone/config.json and
gives back the trained state dict and outputs exactly, and `memlm generate` decodes with the memory carried from
segment to segment. The training run is tracked (SQLite in tmp): its MLflow run names the backbone's folder.
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from memlm import load_pretrained
from memlm.cli import main
from memlm.trainer.checkpoint.run_loader import load_run
from memlm.trainer.inference.generate import Session
from support.training import make_data, train_in_process

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")
transformers = pytest.importorskip("transformers")  # the 'pretrained' extra: the test command installs it

N = 8  # tiny/hf_rmt's segment
BACKBONE = dict(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=256, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def chained_forward(model, tokens: torch.Tensor, resets: dict[int, list[bool]] | None = None):
    """tokens [B, S x N] scored segment by segment with the memory carried -> (per-segment log-probs, memories)."""
    memory, logps, memories = model.init_memory(tokens.shape[0]), [], []
    with torch.no_grad():
        for s, start in enumerate(range(0, tokens.shape[1], N)):
            reset = torch.tensor(resets[s]) if resets and s in resets else None
            out = model(tokens[:, start:start + N], memory, reset=reset, return_logits=True)
            logps.append(out.logits)
            memory = out.memory
            memories.append(memory.tokens)
    return logps, memories


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 3-step hf_rmt run on a backbone folder (LoRA rank 2), exported; the trained model's outputs recorded; then
    the backbone's folder removed."""
    root = tmp_path_factory.mktemp("pretrained_export")
    data = make_data(root)
    folder = root / "gpt2-tiny"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**BACKBONE)).save_pretrained(folder)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    train_in_process("hf_rmt", data, root / "run", model__backbone=str(folder), model__backbone_config="{}",
                     model__backbone_train="lora", model__lora_rank=2, train__steps=3, train__save_every=0,
                     tracking__enabled="true", tracking__uri=uri, tracking__experiment="backbones")
    assert main(["export", str(root / "run"), "--out", str(root / "export")]) == 0
    trained, _, _ = load_run(root / "run")  # the run's own weights, its backbone built from the folder
    tokens = torch.randint(0, 256, (2, 3 * N), generator=torch.Generator().manual_seed(3))
    resets = {2: [False, True]}  # lane 1 starts a document at segment 2
    outputs = chained_forward(trained, tokens, resets)
    folder_config = json.loads((folder / "config.json").read_text())
    shutil.rmtree(folder)
    return SimpleNamespace(root=root, run=root / "run", export=root / "export", folder=folder, uri=uri,
                           state=trained.state_dict(), tokens=tokens, resets=resets, outputs=outputs,
                           folder_config=folder_config)


def test_the_export_holds_weights_the_backbones_config_and_memlms(exported):
    export = exported.export
    assert (export / "model.safetensors").is_file() and (export / "config.yaml").is_file()
    saved = json.loads((export / "backbone" / "config.json").read_text())
    for key in ("model_type", "n_layer", "n_embd", "n_head", "n_positions", "vocab_size"):
        assert saved[key] == exported.folder_config[key], key
    marker = json.loads((export / "memlm-export.json").read_text())
    assert marker["arch"] == "hf_rmt" and marker["backbone"] == str(exported.folder.resolve())
    card = (export / "README.md").read_text()
    assert f"on a gpt2 backbone (from {exported.folder.resolve()}; model.backbone_train lora): 2 layers, width 32" \
        in card and "2 memory tokens" in card and "`backbone/config.json`" in card


def test_load_pretrained_gives_back_the_trained_model_without_its_backbone_folder(exported):
    assert not exported.folder.exists()
    model, tokenizer = load_pretrained(exported.export, expect_arch="hf_rmt", expect_vocab_size=256)
    state = model.state_dict()
    assert state.keys() == exported.state.keys()
    assert any(".lora_A." in name for name in state) and "learned.memory_init" in state
    for name, tensor in exported.state.items():
        assert torch.equal(state[name], tensor), name
    logps, memories = chained_forward(model, exported.tokens, exported.resets)
    want_logps, want_memories = exported.outputs
    for s in range(3):
        assert torch.equal(logps[s], want_logps[s]) and torch.equal(memories[s], want_memories[s]), s
    assert tokenizer.vocab_size == 256


def test_generation_carries_the_memory_from_segment_to_segment(exported, capsys):
    """Decoding token by token (the backbone's key/value cache within a segment, the model's forward at each
    segment's end) gives the log-probabilities of the segment-by-segment forward with its memory carried, which
    differ from reading each segment with a fresh memory."""
    model, _ = load_pretrained(exported.export)
    ids = exported.tokens[0].tolist()  # 3 segments
    session = Session(model)
    decoded = [session.feed(ids[:2 * N + 3], all_logits=True)]  # two whole segments, then 3 tokens decoded
    decoded += [session.feed([token]) for token in ids[2 * N + 3:]]
    decoded = torch.cat(decoded)  # [3 N, V]
    carried = torch.cat(chained_forward(model, exported.tokens[:1])[0], dim=1)[0]
    torch.testing.assert_close(decoded, carried, rtol=0, atol=1e-5)
    fresh = torch.cat([chained_forward(model, exported.tokens[:1, start:start + N])[0][0][0]
                       for start in range(0, 3 * N, N)])
    assert (carried[N:] - fresh[N:]).abs().max() > 1e-3  # the memory changes what later segments predict

    prompt = "the dog ran far away with a big red ball and the cat"  # 2 segments and more, fed with memory
    assert main(["generate", str(exported.export), "--prompt", prompt, "--tokens", "12", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and len(out) > len(prompt) + 1


def test_the_tracked_run_names_its_backbone(exported):
    from mlflow import MlflowClient

    run = MlflowClient(tracking_uri=exported.uri).get_run((exported.run / "mlflow_run_id").read_text().strip())
    assert run.data.tags["backbone"] == str(exported.folder.resolve()) and run.data.tags["arch"] == "hf_rmt"
    assert run.data.params["model.backbone"] == str(exported.folder)
    assert run.data.params["model.backbone_train"] == "lora"


def test_analyze_says_in_one_line_that_a_backbones_attention_is_not_recorded(exported, tmp_path):
    from memlm.models.config import ConfigError
    from memlm.trainer.inference.analyze import analyze_run

    with pytest.raises(ConfigError) as info:
        analyze_run(exported.export, out_dir=tmp_path / "analysis", track=False)
    message = str(info.value)
    assert message.startswith("analyze records attention inside memlm's own layers (transformer, txl, ")
    assert "arch 'hf_rmt' runs a transformers backbone's layers" in message and "\n" not in message
    assert not (tmp_path / "analysis").exists()
