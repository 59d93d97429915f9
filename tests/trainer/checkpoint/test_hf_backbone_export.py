"""`memlm export RUN --out DIR --hf-backbone`: a run's backbone as a Hugging Face folder that the next run's
model.backbone loads (issue 37 item 5).

The backbone is a tiny random GPT-2 folder with its own BPE tokenizer.json (built here, no hub); the runs train on
data prepared with that tokenizer. Every check reads the exported folder with transformers itself (from_pretrained,
its own parameter names), never with memlm's reader: an `hf` run with LoRA adapters exports the function it trained
(LoRA merged), an hf_armt run its GPT-2 without the associative wrappers, and an hf_rmt run on the exported folder
starts from exactly its weights.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from memlm.cli import main
from memlm.data_pipeline.prepare import prepare
from memlm.trainer.checkpoint.run_loader import load_run
from memlm.trainer.checkpoint.store import find_checkpoint
from memlm.trainer.checkpoint.weights import load_weights
from support.hf_backbone import gpt2_folder, train_bpe, wiki_lines
from support.training import make_data, train_in_process

transformers = pytest.importorskip("transformers")  # the 'pretrained' extra: the test command installs it
pytest.importorskip("tokenizers")

N = 8  # the tiny presets' segment


def transformers_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A backbone folder with its tokenizer, data in its tokens, an `hf` run with LoRA adapters (3 steps) and its
    --hf-backbone export."""
    root = tmp_path_factory.mktemp("hf_backbone_export")
    make_data(root)  # root/corpus: short random-word documents
    folder = gpt2_folder(root / "gpt2", train_bpe(wiki_lines(), 300))
    data = root / "data-bpe"
    prepare("textdir", root / "corpus", data, tokenizer_from=folder, workers=1, progress=False)
    backbone = dict(model__backbone=str(folder), model__backbone_config="{}")
    train_in_process("hf", data, root / "hf", model__backbone_train="lora", model__lora_rank=2, train__steps=3,
                     train__save_every=0, **backbone)
    assert main(["export", str(root / "hf"), "--out", str(root / "exported"), "--hf-backbone"]) == 0
    return SimpleNamespace(root=root, folder=folder, data=data, exported=root / "exported", backbone=backbone)


def test_an_hf_run_exports_the_function_it_trained_as_a_transformers_folder(runs):
    exported = runs.exported
    assert {p.name for p in exported.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                      "memlm-backbone.json"}
    assert (exported / "tokenizer.json").read_bytes() == (runs.folder / "tokenizer.json").read_bytes()
    marker = json.loads((exported / "memlm-backbone.json").read_text())
    assert marker["arch"] == "hf" and marker["step"] == 3 and marker["lora_merged"] is True
    lm = transformers_model(exported)
    # transformers' own names: those of the folder trained from, no LoRA or memlm names
    assert lm.state_dict().keys() == transformers_model(runs.folder).state_dict().keys()
    trained, _, _ = load_run(runs.root / "hf")  # the run's model: LoRA adapters on the backbone
    tokens = torch.randint(0, 300, (2, N), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = trained(tokens, trained.init_memory(2), return_logits=True).logits
        got = torch.log_softmax(lm(tokens).logits, dim=-1)
        before = torch.log_softmax(transformers_model(runs.folder)(tokens).logits, dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (before - want).abs().max() > 1e-4  # the 3 steps moved it: the export holds the trained function


def test_hf_rmt_on_the_exported_folder_starts_from_its_weights(runs):
    """backbone_train frozen: the backbone's weights in the run's checkpoint are those it started with at step 0,
    while the memory (memory_init) trains."""
    out = runs.root / "rmt"
    losses = train_in_process("hf_rmt", runs.data, out, model__backbone=str(runs.exported),
                              model__backbone_config="{}", model__backbone_train="frozen", train__steps=2,
                              train__save_every=0)
    assert len([m for m in losses if "loss" in m]) == 2
    saved = load_weights(*find_checkpoint(out, None))
    exported = transformers_model(runs.exported).state_dict()
    for name, tensor in exported.items():
        assert torch.equal(saved[f"lm.{name}"], tensor), name
    assert saved["learned.memory_init"].shape == (2, 32)


def test_an_hf_armt_export_is_its_gpt2_without_the_memory(runs):
    out = runs.root / "armt"
    train_in_process("hf_armt", runs.data, out, train__steps=2, train__save_every=0, **runs.backbone)
    assert main(["export", str(out), "--out", str(runs.root / "armt-backbone"), "--hf-backbone"]) == 0
    marker = json.loads((runs.root / "armt-backbone" / "memlm-backbone.json").read_text())
    assert "learned.memory_init" in marker["memory_left_out"]
    assert any(".assoc." in name for name in marker["memory_left_out"])
    saved = load_weights(*find_checkpoint(out, None))
    lm = transformers_model(runs.root / "armt-backbone")
    for name, tensor in lm.state_dict().items():
        wrapped = name.replace(".h.0.", ".h.0.layer.").replace(".h.1.", ".h.1.layer.")  # AssociativeLayer.layer
        assert torch.equal(saved[f"lm.{wrapped}"], tensor), name
    assert not any(".assoc." in name for name in lm.state_dict())


def test_a_run_of_memlms_own_layers_and_a_foreign_folder_are_one_line(runs, tmp_path, capsys):
    data = make_data(tmp_path)
    train_in_process("txl", data, tmp_path / "txl", train__steps=2, train__save_every=0)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "txl"), "--out", str(tmp_path / "out"), "--hf-backbone"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a txl run, whose layers are memlm's own" in err, err
    assert not (tmp_path / "out").exists()
    assert main(["export", str(runs.root / "hf"), "--out", str(runs.folder), "--hf-backbone", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a memlm --hf-backbone export" in err, err
    assert (runs.folder / "tokenizer.json").is_file()
