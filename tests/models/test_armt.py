"""ARMT against the slow reference (tests/support/reference.py) with lanes whose documents start at different
segments; DPFP element by element; where gradients go across segments; config errors."""

import functools

import pytest
import torch

from memlm.models import ConfigError, build_model
from memlm.models.armt import dpfp
from support.models import perturbed, tiny_model_config
from support.reference import armt_reference, dpfp_reference, lane_doc_starts

tiny = functools.partial(tiny_model_config, arch="armt", mem_len=0)
# Lane 0: one document; lane 1: a new document at segment 2; lane 2: new documents at segments 1 and 3.
RESETS = [None, torch.tensor([False, False, True]), torch.tensor([False, True, False]),
          torch.tensor([False, False, True])]


@pytest.mark.parametrize("settings", [
    dict(num_mem_tokens=2, assoc_dim=3),
    dict(num_mem_tokens=1, assoc_dim=2, pre_lnorm=True, clamp_len=5),
    dict(num_mem_tokens=3, assoc_dim=4, untie_r=True, n_layer=3),
])
def test_armt_matches_the_reference(settings):
    torch.manual_seed(11)
    model = perturbed(build_model(tiny(init_std=0.3, assoc_value_init_std=0.3, **settings))).eval()
    N, S, B = model.cfg.tgt_len, len(RESETS), 3
    tokens = torch.randint(0, 50, (B, N * S))
    targets = torch.randint(0, 50, (B, N * S))
    targets[2, 9] = -100
    memory, nll = model.init_memory(B), []
    with torch.no_grad():
        for k in range(S):
            seg = slice(k * N, (k + 1) * N)
            out = model(tokens[:, seg], memory, reset=RESETS[k], targets=targets[:, seg])
            memory = out.memory
            nll.append(out.nll)
    nll = torch.cat(nll, dim=1)
    for b in range(B):
        want = armt_reference(model, tokens[b].tolist(), targets[b].tolist(), N, lane_doc_starts(RESETS, b, N))
        torch.testing.assert_close(nll[b], torch.tensor([x for seg in want for x in seg], dtype=torch.float32),
                                   rtol=1e-4, atol=1e-4, msg=lambda m: f"lane {b}: {m}")
    assert all(a.abs().amax() > 0 for a in memory.assoc)  # the comparison saw a state that was written


def test_dpfp_element_by_element():
    x = torch.randn(4, 5, dtype=torch.float64)
    got = dpfp(x)
    assert got.shape == (4, 30) and got.min() >= 0
    for row in range(4):
        torch.testing.assert_close(got[row], dpfp_reference(x[row]))


def test_a_new_model_reads_nothing_until_its_values_learn():
    """W_v = 0 at init: every read is exactly 0, so a segment's output does not depend on the segments before."""
    torch.manual_seed(2)
    model = build_model(tiny(num_mem_tokens=2, assoc_dim=3)).eval()
    tokens = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        first = model(tokens[:, :8], model.init_memory(2))
        after = model(tokens[:, 8:], first.memory, targets=tokens[:, 8:])
        alone = model(tokens[:, 8:], model.init_memory(2), targets=tokens[:, 8:])
    assert first.memory.norm[0].abs().amax() > 0  # z is written from the first segment on
    torch.testing.assert_close(after.nll, alone.nll, rtol=0, atol=0)


def test_the_loss_reaches_every_segment_the_state_was_chained_through():
    """Through the state, a segment's loss reaches every earlier segment that wrote what it reads, until the
    caller cuts the state (`detached()`): the model never cuts it itself. How far back training reaches is the
    trainer's schedule (model.bptt_depth: tests/trainer/loop/test_rmt_bptt.py)."""
    torch.manual_seed(5)
    model = build_model(tiny(num_mem_tokens=2, assoc_dim=3, bptt_depth=1, init_std=0.2, assoc_value_init_std=0.3))
    model.train()
    N, D, S = model.cfg.tgt_len, model.cfg.d_model, 4
    tokens = torch.randint(0, 50, (1, N * S))
    offsets = [torch.zeros(1, N, D, requires_grad=True) for _ in range(S)]  # added to each segment's embeddings
    memory, losses = model.init_memory(1), []
    for k in range(S):
        hook = model.embed.register_forward_hook(lambda _m, _i, out, k=k: out + offsets[k])
        out = model(tokens[:, k * N : (k + 1) * N], memory, targets=tokens[:, k * N : (k + 1) * N])
        hook.remove()
        memory = out.memory.detached() if k == 1 else out.memory  # cut after the second segment
        losses.append(out.nll.mean())

    def reached(k):
        grads = torch.autograd.grad(losses[k], offsets[:k], allow_unused=True, retain_graph=True) if k else ()
        return [j for j, g in enumerate(grads) if g is not None and g.abs().sum() > 0]

    assert [reached(k) for k in range(S)] == [[], [0], [], [2]]


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="^model.assoc_dim must be >= 1 for arch 'armt'"):
        build_model(tiny(num_mem_tokens=2))
    with pytest.raises(ConfigError, match="^model.num_mem_tokens must be >= 1 for arch 'armt'"):
        build_model(tiny(assoc_dim=4))
    with pytest.raises(ConfigError, match="^model.mem_len must be 0 for arch 'armt'"):
        build_model(tiny(num_mem_tokens=2, assoc_dim=4, mem_len=4))
    with pytest.raises(ConfigError, match="model.assoc_dim only applies to arch 'armt'"):
        build_model(tiny_model_config(arch="rmt", num_mem_tokens=2, assoc_dim=4))
