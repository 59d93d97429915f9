"""Transformer-XL and the Transformer+RPE baseline against the slow absolute-position reference in
tests/support/reference.py, with several lanes whose documents start at different segments."""

import functools

import pytest
import torch

from memlm.models import build_model
from support.models import perturbed, tiny_model_config
from support.reference import lane_doc_starts, txl_reference

tiny = functools.partial(tiny_model_config, arch="txl")

def run_lanes(model, tokens, targets, seg_len, resets):
    """Model NLL [B, T] over tokens [B, T], segment by segment, memory carried; resets[k]: None or [B] bool."""
    memory = model.init_memory(tokens.shape[0])
    nll = []
    for k, s in enumerate(range(0, tokens.shape[1], seg_len)):
        out = model(tokens[:, s : s + seg_len], memory, reset=resets[k], targets=targets[:, s : s + seg_len])
        memory = out.memory
        nll.append(out.nll)
    return torch.cat(nll, dim=1)


# Lane 0: one document; lane 1: a new document at segment 2; lane 2: new documents at segments 1 and 3.
RESETS = [None, torch.tensor([False, False, True]), torch.tensor([False, True, False]),
          torch.tensor([False, False, True])]


@pytest.mark.parametrize("pre_lnorm", [False, True])
@pytest.mark.parametrize(
    "arch,mem_len,clamp_len,same_length,untie_r",
    [
        ("txl", 8, -1, False, False),
        ("txl", 5, 3, False, True),  # M < N, clamped distances
        ("txl", 13, -1, False, False),  # the cache reaches two segments back
        ("txl", 6, -1, True, False),  # same_length
        ("txl", 12, 4, True, True),
        ("transformer", 0, -1, False, False),
    ],
)
def test_txl_matches_absolute_position_reference(pre_lnorm, arch, mem_len, clamp_len, same_length, untie_r):
    torch.manual_seed(1)
    model = perturbed(build_model(tiny(arch=arch, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length,
                                       untie_r=untie_r, pre_lnorm=pre_lnorm, init_std=0.3))).eval()
    N, S, B = 8, len(RESETS), 3
    tokens = torch.randint(0, 50, (B, N * S))
    targets = torch.randint(0, 50, (B, N * S))
    targets[1, 5] = targets[2, 17] = -100
    with torch.no_grad():
        got = run_lanes(model, tokens, targets, N, RESETS)
    for b in range(B):
        want = txl_reference(model, tokens[b].tolist(), targets[b].tolist(), N, lane_doc_starts(RESETS, b, N))
        torch.testing.assert_close(got[b], torch.tensor(want, dtype=torch.float32), rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"lane {b}: {m}")


def test_segmented_txl_equals_one_causal_pass():
    """With M covering every earlier token, segment recurrence gives exactly the full-context causal model."""
    torch.manual_seed(2)
    total = 32
    tokens = torch.randint(0, 50, (2, total))
    targets = torch.randint(0, 50, (2, total))
    seg = build_model(tiny(mem_len=total)).eval()
    whole = build_model(tiny(mem_len=0, tgt_len=total))
    whole.load_state_dict(seg.state_dict())
    whole.eval()
    with torch.no_grad():
        segmented = run_lanes(seg, tokens, targets, 8, [None] * 4)
        one_pass = run_lanes(whole, tokens, targets, total, [None])
    torch.testing.assert_close(segmented, one_pass, rtol=1e-5, atol=1e-5)


def test_baseline_equals_txl_with_zero_memory():
    torch.manual_seed(3)
    tokens = torch.randint(0, 50, (2, 24))
    base = build_model(tiny(arch="transformer", mem_len=0)).eval()
    txl0 = build_model(tiny(arch="txl", mem_len=0))
    txl0.load_state_dict(base.state_dict())
    txl0.eval()
    with torch.no_grad():
        got = run_lanes(base, tokens, tokens, 8, [None] * 3)
        torch.testing.assert_close(got, run_lanes(txl0, tokens, tokens, 8, [None] * 3), rtol=0, atol=0)
        # and it really forgets: each segment equals a fresh model on that segment alone
        fresh = torch.cat([run_lanes(base, tokens[:, s : s + 8], tokens[:, s : s + 8], 8, [None])
                           for s in (0, 8, 16)], dim=1)
    torch.testing.assert_close(got, fresh, rtol=1e-6, atol=1e-6)


def test_memory_is_detached():
    model = build_model(tiny()).train()
    tokens = torch.randint(0, 50, (2, 8))
    out = model(tokens, model.init_memory(2), targets=tokens)
    assert all(not h.requires_grad for h in out.memory.hidden)
