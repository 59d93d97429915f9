"""∞-former against the slow absolute-position reference (tests/support/reference.py), with lanes whose documents
start at different segments; the closed-form expectation of the basis against quadrature; the sticky samples;
where gradients go; config errors."""

import copy
import functools
import math

import pytest
import torch

from memlm.models import ConfigError, build_model
from memlm.models.infinite_former import LongTermAttention, sticky_samples
from support.models import perturbed, tiny_model_config
from support.reference import infinite_former_reference, lane_doc_starts

tiny = functools.partial(tiny_model_config, arch="infinite_former")
# Lane 0: one document; lane 1: a new document at segment 2; lane 2: new documents at segments 1 and 4.
RESETS = [None, torch.tensor([False, False, True]), torch.tensor([False, True, False]), None,
          torch.tensor([False, False, True])]


def run_segments(model, tokens, targets, n_segments):
    N, B = model.cfg.tgt_len, tokens.shape[0]
    memory, nll = model.init_memory(B), []
    with torch.no_grad():
        for k in range(n_segments):
            seg = slice(k * N, (k + 1) * N)
            out = model(tokens[:, seg], memory, reset=RESETS[k], targets=targets[:, seg])
            memory = out.memory
            nll.append(out.nll)
    return torch.cat(nll, dim=1), memory


@pytest.mark.parametrize("settings", [
    dict(mem_len=8, ltm_basis=6, ltm_samples=5),  # M = N: the evicted rows are the memory's
    dict(mem_len=3, ltm_basis=8, ltm_samples=7, ltm_widths=[0.1, 0.3], ltm_tau=0.5, ltm_ridge=0.3, pre_lnorm=True,
         ltm_sticky=True, ltm_sticky_bins=5),  # M < N, sticky memories, wider basis
    dict(mem_len=12, ltm_basis=9, ltm_widths=[0.05, 0.1, 0.2], ltm_samples=4, clamp_len=6, ltm_sticky=True),  # M > N
    dict(mem_len=0, ltm_basis=4, ltm_samples=6, ltm_widths=[0.2]),  # no short-term memory: the segment is evicted
])
def test_infinite_former_matches_the_reference(settings):
    torch.manual_seed(7)
    model = perturbed(build_model(tiny(init_std=0.3, **settings))).eval()
    N, S, B = model.cfg.tgt_len, len(RESETS), 3
    tokens = torch.randint(0, 50, (B, N * S))
    targets = torch.randint(0, 50, (B, N * S))
    targets[1, 5] = -100
    nll, memory = run_segments(model, tokens, targets, S)
    for b in range(B):
        want = infinite_former_reference(model, tokens[b].tolist(), targets[b].tolist(), N,
                                         lane_doc_starts(RESETS, b, N))
        torch.testing.assert_close(nll[b], torch.tensor([x for seg in want for x in seg], dtype=torch.float32),
                                   rtol=1e-4, atol=1e-4, msg=lambda m: f"lane {b}: {m}")
    # The comparison sees a long-term memory that matters: without its output the NLL moves.
    silent = copy.deepcopy(model)
    for lt in silent.long_term:
        torch.nn.init.zeros_(lt.out.weight)
    assert (run_segments(silent, tokens, targets, S)[0] - nll).abs().max() > 1e-3
    assert all(c.abs().amax() > 0 for c in memory.coefficients)


def test_the_expected_basis_is_the_integral_of_density_times_basis():
    """E_{N(mu, sigma^2)}[psi_j] in closed form against a Riemann sum over t (values all ones, one head: the
    context is then the sum over j of the expectations, read through an identity output)."""
    cfg = tiny(ltm_basis=6, ltm_widths=[0.05, 0.2], d_model=4, n_head=1, d_head=4)
    attention = LongTermAttention(cfg).double()
    with torch.no_grad():
        attention.value.weight.zero_()
        attention.value.weight[:, 0] = 1.0
        attention.out.weight.copy_(torch.eye(4))
    coefficients = torch.zeros(1, 6, 4, dtype=torch.float64)
    coefficients[..., 0] = 1.0  # every basis function's value row is all ones
    q = torch.randn(1, 5, 1, 4, dtype=torch.float64)
    out, mu, sigma_sq = attention(q, coefficients)
    t = torch.linspace(-3, 4, 200001, dtype=torch.float64)
    centres = torch.linspace(0, 1, 3, dtype=torch.float64).repeat_interleave(2)
    widths = torch.tensor([0.05, 0.2], dtype=torch.float64).repeat(3)
    pdf = lambda x, m, var: torch.exp(-(x - m) ** 2 / (2 * var)) / torch.sqrt(2 * math.pi * var)  # noqa: E731
    for k in range(5):
        density = pdf(t, mu[0, 0, k], sigma_sq[0, 0, k])
        integral = sum(torch.trapezoid(density * pdf(t, c, w * w), t) for c, w in zip(centres, widths))
        torch.testing.assert_close(out[0, k], integral.expand(4), rtol=1e-6, atol=1e-8)


