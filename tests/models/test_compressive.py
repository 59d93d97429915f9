"""Compressive Transformer against the slow absolute-position reference (tests/support/reference.py), with lanes
whose documents start at different segments: per-token NLL and the attention-reconstruction loss; and where the
reconstruction loss's gradient goes."""

import functools

import pytest
import torch

from memlm.models import ConfigError, build_model
from support.models import perturbed, tiny_model_config
from support.reference import compressive_reference, lane_doc_starts

tiny = functools.partial(tiny_model_config, arch="compressive")
# Lane 0: one document; lane 1: a new document at segment 2; lane 2: new documents at segments 1 and 4.
RESETS = [None, torch.tensor([False, False, True]), torch.tensor([False, True, False]), None,
          torch.tensor([False, False, True])]


@pytest.mark.parametrize("mem_len,compressed_len,rate,pre_lnorm,clamp_len", [
    (8, 4, 2, False, -1),  # memory = segment, 4 slots per segment: the compressed memory holds one segment's
    (4, 6, 4, True, -1),  # M < N: evicted rows include the segment's own; 2 slots per segment, 3 segments kept
    (12, 5, 2, False, 6),  # M > N, C not a multiple of N / c, clamped distances
])
def test_compressive_matches_the_reference(mem_len, compressed_len, rate, pre_lnorm, clamp_len):
    torch.manual_seed(4)
    model = perturbed(build_model(tiny(mem_len=mem_len, compressed_len=compressed_len, compression_rate=rate,
                                       pre_lnorm=pre_lnorm, clamp_len=clamp_len, init_std=0.3)))
    model.train()  # the reconstruction loss is a training loss; dropout is 0 in the tiny config
    N, S, B = model.cfg.tgt_len, len(RESETS), 3
    tokens = torch.randint(0, 50, (B, N * S))
    targets = torch.randint(0, 50, (B, N * S))
    targets[1, 5] = -100
    memory = model.init_memory(B)
    nll, recon = [], []
    with torch.no_grad():
        for k in range(S):
            out = model(tokens[:, k * N : (k + 1) * N], memory, reset=RESETS[k],
                        targets=targets[:, k * N : (k + 1) * N])
            memory = out.memory
            nll.append(out.nll)
            recon.append(float(out.aux_loss))
    nll = torch.cat(nll, dim=1)
    want_recon = torch.zeros(S, dtype=torch.float64)
    for b in range(B):
        want = compressive_reference(model, tokens[b].tolist(), targets[b].tolist(), N,
                                     lane_doc_starts(RESETS, b, N))
        torch.testing.assert_close(nll[b], torch.tensor([x for seg in want for x in seg.nll], dtype=torch.float32),
                                   rtol=1e-4, atol=1e-4, msg=lambda m: f"lane {b}: {m}")
        want_recon += torch.tensor([seg.reconstruction for seg in want], dtype=torch.float64) / B
    assert want_recon[1:].min() > 0  # the test sees real reconstruction errors
    torch.testing.assert_close(torch.tensor(recon, dtype=torch.float64), want_recon, rtol=1e-4, atol=1e-7)


def test_the_reconstruction_loss_trains_the_compressor_alone_and_the_lm_loss_never_reaches_it():
    torch.manual_seed(5)
    model = build_model(tiny(compressed_len=4, compression_rate=2)).train()
    N, B = model.cfg.tgt_len, 2
    memory = model.init_memory(B)
    for _ in range(2):  # the second segment's evicted rows are real positions
        tokens = torch.randint(0, 50, (B, N + 1))
        out = model(tokens[:, :-1], memory, targets=tokens[:, 1:])
        memory = out.memory.detached()
    out.aux_loss.backward(retain_graph=True)
    compressor = {n for n, p in model.named_parameters() if n.startswith("compressors.")}
    touched = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert touched == compressor
    model.zero_grad(set_to_none=True)
    out.nll.mean().backward()
    assert not any(p.grad is not None and p.grad.abs().sum() > 0
                   for n, p in model.named_parameters() if n in compressor)
    assert all(p.requires_grad for p in model.parameters())  # the stop-gradient left every weight trainable


@pytest.mark.parametrize("kind", ["mean", "max"])
def test_pooling_compressions_have_no_parameters_and_pool_c_rows(kind):
    model = build_model(tiny(compressed_len=4, compression_rate=2, compression=kind, compression_loss_weight=0.0))
    assert not any(n.startswith("compressors.") for n, _ in model.named_parameters())
    rows = torch.randn(1, 4, model.cfg.d_model)
    pooled = model.compressors[0](rows)
    want = torch.stack([getattr(rows[0, 2 * i : 2 * i + 2], kind)(dim=0) if kind == "mean"
                        else rows[0, 2 * i : 2 * i + 2].max(dim=0).values for i in range(2)])
    torch.testing.assert_close(pooled[0], want)


@pytest.mark.parametrize("fields,named", [
    (dict(compressed_len=0), "model.compressed_len must be >= 1 for arch 'compressive'"),
    (dict(compressed_len=4, compression_rate=3), "model.compression_rate must be >= 1 and divide model.tgt_len=8"),
    # a slot would compress empty slots and a document's first rows together (and drop those rows)
    (dict(compressed_len=4, compression_rate=4, mem_len=10),
     "model.mem_len=10 must be a multiple of model.compression_rate=4 for arch 'compressive'"),
    (dict(compressed_len=4, compression_rate=2, compression="avg"),
     "model.compression: unknown function 'avg'; valid: conv, mean, max"),
    (dict(compressed_len=4, compression_rate=2, compression_loss_weight=-1.0),
     "model.compression_loss_weight must be >= 0"),
])
def test_impossible_compression_settings_are_named(fields, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        tiny(**fields).validate()
