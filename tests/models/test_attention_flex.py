"""FlexAttention (model.attention: flex) computes the same function as the einsum path (eager), which the slow
references check.

Here on the CPU: forward only (FlexAttention has no CPU backward in torch 2.13), for `attend` itself on every mask
kind and for every arch over several segments with resets, memory included. On a GPU (`bash bench/benchmarks/gpu_run.sh`
runs this file there) also the loss and every parameter's gradient, in fp32 and bf16, with FlexAttention compiled.
"""

import functools

import pytest
import torch
from torch import nn

from memlm.models import build_model
from memlm.models.attention import attend, causal_allowed, causal_index
from memlm.models.attention_flex import flex_attend, flex_mask
from memlm.models.config import ConfigError
from memlm.models.mask_layout import causal_layout
from memlm.models.rmt import rmt_allowed, rmt_positions
from support.models import tiny_model_config

CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not CUDA,
                              reason="FlexAttention's backward needs CUDA (bench/benchmarks/gpu_run.sh runs this)")

ARCHS = {
    "transformer": dict(arch="transformer", mem_len=0),
    "txl": dict(arch="txl"),
    "txl_same_length": dict(arch="txl", same_length=True),
    "lamemo": dict(arch="lamemo"),
    "lamemo_xl_rpe": dict(arch="lamemo", rpe="xl"),
    "rmt": dict(arch="rmt", mem_len=0, num_mem_tokens=2),
    "rmt_with_cache": dict(arch="rmt", mem_len=8, num_mem_tokens=2),
}


def _inputs(B, Q, K, H, E, P, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = functools.partial(torch.randn, generator=gen)
    return rand(B, Q, H, E), rand(B, K, H, E), rand(B, K, H, E), rand(P, H, E), rand(H, E), rand(H, E)


@pytest.mark.parametrize("same_length", [False, True])
def test_attend_causal_with_memory_validity(same_length):
    B, N, M, H, E = 3, 8, 8, 2, 16
    q, k, v, r_k, u, bias_v = _inputs(B, N, M + N, H, E, M + N)
    valid = torch.tensor([[True] * M, [False] * M, [False] * 3 + [True] * (M - 3)])
    allowed = causal_allowed(N, M, valid, same_length)
    index = causal_index(N, M, "cpu")
    want, want_lse = attend(q, k, v, r_k, index, allowed, u, bias_v, nn.Identity())
    got, got_lse = flex_attend(q, k, v, r_k, index, flex_mask(allowed, B), u, bias_v)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-5)


def test_attend_rmt_blocks_signed_distances():
    B, R, N, M, H, E = 2, 2, 6, 4, 2, 8
    distances, index = rmt_positions(R, N, M, "cpu")
    Q, K = 2 * R + N, M + 2 * R + N
    q, k, v, r_k, u, bias_v = _inputs(B, Q, K, H, E, len(distances), seed=1)
    allowed = rmt_allowed(R, N, torch.tensor([[True] * M, [False] * M]), False, False)
    want, _ = attend(q, k, v, r_k, index, allowed, u, bias_v, nn.Identity(), need_lognorm=False)
    got, lse = flex_attend(q, k, v, r_k, index, flex_mask(allowed, B), u, bias_v, need_lognorm=False)
    assert lse is None
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_mask_shared_by_the_lanes_covers_every_lane():
    B, N, H, E = 4, 6, 2, 8
    q, k, v, r_k, u, bias_v = _inputs(B, N, N, H, E, N, seed=2)
    allowed = causal_allowed(N, 0, torch.zeros(1, 0, dtype=torch.bool), False)  # [1, N, N]
    index = causal_index(N, 0, "cpu")
    want, want_lse = attend(q, k, v, r_k, index, allowed, u, bias_v, nn.Identity())
    got, got_lse = flex_attend(q, k, v, r_k, index, flex_mask(allowed, B), u, bias_v)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-5)


def test_the_kernel_gets_queries_in_the_keys_dtype(monkeypatch):
    """bf16 q, k, v with fp32 biases under autocast: q + u is fp32, and the kernel must still get bf16 queries, as
    the einsum path's autocast content matmul does (fp32 queries overflowed the kernel's shared memory on an H100)."""
    import torch.nn.attention.flex_attention as flex_module

    seen = []
    kernel = flex_module.flex_attention
    monkeypatch.setattr(flex_module, "flex_attention",
                        lambda q, k, v, **kw: seen.append(q.dtype) or kernel(q, k, v, **kw))
    B, N, H, E = 2, 4, 2, 16
    q, k, v, r_k, u, bias_v = _inputs(B, N, N, H, E, N, seed=4)
    allowed = causal_allowed(N, 0, torch.zeros(1, 0, dtype=torch.bool), False)
    bf16 = torch.bfloat16
    with torch.autocast("cpu", dtype=bf16):
        flex_attend(q.to(bf16), k.to(bf16), v.to(bf16), r_k.to(bf16), causal_index(N, 0, "cpu"),
                    flex_mask(allowed, B), u, bias_v)
    assert seen == [bf16]


def _run_segments(model, tokens, resets):
    """Three segments of every lane, memory carried; the NLL of each and the final memory's tensors."""
    memory = model.init_memory(tokens.shape[0], device=tokens.device)
    N = model.cfg.tgt_len
    nlls = []
    for s in range(3):
        out = model(tokens[:, s * N:(s + 1) * N], memory, reset=resets[s],
                    targets=tokens[:, s * N + 1:(s + 1) * N + 1])
        nlls.append(out.nll)
        memory = out.memory
    return torch.stack(nlls), memory