def test_sticky_samples_are_quantiles_of_the_attention_histogram():
    # A density spread evenly over [0, 1] (very wide) gives evenly spaced samples, the middles of S strata.
    wide = sticky_samples(torch.full((1, 1, 1), 0.5), torch.full((1, 1, 1), 1e6), 4, 8)
    torch.testing.assert_close(wide, torch.tensor([[0.125, 0.375, 0.625, 0.875]], dtype=torch.float64), atol=1e-6,
                               rtol=0)
    # Two narrow densities at 0.2 and 0.8 (one of them twice): quantiles 0.05 .. 0.65 fall around 0.2 (mass 2/3),
    # 0.75 .. 0.95 around 0.8.
    mu = torch.tensor([[[0.2, 0.2, 0.8]]])
    at = sticky_samples(mu, torch.full_like(mu, 1e-4), 10, 50)
    assert ((at - 0.2).abs() < 0.04).sum() == 7 and ((at - 0.8).abs() < 0.04).sum() == 3, at


def test_the_long_term_memory_learns_through_its_attention_and_never_into_the_signal():
    torch.manual_seed(3)
    model = build_model(tiny(ltm_basis=6, ltm_samples=5, ltm_sticky=True)).train()
    N, B = model.cfg.tgt_len, 2
    memory = model.init_memory(B)
    for _ in range(3):  # the first segment evicts empty slots: the third reads a non-empty signal
        out = model(torch.randint(0, 50, (B, N)), memory, targets=torch.randint(0, 50, (B, N)))
        memory = out.memory.detached()
    assert not any(c.requires_grad for c in out.memory.coefficients)
    out.nll.mean().backward()
    for lt in model.long_term:
        for name in ("key", "value", "out", "mu", "sigma"):
            assert getattr(lt, name).weight.grad.abs().sum() > 0, name


def test_an_empty_long_term_memory_reads_exactly_nothing():
    """A lane at a document start: the layer's long-term output is 0, whatever the other lanes hold."""
    torch.manual_seed(2)
    model = build_model(tiny(ltm_basis=6, ltm_samples=5, init_std=0.3)).eval()
    q = torch.randn(2, 8, model.cfg.n_head, model.cfg.d_head)
    coefficients = torch.randn(2, 6, model.cfg.d_model)
    coefficients[1] = 0
    out = model.long_term[0](q, coefficients)[0]
    assert out[0].abs().amax() > 0 and out[1].abs().amax() == 0


@pytest.mark.parametrize("settings,message", [
    (dict(ltm_basis=0), "model.ltm_basis must be >= 1 and a multiple of len(model.ltm_widths)=2"),
    (dict(ltm_basis=5), "model.ltm_basis must be >= 1 and a multiple of len(model.ltm_widths)=2"),
    (dict(ltm_basis=4, ltm_widths=[]), "model.ltm_widths must be a non-empty list of positive widths"),
    (dict(ltm_basis=4, ltm_tau=1.0), "model.ltm_tau must be in (0, 1)"),
    (dict(ltm_basis=4, ltm_ridge=0.0), "model.ltm_ridge must be > 0"),
    (dict(ltm_basis=4, ltm_samples=0), "model.ltm_samples must be >= 1"),
    (dict(ltm_basis=4, ltm_sticky_bins=0), "model.ltm_sticky_bins must be >= 1"),
])
def test_config_errors_name_the_key(settings, message):
    with pytest.raises(ConfigError, match=f"^{message}".replace("(", r"\(").replace(")", r"\)")):
        build_model(tiny(**settings))


def test_other_archs_refuse_its_keys():
    with pytest.raises(ConfigError, match="model.ltm_sticky only applies to arch 'infinite_former'"):
        build_model(tiny_model_config(arch="txl", ltm_sticky=True))
