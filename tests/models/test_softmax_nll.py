"""The plain softmax head's fp32 training NLL with its gradient formed in forward (models/softmax_nll.py) against
F.linear + log_softmax + gather: the same NLL bit for bit, the same gradients; tiles that do not divide the rows;
backward run twice on one graph; and the head taking that path only where it fits (fp32, one softmax, targets)."""

import pytest
import torch
import torch.nn.functional as F

from memlm.models import softmax_nll
from memlm.models.adaptive import AdaptiveLogSoftmax
from memlm.models.softmax_nll import LinearSoftmaxNLL, linear_softmax_nll


def _inputs(T=37, W=12, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, W, generator=g).requires_grad_()
    weight = (torch.randn(V, W, generator=g) * 0.7).requires_grad_()
    bias = torch.randn(V, generator=g).requires_grad_()
    target = torch.randint(0, V, (T,), generator=g)
    scale = torch.rand(T, generator=g) + 0.5  # a different upstream gradient per row
    return x, weight, bias, target, scale


def _grads(fn, x, weight, bias, target, scale):
    for t in (x, weight, bias):
        t.grad = None
    nll = fn(x, weight, bias, target)
    (nll * scale).sum().backward()
    return nll.detach(), x.grad.clone(), weight.grad.clone(), bias.grad.clone()


def _reference(x, weight, bias, target):
    return -F.log_softmax(F.linear(x, weight, bias), dim=-1).gather(1, target[:, None]).squeeze(1)


@pytest.mark.parametrize("tile_bytes", [4 * 50 * 5, 4 * 50 * 37, 1])  # 5 rows (37 = 7 x 5 + 2), all rows, one row
def test_nll_is_log_softmax_gather_bit_for_bit_and_gradients_equal(tile_bytes, monkeypatch):
    monkeypatch.setattr(softmax_nll, "TILE_BYTES", tile_bytes)
    inputs = _inputs()
    want = _grads(_reference, *inputs)
    got = _grads(linear_softmax_nll, *inputs)
    assert torch.equal(got[0], want[0])
    for name, a, b in zip(("x", "weight", "bias"), got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_backward_twice_on_one_graph():
    """retain_graph: the saved softmax - onehot is read, never written, by backward."""
    x, weight, bias, target, scale = _inputs(seed=1)
    loss = (linear_softmax_nll(x, weight, bias, target) * scale).sum()
    first = torch.autograd.grad(loss, (x, weight, bias), retain_graph=True)
    second = torch.autograd.grad(loss, (x, weight, bias))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_inputs_without_gradient():
    x, weight, bias, target, _ = _inputs(seed=2)
    gx, = torch.autograd.grad(linear_softmax_nll(x, weight.detach(), bias.detach(), target).sum(), x)
    want, = torch.autograd.grad(_reference(x, weight.detach(), bias.detach(), target).sum(), x)
    torch.testing.assert_close(gx, want, rtol=1e-5, atol=1e-6)


def test_head_takes_the_path_only_where_it_fits(monkeypatch):
    """fp32 without tail clusters and with targets: the fused path, and the NLL of the log-probability path with an
    ignored target's 0; with tail clusters, under bf16 autocast, in float64 or asked for log-probabilities: not."""
    calls = []
    real = LinearSoftmaxNLL.apply
    monkeypatch.setattr(LinearSoftmaxNLL, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    head = AdaptiveLogSoftmax(40, 8, 8, [], 1, init_std=0.5)
    hidden = torch.randn(2, 5, 8)
    targets = torch.randint(0, 40, (2, 5))
    targets[1, 2] = -100
    nll, _ = head(hidden, targets, want_logprobs=False)
    assert calls == [1]
    _, logprobs = head(hidden, None, want_logprobs=True)
    want = -logprobs.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    want[1, 2] = 0.0
    assert torch.equal(nll, want)
    calls.clear()
    head(hidden, targets, want_logprobs=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        head(hidden, targets, want_logprobs=False)
    head.double()(hidden.double(), targets, want_logprobs=False)
    tails = AdaptiveLogSoftmax(40, 8, 8, [10, 20], 1, init_std=0.5)
    tails(hidden, targets, want_logprobs=False)
    assert calls == []
