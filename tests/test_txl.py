"""Transformer-XL and the Transformer+RPE baseline against the slow reference in tests/reference.py."""

import pytest
import torch

from models import ModelConfig, build_model
from reference import txl_reference


def tiny(**kw):
    base = dict(arch="txl", n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, vocab_size=50, tgt_len=8, mem_len=8)
    base.update(kw)
    return ModelConfig(**base)


def run_segments(model, stream, seg_len, lanes=1):
    """Model NLL over a single lane's stream, segment by segment, the memory carried along."""
    tokens = torch.tensor(stream)[None].repeat(lanes, 1)
    memory = model.init_memory(lanes)
    nll = []
    for s in range(0, len(stream) - 1, seg_len):
        e = min(s + seg_len, len(stream) - 1)
        out = model(tokens[:, s:e], memory, targets=tokens[:, s + 1 : e + 1])
        memory = out.memory
        nll.append(out.nll)
    return torch.cat(nll, dim=1)


@pytest.mark.parametrize("pre_lnorm", [False, True])
@pytest.mark.parametrize("mem_len,clamp_len,same_length,untie_r", [(8, -1, False, False), (5, 3, False, True), (6, -1, True, False)])
def test_txl_matches_slow_reference(pre_lnorm, mem_len, clamp_len, same_length, untie_r):
    torch.manual_seed(1)
    model = build_model(tiny(mem_len=mem_len, clamp_len=clamp_len, same_length=same_length, untie_r=untie_r, pre_lnorm=pre_lnorm)).eval()
    stream = torch.randint(0, 50, (27,)).tolist()
    got = run_segments(model, stream, 8)[0]
    want = torch.tensor(txl_reference(model, stream, 8, mem_len, same_length=same_length), dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_segmented_txl_equals_one_causal_pass():
    """With M covering every earlier token, segment recurrence gives exactly the full-context causal model."""
    torch.manual_seed(2)
    total = 32
    stream = torch.randint(0, 50, (total + 1,)).tolist()
    seg = build_model(tiny(mem_len=total)).eval()
    whole = build_model(tiny(mem_len=0, tgt_len=total))
    whole.load_state_dict(seg.state_dict())
    whole.eval()
    segmented = run_segments(seg, stream, 8)
    one_pass = run_segments(whole, stream, total)
    torch.testing.assert_close(segmented, one_pass, rtol=1e-5, atol=1e-5)


def test_baseline_equals_txl_with_zero_memory():
    torch.manual_seed(3)
    stream = torch.randint(0, 50, (25,)).tolist()
    base = build_model(tiny(arch="transformer", mem_len=0)).eval()
    txl0 = build_model(tiny(arch="txl", mem_len=0))
    txl0.load_state_dict(base.state_dict())
    txl0.eval()
    torch.testing.assert_close(run_segments(base, stream, 8), run_segments(txl0, stream, 8), rtol=0, atol=0)
    # and it really forgets: each segment equals a fresh model on that segment alone
    fresh = torch.cat([run_segments(base, stream[s : s + 9], 8) for s in range(0, 24, 8)], dim=1)
    torch.testing.assert_close(run_segments(base, stream, 8), fresh, rtol=1e-6, atol=1e-6)


def test_memory_is_detached():
    model = build_model(tiny()).train()
    tokens = torch.randint(0, 50, (2, 8))
    out = model(tokens, model.init_memory(2), targets=tokens)
    assert all(not h.requires_grad for h in out.memory.hidden)
