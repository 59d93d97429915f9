"""hf_armt against the ARMT authors' associative wrapper around a Hugging Face causal LM's decoder layers, written
here from their definitions (RodkinIvan/associative-recurrent-memory-transformer, AssociativeLayerWrapper and
AssociativeMemoryCell; Rodkin et al. 2024, eqs. 1-4) as the authors write it: a module around each layer holding its
memory (W_mem, z) as mutable state and a first-segment flag, one lane at a time, in float64:

  segment inputs  = [the segment's token embeddings | the memory tokens' embeddings]   (the same learned ones each time)
  around layer l: before it, unless first segment:  h <- h + phi(W_q h) W_mem / (z . phi(W_q h) + eps)
                  after it, from the memory rows' outputs m:  k = phi(W_k m), v = W_v m, beta = sigmoid(W_b m)
                      first segment: v_old = 0, gamma = 1; else v_old = k W_mem / (z . k + eps),
                      gamma = clip(1 - (z . k + eps) / (|k|^2 + eps), 0, 1) without gradient
                      W_mem += sum_i beta_i k_i (v_i - v_old_i)^T,   z += sum_i gamma_i k_i
  phi = DPFP with nu = 3; eps = 1e-5; a lane starting a document starts from an empty memory (a first segment).

Forward NLL of every segment and every parameter's gradient through every segment, for GPT-2 and Llama backbones.
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
# initializer_range 0.5, not transformers' 0.02: rows of norm ~1 and projections to match, so the associative read
# (phi(W_q h) W_mem over z . phi(W_q h) + 1e-5) is not drowned by the epsilon as it is at 0.02 in a width of 16
BACKBONES = {"gpt2": {**GPT2, "initializer_range": 0.5}, "llama": {**LLAMA, "initializer_range": 0.5}}
V, N, R, B, SEGMENTS, D_MEM, EPS = 50, 6, 3, 3, 4, 4, 1e-5
RESETS = {1: [False, True, False], 2: [False, False, True], 3: [True, False, False]}


def phi(x: torch.Tensor, nu: int = 3) -> torch.Tensor:
    """DPFP (Schlag et al. 2021): x' = [relu(x), relu(-x)]; concatenated products of x' with its rolls 1..nu."""
    x = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
    return torch.cat([x * x.roll(shifts=j, dims=-1) for j in range(1, nu + 1)], dim=-1)


class AuthorsWrapper(torch.nn.Module):
    """Around one decoder layer, the memory as the authors keep it: W_mem [F, D] and z [F], plus first_seg."""

    def __init__(self, layer, W_q, W_k, W_v, W_b, b_b):
        super().__init__()
        self.layer = layer
        self.W_q, self.W_k, self.W_v = (torch.nn.Parameter(w.clone()) for w in (W_q, W_k, W_v))
        self.W_b, self.b_b = torch.nn.Parameter(W_b.clone()), torch.nn.Parameter(b_b.clone())
        self.first_seg, self.W_mem, self.z = True, None, None

    def forget(self):
        self.first_seg = True
        self.W_mem = torch.zeros(phi(torch.zeros(D_MEM)).shape[0], self.W_v.shape[0], dtype=torch.float64)
        self.z = torch.zeros(self.W_mem.shape[0], dtype=torch.float64)

    def forward(self, hidden_states, *args, **kwargs):
        if not self.first_seg:
            q = phi(hidden_states @ self.W_q.T)  # [1, Q, F]
            hidden_states = hidden_states + (q @ self.W_mem) / ((q @ self.z)[..., None] + EPS)
        out = self.layer(hidden_states, *args, **kwargs)
        m = (out[0] if isinstance(out, tuple) else out)[0, -R:]  # [R, D] the memory rows' outputs
        k, v = phi(m @ self.W_k.T), m @ self.W_v.T  # [R, F], [R, D]
        beta = torch.sigmoid(m @ self.W_b.T + self.b_b)  # [R, 1]
        if self.first_seg:
            v_old, gamma = torch.zeros_like(v), torch.ones(R, dtype=v.dtype)
        else:
            v_old = (k @ self.W_mem) / ((k @ self.z)[:, None] + EPS)
            gamma = torch.clip(1 - ((k @ self.z) + EPS) / ((k * k).sum(-1) + EPS), 0, 1).detach()
        self.W_mem = self.W_mem + k.T @ (beta * (v - v_old))
        self.z = self.z + (gamma[:, None] * k).sum(0)
        self.first_seg = False
        return out


def reference(model, settings: dict):
    """The authors' model: transformers' LM with the memlm model's weights, each layer in an AuthorsWrapper."""
    settings = dict(settings)
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), vocab_size=V, bos_token_id=None,
                                               eos_token_id=None, pad_token_id=None, **settings)
    config._attn_implementation = "sdpa"
    lm = transformers.AutoModelForCausalLM.from_config(config).double()
    state = {name.replace(".layer.", "."): value for name, value in model.lm.state_dict().items()
             if ".assoc." not in name}
    lm.load_state_dict(state)
    layers = lm.transformer.h if settings.get("n_layer") else lm.model.layers
    for l, wrapped in enumerate(model.decoder_layers()):
        a = wrapped.assoc
        layers[l] = AuthorsWrapper(layers[l], a.query.weight.detach(), a.key.weight.detach(), a.value.weight.detach(),
                                   a.beta.weight.detach(), a.beta.bias.detach())
    return lm, layers


