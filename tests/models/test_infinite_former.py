"""∞-former against a slow reference written here from the authors' code, with lanes whose documents start at
different segments, float64, every gradient; the closed-form expectation of the basis against quadrature; the
sticky samples; where gradients go; config errors."""

import copy
import functools
import math

import pytest
import torch

from memlm.models import ConfigError, build_model
from memlm.models.infinite_former import LongTermAttention, sticky_samples
from support.models import perturbed, tiny_model_config
from support.reference import Weights, clamped, doc_start_of, lane_doc_starts, softmax_over

tiny = functools.partial(tiny_model_config, arch="infinite_former")
# Lane 0: one document; lane 1: a new document at segment 2; lane 2: new documents at segments 1 and 4.
RESETS = [None, torch.tensor([False, False, True]), torch.tensor([False, True, False]), None,
          torch.tensor([False, False, True]), None]


# ---------------------------------------------------------------------------------------------------------------
# The reference. One lane over absolute positions (tests/support/reference.py's conventions); the long-term
# memory as the ∞-former authors' code defines it (deep-spin/infinite-former, sorting/long_term_attention.py,
# LongTermAttention: compute_G, the positions built in __init__, update_inf, forward). Their stream has no
# document starts: a start here empties the signal, as their new_doc does (B_past = None).


def gaussian_basis(cfg) -> list[tuple[float, float]]:
    """(centre, width) of every basis function: meshgrid(linspace(0, 1, J / n_widths), widths), flattened."""
    n_centres = cfg.ltm_basis // len(cfg.ltm_widths)
    centres = [c / (n_centres - 1) if n_centres > 1 else 0.0 for c in range(n_centres)]
    return [(c, w) for c in centres for w in cfg.ltm_widths]


def psi(basis, t: float) -> torch.Tensor:
    """[J] the basis at t: N(t; centre, width^2)."""
    return torch.tensor([math.exp(-0.5 * ((t - c) / w) ** 2) / (w * math.sqrt(2 * math.pi)) for c, w in basis],
                        dtype=torch.float64)


def authors_G(basis, ridge: float, positions: list[float], n_pad_before: int, n_real: int) -> torch.Tensor:
    """compute_G: F [J, points] the basis at every position (padding included), G = F^T (F F^T + ridge I)^-1
    [points, J], its padding rows cut: [n_real, J]. The coefficients are then B = X^T G for the real points'
    values X [n_real, D] (value_function), i.e. C = G^T X [J, D]."""
    F_ = torch.stack([psi(basis, t) for t in positions], dim=1)
    G = F_.T @ torch.linalg.inv(F_ @ F_.T + ridge * torch.eye(len(basis), dtype=torch.float64))
    return G[n_pad_before : n_pad_before + n_real]


