"""hf_rmt against the RMT authors' recurrence around a Hugging Face causal LM, written here from their definitions
(booydar/recurrent-memory-transformer's MemoryCell and RecurrentWrapper, the decoder layout of "Scaling Transformer
to 1M tokens and beyond with RMT"), one lane at a time, in float64:

  segment inputs   = [memory | the segment's token embeddings | memory]      (read at the start, write at the end)
  the LM's logits of the middle rows score the segment's tokens
  next memory      = the LM's last hidden state (after its final norm) at the last R rows
  first memory     = the learned memory parameter; a lane starting a document takes it again

Forward NLL of every segment and the gradient of every parameter, through every segment (full BPTT), for a GPT-2
(learned positions) and a Llama (rotary) backbone, with lanes reset at different segments.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memlm.models import ModelConfig, build_model

transformers = pytest.importorskip("transformers")  # the 'pretrained' extra: the test command installs it

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 16, "n_head": 2, "n_positions": 32, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 24, "max_position_embeddings": 64}
BACKBONES = {"gpt2": GPT2, "llama": LLAMA}
V, N, R, B, SEGMENTS = 50, 6, 3, 3, 4
RESETS = {1: [False, True, False], 2: [False, False, True], 3: [True, False, False]}  # segment -> lanes starting


def reference_lm(settings: dict) -> torch.nn.Module:
    """The backbone as the authors build it: transformers' own causal LM from its config."""
    settings = dict(settings)
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), vocab_size=V, bos_token_id=None,
                                               eos_token_id=None, pad_token_id=None, **settings)
    # sdpa, transformers' default: its eager path computes the softmax in float32 even for float64 inputs
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).double()


def authors_lane(lm, memory_param, tokens, targets, resets) -> list[torch.Tensor]:
    """One lane through every segment as MemoryCell does: -> per-segment NLL [N] (the memory chained, no cut)."""
    nlls, memory = [], None
    for s in range(tokens.shape[0]):
        if memory is None or resets[s]:
            memory = memory_param[None]  # [1, R, D]: set_memory
        embeds = lm.get_input_embeddings()(tokens[s][None])  # [1, N, D]
        out = lm(inputs_embeds=torch.cat([memory, embeds, memory], dim=1), output_hidden_states=True)
        logits = out.logits[:, R:-R]  # [1, N, V]
        nlls.append(F.cross_entropy(logits[0], targets[s], reduction="none"))
        memory = out.hidden_states[-1][:, -R:]  # the write rows' last hidden states
    return nlls


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, SEGMENTS, N), generator=g)
    targets = torch.randint(0, V, (B, SEGMENTS, N), generator=g)
    return tokens, targets


def memlm_model(settings: dict, **options):
    cfg = ModelConfig(arch="hf_rmt", vocab_size=V, tgt_len=N, mem_len=0, num_mem_tokens=R,
                      backbone_config=dict(settings), **options)
    return build_model(cfg).double()


def memlm_segments(model, tokens, targets) -> list[torch.Tensor]:
    """Every lane together, the state chained without a cut: -> per-segment NLL [B, N]."""
    memory, nlls = model.init_memory(B, dtype=torch.float64), []
    for s in range(SEGMENTS):
        reset = torch.tensor(RESETS.get(s, [False] * B))
        out = model(tokens[:, s], memory, reset=reset, targets=targets[:, s])
        nlls.append(out.nll)
        memory = out.memory
    return nlls