def _memory_tensors(memory):
    import dataclasses

    if isinstance(memory, torch.Tensor):
        return [memory]
    if isinstance(memory, (list, tuple)):
        return [t for m in memory for t in _memory_tensors(m)]
    if dataclasses.is_dataclass(memory):
        return [t for f in dataclasses.fields(memory) for t in _memory_tensors(getattr(memory, f.name))]
    return []


@pytest.mark.parametrize("variant", sorted(ARCHS))
def test_every_arch_flex_equals_eager_over_segments(variant):
    """Same weights, eval mode: every segment's NLL and the memory carried out of the last one agree. Weights drawn
    large (init_std 0.5) so that scores are far from uniform and a wrong position term shows."""
    cfg = tiny_model_config(**ARCHS[variant], init_std=0.5)
    torch.manual_seed(0)
    eager = build_model(cfg).eval()
    flex = build_model(tiny_model_config(**ARCHS[variant], init_std=0.5, attention="flex")).eval()
    flex.load_state_dict(eager.state_dict())
    B, N = 3, cfg.tgt_len
    tokens = torch.randint(0, cfg.vocab_size, (B, 3 * N + 1), generator=torch.Generator().manual_seed(3))
    resets = [torch.ones(B, dtype=torch.bool), torch.tensor([False, True, False]), torch.zeros(B, dtype=torch.bool)]
    with torch.no_grad():
        want_nll, want_mem = _run_segments(eager, tokens, resets)
        got_nll, got_mem = _run_segments(flex, tokens, resets)
    # fp32 rounding of two summation orders: NLLs (~5 nats) to 1e-5 relative; the memory to 1e-4 absolute (LaMemo's
    # interpolated contexts pass through the layers of the unstable "xl" encoding; a 1% error in the position term
    # fails every case here).
    torch.testing.assert_close(got_nll, want_nll, rtol=1e-5, atol=1e-5)
    for got, want in zip(_memory_tensors(got_mem), _memory_tensors(want_mem), strict=True):
        if got.is_floating_point():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        else:
            assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["txl", "lamemo", "rmt_with_cache"])
def test_the_flex_path_compiles_into_one_graph(variant):
    """torch.compile of the whole model traces every layer's FlexAttention into one graph: no graph break (a warnings
    context around the kernel once broke the graph at every layer on the H100, 6 breaks per step). Traced for
    evaluation, as the CPU has no FlexAttention backward."""
    import torch._dynamo

    cfg = tiny_model_config(**ARCHS[variant], attention="flex")
    model = build_model(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.tgt_len + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        found = torch._dynamo.explain(model)(tokens[:, :-1], model.init_memory(2, device="cpu"), targets=tokens[:, 1:])
    assert (found.graph_count, found.graph_break_count) == (1, 0), [r.reason for r in found.break_reasons]


def test_auto_is_eager_on_the_cpu_and_flex_is_taken_when_asked():
    """auto builds no FlexAttention mask on the CPU (so the einsum path runs); flex does."""
    layout = causal_layout(3, 2, torch.ones(2, 2, dtype=torch.bool), False)
    assert build_model(tiny_model_config()).kernel_mask(layout) is None
    assert build_model(tiny_model_config(attention="eager")).kernel_mask(layout) is None
    assert build_model(tiny_model_config(attention="flex")).kernel_mask(layout) is not None


def test_an_unknown_kernel_is_named():
    with pytest.raises(ConfigError, match="model.attention: unknown kernel 'fused'; valid: auto, eager, flex"):
        tiny_model_config(attention="fused").validate()


# --- on a GPU: loss and gradients, fp32 and bf16 --------------------------------------------------------------

GRAD_TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}  # relative to each gradient's largest entry


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", sorted(ARCHS))
def test_gpu_flex_loss_and_gradients_equal_eager(variant, dtype):
    # The variant's own settings win where it names them (mem_len 0 for the memoryless ones).
    cfg = tiny_model_config(**{**dict(n_head=4, d_head=32, d_model=128, d_inner=256, tgt_len=16, mem_len=16),
                               **ARCHS[variant]})
    torch.manual_seed(0)
    eager = build_model(cfg).cuda().train()
    flex = build_model(tiny_model_config(**{**cfg.__dict__, "attention": "flex"})).cuda().train()
    flex.load_state_dict(eager.state_dict())
    B, N = 4, cfg.tgt_len
    tokens = torch.randint(0, cfg.vocab_size, (B, 3 * N + 1), device="cuda")
    resets = [torch.ones(B, dtype=torch.bool, device="cuda")] + [torch.zeros(B, dtype=torch.bool, device="cuda")] * 2
    losses, grads = {}, {}
    for name, model in (("eager", eager), ("flex", flex)):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            nll, _ = _run_segments(model, tokens, resets)
        loss = nll.float().mean()
        loss.backward()
        losses[name] = loss.item()
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    assert losses["flex"] == pytest.approx(losses["eager"], rel=GRAD_TOLERANCE[dtype] / 10)
    assert grads["flex"].keys() == grads["eager"].keys()
    for n, want in grads["eager"].items():
        scale = want.abs().max().clamp(min=1e-12)
        assert ((grads["flex"][n] - want).abs().max() / scale) <= GRAD_TOLERANCE[dtype], n