def first_fit_G(basis, ridge: float, n: int) -> torch.Tensor:
    """Gs[n], the fit of n rows with no past signal (value_function with inf=False): positions
    linspace(-1/2 + shift, 3/2 - shift) over 2n points with shift 1/(2n) (n even) or 2n - 1 points with shift
    1/n (n odd); the middle n are the rows', floor(n / 2) padding points on each side (their trim)."""
    if n % 2:
        grid = torch.linspace(-0.5 + 1 / n, 1.5 - 1 / n, 2 * n - 1, dtype=torch.float64)
    else:
        grid = torch.linspace(-0.5 + 1 / (2 * n), 1.5 - 1 / (2 * n), 2 * n, dtype=torch.float64)
    return authors_G(basis, ridge, grid.tolist(), n // 2, n)


def update_G(basis, ridge: float, N: int, S: int, tau: float) -> torch.Tensor:
    """G_inf, the fit with a past signal: S old samples at tau i / S, the N new rows at tau + (1 - tau) i / N,
    padding the points of linspace(-1/2 + shift, 3/2 - shift, 2 (N + S)) below 0 and above 1 with
    shift = 1 / (2 N + S) (their formula; their odd-N branch never defines the grid and fails, so every N takes
    this one)."""
    old = [tau * i / S for i in range(1, S + 1)]
    new = [tau + (1 - tau) * i / N for i in range(1, N + 1)]
    shift = 1 / (2 * N + S)
    grid = torch.linspace(-0.5 + shift, 1.5 - shift, 2 * (N + S), dtype=torch.float64).tolist()
    below, above = [t for t in grid if t < 0], [t for t in grid if t > 1]
    assert len(below) == len(above) == (N + S) // 2  # what their trim of G_inf assumes
    return authors_G(basis, ridge, below + old + new + above, len(below), S + N)


def sticky_points(densities, S: int, G: int) -> list[float]:
    """memlm's sticky samples (models/infinite_former.py: the authors draw them at random): the (i - 1/2) / S
    quantiles of the histogram of the segment's attention densities' mass over G bins of [0, 1]."""
    cdf = lambda x, m, var: 0.5 * (1 + math.erf((x - m) / math.sqrt(2 * var)))  # noqa: E731
    mass = [sum(cdf((g + 1) / G, mu, var) - cdf(g / G, mu, var) for mu, var in densities) for g in range(G)]
    total = sum(mass)
    cumulative = [sum(mass[: g + 1]) / total for g in range(G)]
    at = []
    for k in range(1, S + 1):
        quantile = (k - 0.5) / S
        g = next((g for g in range(G) if cumulative[g] >= quantile), G - 1)
        below = cumulative[g] - mass[g] / total
        at.append((g + min(max((quantile - below) / (mass[g] / total), 0.0), 1.0)) / G)
    return at


def infinite_former_reference(model, tokens: list[int], targets: list[int], seg_len: int, doc_starts):
    """Per segment of one lane, the per-token losses (float64 tensors in the graph of the model's parameters),
    and each layer's last coefficients (None: empty).

    Every layer attends over the short-term memory (Transformer-XL: positions [s - M, s) and the causal past, of
    the current document; cached positions are stop-gradient) and adds its long-term read: per head, the scores
    of the query against the keys of the J coefficients (divided by sqrt(E)), mu = sigmoid(w_mu . scores),
    sigma^2 = softplus(w_sigma . scores) clamped at 1e-6, and the values weighted by the integral of
    N(t; mu, sigma^2) psi_j(t) (their ContinuousSoftmax: N(mu; c_j, sigma^2 + w_j^2)), through the output
    projection. An empty signal reads nothing (their layer skips the read while nothing has left the memory).

    The rows leaving the short-term memory each segment (positions [s - M, s - M + N); those of the current
    document) update the signal (their update_inf, with the rows that left at the previous segment, before the
    read: the same order). With no past signal the rows are fit alone (Gs[n] for the n rows); with one, the old
    signal sampled at i / S (or the sticky points), contracted to [0, tau], and the N new rows on (tau, 1]
    (G_inf). Their klen was always N (their mem_len a multiple of their segment); the first real block after a
    document start holds fewer rows when M is not a multiple of N, and is fit alone the same way."""
    W, cfg = Weights(model, grad=True), model.cfg
    N, M, L, J, S = seg_len, cfg.mem_len, cfg.n_layer, cfg.ltm_basis, cfg.ltm_samples
    basis = gaussian_basis(cfg)
    G_inf = update_G(basis, cfg.ltm_ridge, N, S, cfg.ltm_tau)
    samples = [psi(basis, i / S) for i in range(1, S + 1)]  # their self.samples: the basis at t / tau = i / S
    layer_in: list[dict[int, torch.Tensor]] = [{} for _ in range(L)]
    signal: list[torch.Tensor | None] = [None] * L
    losses = []
    for s in range(0, len(tokens), N):
        cur = range(s, s + N)
        doc = doc_start_of(s, doc_starts)
        if s == doc:
            signal = [None] * L
        h = {i: W.embed(tokens[i]) for i in cur}
        for l in range(L):
            lt = model.long_term[l]
            w_k, w_v, w_o = W.p(lt.key.weight), W.p(lt.value.weight), W.p(lt.out.weight)
            w_mu, w_sigma = W.p(lt.mu.weight)[0], W.p(lt.sigma.weight)[0]
            for i in cur:
                layer_in[l][i] = h[i]
            u, v = W.bias("bias_u", l), W.bias("bias_v", l)
            new_h, densities = {}, []
            for i in cur:
                q = W.qkv(l, h[i])[0]
                scores, vals = [], []
                for j in range(max(doc, s - M), i + 1):
                    _, k, val = W.qkv(l, layer_in[l][j])
                    scores.append(W.score(l, q, k, u, v, clamped(i - j, cfg.clamp_len)))
                    vals.append(val)
                ctx, _ = softmax_over(scores, vals)
                read = None
                if signal[l] is not None:
                    keys = (signal[l] @ w_k.T).view(J, W.H, W.E)
                    values = (signal[l] @ w_v.T).view(J, W.H, W.E)
                    heads = []
                    for hd in range(W.H):
                        z = keys[:, hd] @ q[hd] / math.sqrt(W.E)  # [J]
                        mu = torch.sigmoid(w_mu @ z)
                        sigma_sq = torch.clamp(torch.nn.functional.softplus(w_sigma @ z), min=1e-6)
                        densities.append((float(mu), float(sigma_sq)))
                        weight = torch.stack([torch.exp(-0.5 * (mu - c) ** 2 / (sigma_sq + w * w))
                                              / torch.sqrt(2 * math.pi * (sigma_sq + w * w)) for c, w in basis])
                        heads.append(weight @ values[:, hd])
                    read = w_o @ torch.cat(heads)
                new_h[i] = W.finish(l, h[i], ctx, extra=read)
            # the update (no gradient: the coefficients are stop-gradient)
            leaving = [p for p in range(s - M, s - M + N) if p >= doc and p >= 0]
            rows = [layer_in[l][p].detach() for p in leaving]
            if signal[l] is None:
                if rows:
                    assert leaving == list(range(s - M + N - len(rows), s - M + N))  # the block's newest rows
                    signal[l] = first_fit_G(basis, cfg.ltm_ridge, len(rows)).T @ torch.stack(rows)
            else:
                assert len(rows) == N
                at = sticky_points(densities, S, cfg.ltm_sticky_bins) if cfg.ltm_sticky \
                    else [i / S for i in range(1, S + 1)]
                sampled = [psi(basis, a) if cfg.ltm_sticky else samples[k] for k, a in enumerate(at)]
                old = [b @ signal[l] for b in sampled]
                signal[l] = G_inf.T @ torch.stack(old + rows)
            h = new_h
        for l in range(L):  # what later segments read of this one is stop-gradient
            layer_in[l] = {i: x.detach() for i, x in layer_in[l].items()}
        losses.append([W.loss(h[i], targets[i]) for i in cur])
    return losses, signal


def run_segments(model, tokens, targets, n_segments):
    N, B = model.cfg.tgt_len, tokens.shape[0]
    memory, nll = model.init_memory(B, dtype=next(model.parameters()).dtype), []
    for k in range(n_segments):
        seg = slice(k * N, (k + 1) * N)
        out = model(tokens[:, seg], memory, reset=RESETS[k], targets=targets[:, seg])
        memory = out.memory
        nll.append(out.nll)
    return torch.cat(nll, dim=1), memory


SETTINGS = [
    dict(mem_len=8, ltm_basis=6, ltm_samples=5),  # M = N: the evicted rows are the memory's
    dict(mem_len=3, ltm_basis=8, ltm_samples=7, ltm_widths=[0.1, 0.3], ltm_tau=0.5, ltm_ridge=0.3, pre_lnorm=True,
         ltm_sticky=True, ltm_sticky_bins=5),  # M < N (a first block of 5 rows), sticky memories, wider basis
    dict(mem_len=12, ltm_basis=9, ltm_widths=[0.05, 0.1, 0.2], ltm_samples=4, clamp_len=6, ltm_sticky=True),  # M > N
    dict(mem_len=0, ltm_basis=4, ltm_samples=6, ltm_widths=[0.2]),  # no short-term memory: the segment is evicted
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_infinite_former_matches_the_authors(settings):
    """Per-token NLL, the last coefficients of every layer and lane, and every parameter's gradient of the summed
    NLL over 6 segments, in a float64 model. The backbone's attention computes its sinusoids and scores in fp32
    whatever the model's dtype (models/attention.py), and the head returns an fp32 NLL, so the NLL, gradients
    and the coefficients of layers >= 1 (fit to rows that went through the attention) agree to about 1e-6; layer
    0's signal reads only the embeddings and the long-term attention (float64 throughout), so its coefficients
    are compared to 1e-11."""
    torch.manual_seed(7)
    model = perturbed(build_model(tiny(init_std=0.3, **settings))).double().eval()
    N, n_seg, B = model.cfg.tgt_len, len(RESETS), 3
    tokens = torch.randint(0, 50, (B, N * n_seg))
    targets = torch.randint(0, 50, (B, N * n_seg))
    targets[1, 5] = -100
    nll, memory = run_segments(model, tokens, targets, n_seg)
    nll.sum().backward()
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0.0
    for b in range(B):
        losses, signal = infinite_former_reference(model, tokens[b].tolist(), targets[b].tolist(), N,
                                                   lane_doc_starts(RESETS, b, N))
        want = torch.stack([x for seg in losses for x in seg])
        torch.testing.assert_close(nll[b].detach().double(), want.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"lane {b}: {m}")
        for l, c in enumerate(signal):
            tol = 1e-11 if l == 0 else 1e-5
            torch.testing.assert_close(memory.coefficients[l][b], torch.zeros_like(memory.coefficients[l][b])
                                       if c is None else c, rtol=tol, atol=tol,
                                       msg=lambda m: f"lane {b} layer {l}: {m}")
        total = total + want.sum()
    total.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got_grads[name], p.grad, rtol=1e-5, atol=1e-4, msg=lambda m: f"{name}: {m}")
    # The comparison sees a long-term memory that matters: without its output the NLL moves.
    silent = copy.deepcopy(model)
    for lt in silent.long_term:
        torch.nn.init.zeros_(lt.out.weight)
    with torch.no_grad():
        assert (run_segments(silent, tokens, targets, n_seg)[0] - nll).abs().max() > 1e-3
    assert all(c.abs().amax() > 0 for c in memory.coefficients)


def test_the_long_term_read_is_exact_in_a_float64_model():
    """The expected basis N(mu; c_j, sigma^2 + w_j^2) with the basis at float64 precision: a float32 copy of
    the centres and widths would move the output by about 1e-9."""
    torch.manual_seed(4)
    cfg = tiny(ltm_basis=6, ltm_widths=[0.01, 0.05], init_std=0.5)
    attention = LongTermAttention(cfg).double()
    q = torch.randn(2, 5, cfg.n_head, cfg.d_head, dtype=torch.float64)
    coefficients = torch.randn(2, 6, cfg.d_model, dtype=torch.float64)
    out, mu, sigma_sq = attention(q, coefficients)
    basis = gaussian_basis(cfg)
    values = (coefficients @ attention.value.weight.T).view(2, 6, cfg.n_head, cfg.d_head)
    weight = torch.stack([torch.exp(-0.5 * (mu - c) ** 2 / (sigma_sq + w * w))
                          / torch.sqrt(2 * math.pi * (sigma_sq + w * w)) for c, w in basis], dim=-1)  # [B, H, Q, J]
    context = torch.einsum("bhqj,bjhe->bqhe", weight, values).reshape(2, 5, -1)
    torch.testing.assert_close(out, context @ attention.out.weight.T, rtol=1e-13, atol=1e-14)


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
