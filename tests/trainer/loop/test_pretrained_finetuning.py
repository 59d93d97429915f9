"""Fine-tuning a pretrained backbone's memory through the trainer (tiny random GPT-2s given inline, no hub):
model.backbone_train decides which weights training moves, the memory's always; model.segment_checkpointing
recomputes each segment of a BPTT window and changes nothing of its loss or gradients.

What moves is read off the DeepSpeed engine's own module before and after `Trainer.fit` (trainer/loop/train.py:
open_trainer, build, fit): real steps of Adam at train.lr, 1 rank, ZeRO-0.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from memlm.models import ModelConfig, build_model
from memlm.trainer.config.run_config import load_config
from memlm.trainer.loop.recurrence import make_recurrence
from memlm.trainer.loop.train import open_trainer
from support.training import make_data, overrides

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")
pytest.importorskip("transformers")  # the 'pretrained' extra: the test command installs it
STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("finetune_data"))


def moved_by_training(data, out, arch: str, **extra) -> dict[str, bool]:
    """{parameter name: whether STEPS optimizer steps of `memlm train tiny/ARCH` changed it}."""
    cfg = load_config(f"tiny/{arch}", overrides(data, train__steps=STEPS, train__save_every=0, **extra))
    trainer = open_trainer(cfg, out)
    trainer.build()
    before = {name: p.detach().clone() for name, p in trainer.engine.module.named_parameters()}
    trainer.fit()
    after = dict(trainer.engine.module.named_parameters())
    assert after.keys() == before.keys()
    return {name: not torch.equal(before[name], after[name].detach()) for name in before}


def is_memory(name: str) -> bool:
    """The memory's own parameters: the learned initial memory, and ARMT's associative projections per layer."""
    return name == "learned.memory_init" or ".assoc." in name


def is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@pytest.mark.parametrize("arch,train", [("hf_rmt", "full"), ("hf_rmt", "frozen"), ("hf_rmt", "lora"),
                                        ("hf_armt", "frozen")])
def test_backbone_train_moves_what_it_trains_and_the_memory_always(data, tmp_path, arch, train):
    extra = {"model__lora_rank": 2} if train == "lora" else {}
    moved = moved_by_training(data, tmp_path / "run", arch, model__backbone_train=train, **extra)
    memory = {name for name in moved if is_memory(name)}
    assert memory and all(moved[name] for name in memory), moved  # the memory trains in every mode
    backbone = {name: did for name, did in moved.items() if name not in memory}
    assert backbone and any(name.startswith("lm.") for name in backbone)
    if train == "full":
        assert all(backbone.values()), [name for name, did in backbone.items() if not did]
    elif train == "frozen":
        assert not any(backbone.values()), [name for name, did in backbone.items() if did]
    else:  # lora: the adapters move (A from the second step on: B starts at zero), every backbone weight stays
        adapters = {name for name in backbone if is_lora(name)}
        assert adapters and all(backbone[name] for name in adapters)
        assert not any(did for name, did in backbone.items() if name not in adapters)


# --- segment checkpointing: the same window, recomputed ------------------------------------------------------

B, N, V = 2, 6, 40
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 16, "n_head": 2, "n_positions": 16, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}
ARCH_OPTIONS = {"hf_rmt": dict(num_mem_tokens=2), "hf_armt": dict(num_mem_tokens=2, assoc_dim=4,
                                                                   assoc_value_init_std=0.1)}


def window_losses_and_gradients(arch: str, checkpointing: bool, micro_batches: int = 4) -> list:
    """Per micro-batch of trainer/loop/recurrence.py's window BPTT (k = 2): (loss, every parameter's gradient),
    in float64, lane 1 starting a document at segment 2 (inside the window of the later segments)."""
    cfg = ModelConfig(arch=arch, vocab_size=V, tgt_len=N, mem_len=0, bptt_depth=2, backbone_config=GPT2,
                      segment_checkpointing=checkpointing, **ARCH_OPTIONS[arch])
    torch.manual_seed(0)
    model = build_model(cfg).double().train()
    recurrence = make_recurrence(cfg, model.init_memory(B, dtype=torch.float64), "cpu")
    gen = torch.Generator().manual_seed(1)
    segments = iter([SimpleNamespace(tokens=tokens, targets=torch.randint(0, V, (B, N), generator=gen),
                                     reset=torch.tensor([s == 0, s in (0, 2)]))
                     for s, tokens in enumerate(torch.randint(0, V, (micro_batches, B, N), generator=gen))])
    found = []
    for _ in range(micro_batches):
        model.zero_grad(set_to_none=True)
        batch = recurrence.step(model, lambda: next(segments))
        batch.loss.backward()
        recurrence.advance()
        found.append((batch.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                                            if p.grad is not None}))
    return found


@pytest.mark.parametrize("arch", sorted(ARCH_OPTIONS))
def test_segment_checkpointing_gives_a_bptt_window_the_same_loss_and_gradients(arch):
    plain = window_losses_and_gradients(arch, checkpointing=False)
    recomputed = window_losses_and_gradients(arch, checkpointing=True)
    for step, ((loss, grads), (loss_ckpt, grads_ckpt)) in enumerate(zip(plain, recomputed, strict=True)):
        assert torch.equal(loss, loss_ckpt), step
        assert grads.keys() == grads_ckpt.keys() and any(is_memory(name) for name in grads)
        for name in grads:
            assert torch.equal(grads[name], grads_ckpt[name]), (step, name)
    # the window reached back: the last step's loss has a gradient on the memory's initial state
    assert plain[-1][1]["learned.memory_init"].abs().sum() > 0
