"""attend's position term read by strides (`pos_offset`, models/attention.py `skewed_positions`) against the gather
through pos_index it replaces: the same context and the same gradients for every layout that passes an offset
(Transformer-XL's causal one with and without memory, with same_length and a partly empty memory; RMT's with and
without its cache and with the cache read by the memory rows), in float64. Also: masked pairs, which read a
neighbouring row's score, get no gradient, and a layout it does not fit falls back to the gather."""

import pytest
import torch
from torch import nn

from memlm.models.attention import SkewedPositionAdd, attend, causal_index, skewed_positions
from memlm.models.mask_layout import causal_layout
from memlm.models.rmt import rmt_layout, rmt_positions

H, E = 2, 4


def _txl(N, M, same_length, valid_from):
    valid = torch.arange(M)[None, :].expand(3, M) >= torch.tensor(valid_from)[:, None]  # [B, M]
    layout = causal_layout(N, M, valid, same_length)
    return layout, causal_index(N, M, torch.device("cpu")), M + N


def _rmt(R, N, M, read_cache, write_cache):
    valid = torch.ones(3, M, dtype=torch.bool)
    if M:
        valid[1, : M // 2] = False
    layout = rmt_layout(R, N, valid, read_mem_from_cache=read_cache, write_mem_from_cache=write_cache)
    distances, index = rmt_positions(R, N, M, torch.device("cpu"))
    return layout, index, distances.shape[0]


CASES = {
    "txl-M0": lambda: _txl(5, 0, False, [0, 0, 0]),
    "txl-M<N": lambda: _txl(5, 3, False, [0, 1, 3]),
    "txl-M=N": lambda: _txl(5, 5, False, [0, 2, 5]),
    "txl-M>N": lambda: _txl(4, 9, False, [0, 4, 9]),
    "txl-same-length": lambda: _txl(5, 5, True, [0, 2, 5]),
    "rmt-R1-M0": lambda: _rmt(1, 5, 0, False, False),
    "rmt-R3-M0": lambda: _rmt(3, 5, 0, False, False),
    "rmt-R3-M6": lambda: _rmt(3, 5, 6, False, False),
    "rmt-R2-M4-read-cache": lambda: _rmt(2, 5, 4, True, False),
    "rmt-R2-M4-write-cache": lambda: _rmt(2, 5, 4, False, True),
}


def _run(layout, index, P, offset):
    g = torch.Generator().manual_seed(0)
    B, Q, K = 3, layout.structure.shape[0], layout.structure.shape[1]
    leaves = [torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()
              for shape in ((B, Q, H, E), (B, K, H, E), (B, K, H, E), (P, H, E), (H, E), (H, E))]
    q, k, v, r_k, u, w = leaves
    context, _ = attend(q, k, v, r_k, index, layout.allowed, u, w, nn.Identity(), need_lognorm=False,
                        pos_offset=offset)
    weights = torch.randn(context.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((context * weights).sum(), leaves)
    return context, grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_strided_position_term_equals_the_gather(case, monkeypatch):
    layout, index, P = CASES[case]()
    assert layout.sign == 1
    gathered, gathered_grads = _run(layout, index, P, None)
    calls = []
    real = SkewedPositionAdd.apply
    monkeypatch.setattr(SkewedPositionAdd, "apply", lambda *a: calls.append(1) or real(*a))
    skewed, skewed_grads = _run(layout, index, P, layout.offset)
    assert calls == [1]
    torch.testing.assert_close(skewed, gathered, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("q", "k", "v", "r_k", "bias_u", "bias_v"), skewed_grads, gathered_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_masked_pairs_get_no_gradient():
    """Transformer-XL's K = P: a row's future keys read the next row's first slots; the gradient of each slot is
    exactly the sum over the allowed pairs that use it."""
    layout, index, P = CASES["txl-M=N"]()
    B, Q, K = 3, layout.structure.shape[0], layout.structure.shape[1]
    q_pos = torch.randn(B, Q, H, E, dtype=torch.float64, requires_grad=True)
    r_k = torch.randn(P, H, E, dtype=torch.float64, requires_grad=True)
    content = torch.zeros(B, H, Q, K, dtype=torch.float64, requires_grad=True)
    scores = skewed_positions(content, q_pos, r_k, layout.offset)
    grad = torch.randn(B, H, Q, K, dtype=torch.float64) * layout.allowed[:, None]  # the softmax's: 0 where masked
    g_q, g_r = torch.autograd.grad(scores, (q_pos, r_k), grad)
    position = torch.einsum("bqhe,phe->bhqp", q_pos, r_k).gather(-1, index.expand(B, H, Q, K))
    want = torch.autograd.grad(position, (q_pos, r_k), grad)
    torch.testing.assert_close(g_q, want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_r, want[1], rtol=1e-12, atol=1e-12)
    allowed = layout.allowed[:, None].expand(B, H, Q, K)
    assert torch.equal(scores.detach()[allowed], position.detach()[allowed])


def test_falls_back_where_it_does_not_fit():
    q_pos, r_k = torch.randn(1, 4, H, E), torch.randn(6, H, E)
    content = torch.zeros(1, H, 4, 6)
    assert skewed_positions(content, q_pos, r_k, None) is None
    assert skewed_positions(content, q_pos, r_k, 6) is None  # c = P - 1 - offset < 0
    assert skewed_positions(content, q_pos, r_k, 1) is None  # K > Q + offset: a read past the rows
    assert skewed_positions(content, q_pos, r_k, 2) is not None
