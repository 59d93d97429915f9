"""trainer/loop/fused_clip.py: the clip folded into a fused AdamW step computes what clip_grad_norm_ then the step
do, and skips the update on the device when the norm is not finite."""

import pytest
import torch

from memlm.trainer.loop.fused_clip import fused_clipped_step


def _params(seed: int, scale: float) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((7, 5), (11,), (3, 4, 2))
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float32)) for shape in shapes]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=gen, dtype=torch.float32)
    return params


@pytest.mark.parametrize("scale", [10.0, 1e-3])  # clipped, and below max_norm (divisor 1)
def test_equals_clip_then_step(scale):
    reference, folded = _params(0, scale), _params(0, scale)
    opts = [torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, fused=True) for ps in (reference, folded)]
    for step in range(3):
        for a, b, i in zip(reference, folded, range(3)):
            gen = torch.Generator().manual_seed(100 * step + i)
            g = scale * torch.randn(a.shape, generator=gen, dtype=torch.float32)
            a.grad, b.grad = g.clone(), g.clone()
        want = torch.nn.utils.clip_grad_norm_(reference, 0.25)
        opts[0].step()
        got = fused_clipped_step(opts[1], folded, 0.25)
        torch.testing.assert_close(got, want.to(got.dtype))
        for a, b in zip(reference, folded):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert not hasattr(opts[1], "grad_scale") and not hasattr(opts[1], "found_inf")


def test_a_non_finite_norm_skips_the_update_on_the_device():
    params = _params(1, 1.0)
    opt = torch.optim.AdamW(params, lr=0.05, fused=True)
    fused_clipped_step(opt, params, 0.25)
    before = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]
    params[1].grad[3] = float("inf")
    norm = fused_clipped_step(opt, params, 0.25)
    assert not torch.isfinite(norm)
    for p, b, s in zip(params, before, steps):
        assert torch.equal(p.detach(), b)
        assert torch.equal(opt.state[p]["step"], s)  # the skipped step is not counted


def test_refuses_an_unfused_optimizer():
    params = _params(2, 1.0)
    with pytest.raises(ValueError, match="fused optimizer"):
        fused_clipped_step(torch.optim.AdamW(params, lr=0.1), params, 0.25)
