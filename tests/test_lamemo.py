"""LaMemo against the paper's equations, written out position by position in tests/reference.py."""

import math

import pytest
import torch

from models import ModelConfig, build_model
from reference import lamemo_reference, pos_key, split_qkv


def tiny(**kw):
    base = dict(arch="lamemo", n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, vocab_size=50, tgt_len=4, mem_len=8)
    base.update(kw)
    return ModelConfig(**base)


def run_lane(model, stream, seg_len):
    tokens = torch.tensor(stream)[None]
    memory = model.init_memory(1)
    nll = []
    for s in range(0, len(stream) - 1, seg_len):
        out = model(tokens[:, s : s + seg_len], memory, targets=tokens[:, s + 1 : s + seg_len + 1])
        memory = out.memory
        nll.append(out.nll[0])
    return torch.cat(nll), memory


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(mem_len=3),  # M < N
        dict(mem_len=4),  # M = N
        dict(rpe="xl"),
        dict(lookahead=False),
        dict(interpolate=False),
        dict(pre_lnorm=True, untie_r=True),
        dict(clamp_len=3, interp_eps=1e-2),
        dict(same_length=True),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default",
)
def test_multi_segment_lamemo_matches_loop_reference(options):
    torch.manual_seed(5)
    model = build_model(tiny(**options)).eval()
    stream = torch.randint(0, 50, (4 * 5 + 1,)).tolist()
    got, memory = run_lane(model, stream, 4)
    want, cache = lamemo_reference(model, stream, 4, model.cfg.mem_len)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-4, atol=1e-4)
    # the cached memory state (C and S per layer) as well, slot by slot
    positions = sorted(cache[0])
    M = model.cfg.mem_len
    for l in range(model.cfg.n_layer):
        for slot, p in enumerate(positions[-M:], start=M - len(positions[-M:])):
            C, S = cache[l][p]
            torch.testing.assert_close(memory.context[l][0, slot].double(), C, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(memory.lognorm[l][0, slot].double(), S, rtol=1e-4, atol=1e-5)


def test_single_layer_interpolation_is_one_softmax_over_past_and_lookahead_keys():
    """One layer, M > N so a position stays in memory for several segments: its cached context must equal a
    single softmax over its causal keys and every look-ahead key so far (the windows tile without gaps or
    overlap), and its log-normaliser the logsumexp over that union. Since C' = alpha C + (1 - alpha) A mixes
    two softmaxes over disjoint key sets, this holds only when alpha is the union's mass on the past."""
    torch.manual_seed(6)
    N, M = 3, 10
    model = build_model(tiny(n_layer=1, tgt_len=N, mem_len=M, interp_eps=0.0)).eval()
    cfg = model.cfg
    H, E, D = cfg.n_head, cfg.d_head, cfg.d_model
    stream = torch.randint(0, 50, (N * 6 + 1,)).tolist()
    _, memory = run_lane(model, stream, N)
    layer = model.layers[0]
    emb = model.embed(torch.tensor(stream)[None])[0].double()
    kv = [split_qkv(layer, emb[p], H, E) for p in range(len(stream))]
    u, v_left, v_right = (t.double() for t in (model.learned.bias_u, model.learned.bias_v, model.learned.bias_v_ahead))
    last_start = N * 5  # first token of the last segment processed
    checked = 0
    for slot in range(M):
        i = last_start + N - M + slot  # absolute position of this memory slot
        if i >= last_start:
            continue  # current tokens of the last segment: plain causal attention
        seg_start = (i // N) * N
        causal = range(max(0, seg_start - M), i + 1)  # keys i saw when it was current
        ahead = range(i + 1, last_start + 1)  # every look-ahead key up to the last segment's first token
        scores, values = [], []
        for j in causal:
            rk = pos_key(layer, i - j, -1, D, H, E)
            scores.append((((kv[i][0] + u) * kv[j][1]).sum(-1) + ((kv[i][0] + v_left) * rk).sum(-1)) / math.sqrt(E))
            values.append(kv[j][2])
        for p in ahead:
            rk = pos_key(layer, p - i, -1, D, H, E)
            scores.append((((kv[i][0] + u) * kv[p][1]).sum(-1) + ((kv[i][0] + v_right) * rk).sum(-1)) / math.sqrt(E))
            values.append(kv[p][2])
        s = torch.stack(scores)  # [keys, H]
        probs = torch.softmax(s, dim=0)
        want_ctx = sum(probs[j][:, None] * values[j] for j in range(len(values)))
        torch.testing.assert_close(memory.context[0][0, slot].double(), want_ctx, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(memory.lognorm[0][0, slot].double(), torch.logsumexp(s, 0), rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked == M - N


def test_lookahead_bias_gets_gradient_only_through_a_real_memory():
    """v- is used only by memory rows; it can influence the loss only once the memory holds real positions."""
    model = build_model(tiny()).train()
    tokens = torch.randint(0, 50, (2, 9))
    memory = model.init_memory(2)
    out = model(tokens[:, :4], memory, targets=tokens[:, 1:5])
    out.nll.sum().backward()
    assert model.learned.bias_v_ahead.grad is not None and model.learned.bias_v_ahead.grad.abs().max() == 0
    model.zero_grad()
    out = model(tokens[:, 4:8], out.memory, targets=tokens[:, 5:9])
    out.nll.sum().backward()
    assert model.learned.bias_v_ahead.grad.abs().max() > 0
    assert not any(t.requires_grad for t in [out.memory.embed, *out.memory.context, *out.memory.lognorm])


def test_lognorm_and_alpha_stay_fp32_under_bf16_autocast():
    model = build_model(tiny())
    tokens = torch.randint(0, 50, (2, 4))
    memory = model.init_memory(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            out = model(tokens, memory, targets=tokens)
            memory = out.memory
    assert all(s.dtype == torch.float32 for s in memory.lognorm)
    assert torch.isfinite(out.nll).all()