def authors_lane(lm, layers, memory_tokens, tokens, targets, resets) -> list[torch.Tensor]:
    nlls = []
    for s in range(tokens.shape[0]):
        if s == 0 or resets[s]:
            for layer in layers:
                layer.forget()
        embeds = lm.get_input_embeddings()(tokens[s][None])  # [1, N, D]
        out = lm(inputs_embeds=torch.cat([embeds, memory_tokens[None]], dim=1))
        nlls.append(F.cross_entropy(out.logits[0, :N], targets[s], reduction="none"))
    return nlls


@pytest.mark.parametrize("family", sorted(BACKBONES))
def test_forward_and_every_gradient_equal_the_authors_wrapper(family):
    torch.manual_seed(0)
    cfg = ModelConfig(arch="hf_armt", vocab_size=V, tgt_len=N, mem_len=0, num_mem_tokens=R, assoc_dim=D_MEM,
                      assoc_value_init_std=0.3, backbone_config=dict(BACKBONES[family]))
    model = build_model(cfg).double()
    lm, layers = reference(model, BACKBONES[family])
    memory_tokens = torch.nn.Parameter(model.memory_init.detach().clone())
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, V, (B, SEGMENTS, N), generator=g), torch.randint(0, V, (B, SEGMENTS, N),
                                                                                         generator=g)
    memory, got = model.init_memory(B, dtype=torch.float64), []
    for s in range(SEGMENTS):
        out = model(tokens[:, s], memory, reset=torch.tensor(RESETS.get(s, [False] * B)), targets=targets[:, s])
        got.append(out.nll)
        memory = out.memory
    ref = [authors_lane(lm, layers, memory_tokens, tokens[b], targets[b],
                        [RESETS.get(s, [False] * B)[b] for s in range(SEGMENTS)]) for b in range(B)]
    for s in range(SEGMENTS):
        torch.testing.assert_close(got[s], torch.stack([ref[b][s] for b in range(B)]), rtol=0, atol=1e-12)
    alone = model(tokens[:1, 1], model.init_memory(1, dtype=torch.float64), targets=targets[:1, 1]).nll[0]
    assert not torch.allclose(got[1][0], alone)  # lane 0's memory of segment 0 changed what it predicts in 1

    torch.stack(got).sum().backward()
    torch.stack([torch.stack(lane) for lane in ref]).sum().backward()
    names = {"query.weight": "W_q", "key.weight": "W_k", "value.weight": "W_v", "beta.weight": "W_b",
             "beta.bias": "b_b"}
    theirs = {name: p.grad for name, p in lm.named_parameters()}
    checked = 0
    for name, p in model.lm.named_parameters():
        if ".assoc." in name:  # transformer.h.0.assoc.query.weight -> transformer.h.0.W_q
            layer_path, _, own = name.partition(".assoc.")
            expected = theirs[f"{layer_path}.{names[own]}"]
        else:  # both wrap the layer as `.layer`
            expected = theirs[name]
        torch.testing.assert_close(p.grad, expected, rtol=1e-11, atol=1e-11, msg=lambda m: f"{name}: {m}")
        checked += 1
    assert checked == len(theirs)
    torch.testing.assert_close(model.memory_init.grad, memory_tokens.grad, rtol=0, atol=1e-11)
    assert all(layer.W_v.grad.abs().sum() > 0 for layer in layers)  # the associative path was exercised