def grads(module, prefix_drop: str = "") -> dict[str, torch.Tensor]:
    return {name.removeprefix(prefix_drop): p.grad.clone() for name, p in module.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("family", sorted(BACKBONES))
def test_forward_and_every_gradient_equal_the_authors_recurrence(family):
    torch.manual_seed(0)
    model = memlm_model(BACKBONES[family])
    lm = reference_lm(BACKBONES[family])
    lm.load_state_dict(model.lm.state_dict())
    memory_param = torch.nn.Parameter(model.memory_init.detach().clone())
    tokens, targets = data(1)

    got = memlm_segments(model, tokens, targets)
    ref = [authors_lane(lm, memory_param, tokens[b], targets[b], [RESETS.get(s, [False] * B)[b]
                                                                    for s in range(SEGMENTS)]) for b in range(B)]
    for s in range(SEGMENTS):
        torch.testing.assert_close(got[s], torch.stack([ref[b][s] for b in range(B)]), rtol=0, atol=1e-12)

    torch.stack(got).sum().backward()
    torch.stack([torch.stack(lane) for lane in ref]).sum().backward()
    mine, theirs = grads(model.lm), grads(lm)
    assert mine.keys() == theirs.keys() and len(mine) == len(list(lm.parameters()))
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=1e-11, msg=name)
    torch.testing.assert_close(model.memory_init.grad, memory_param.grad, rtol=0, atol=1e-11)
    assert memory_param.grad.abs().sum() > 0


def test_the_first_segments_loss_reaches_no_later_memory_and_a_reset_cuts_the_chain():
    """Gradients as the recurrence says: segment 2's loss reaches segment 1's tokens through the memory, unless the
    lane reset at segment 2."""
    torch.manual_seed(0)
    model = memlm_model(GPT2)
    x = torch.randint(0, V, (2, N))
    memory = model.init_memory(2, dtype=torch.float64)
    embeds = []

    def keep(module, inputs, output):
        output.retain_grad()
        embeds.append(output)

    hook = model.lm.get_input_embeddings().register_forward_hook(keep)
    first = model(x, memory, targets=x)
    second = model(x, first.memory, reset=torch.tensor([False, True]), targets=x)
    hook.remove()
    second.nll.sum().backward()
    reach = embeds[0].grad.abs().sum(dim=(1, 2))  # [B]: segment 1's token embeddings
    assert reach[0] > 0 and reach[1] == 0


@pytest.mark.parametrize("family", sorted(BACKBONES))
def test_segment_checkpointing_recomputes_the_same_gradients(family):
    torch.manual_seed(0)
    plain = memlm_model(BACKBONES[family])
    torch.manual_seed(0)
    recomputed = memlm_model(BACKBONES[family], segment_checkpointing=True)
    recomputed.load_state_dict(plain.state_dict())
    tokens, targets = data(2)
    for model in (plain, recomputed):
        torch.stack(memlm_segments(model.train(), tokens, targets)).sum().backward()
    mine, theirs = grads(recomputed), grads(plain)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("train,trained", [("frozen", {"memory_init"}),
                                           ("lora", {"memory_init", "lora_A", "lora_B"}),
                                           ("full", None)])
def test_backbone_train_decides_what_gets_gradients_and_memory_always_does(train, trained):
    torch.manual_seed(0)
    model = memlm_model(GPT2, backbone_train=train, **({"lora_rank": 2} if train == "lora" else {}))
    tokens, targets = data(3)
    torch.stack(memlm_segments(model, tokens, targets)).sum().backward()
    # (LoRA's A gets a zero gradient at the start, its B being zero: a gradient all the same)
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    if trained is None:
        assert with_grad == {name for name, _ in model.named_parameters()}
    else:
        assert {part for name in with_grad for part in trained if part in name.split(".")} == trained
        assert all(any(part in name.split(".") for part in trained) for name in with_grad), with_grad


def test_lora_adapters_start_as_the_backbone():
    """LoRA's B starts at zero: the adapted model's outputs equal the plain backbone's until training moves it."""
    torch.manual_seed(0)
    plain = memlm_model(GPT2)
    torch.manual_seed(0)
    adapted = memlm_model(GPT2, backbone_train="lora", lora_rank=2)
    plain_state = plain.state_dict()
    adapted.load_state_dict({name: plain_state[name.replace(".base_layer", "")] if "lora_" not in name else value
                             for name, value in adapted.state_dict().items()})
    tokens, targets = data(4)
    for a, b in zip(memlm_segments(adapted.eval(), tokens, targets), memlm_segments(plain.eval(), tokens, targets)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
