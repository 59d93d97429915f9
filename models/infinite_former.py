"""∞-former (Martins et al., 2022): Transformer-XL's short-term memory plus an unbounded long-term memory held as a
continuous signal.

Shape letters (models/shapes.md): B lanes, N segment length, M memory length (the short-term memory's), X cached
rows (M), J basis functions (ltm_basis), S samples of the old signal per update (ltm_samples; a fit reads S + N
points), G sticky-memory bins, Q queries, L layers, D model width, H heads, E head width, A attention width (H·E).

The long-term memory of layer l is a signal x(t) = C^T psi(t) over t in [0, 1]: coefficients C [B, J, D] of J
Gaussian radial basis functions psi_j(t) = N(t; c_j, w_j^2), J / len(ltm_widths) centres evenly on [0, 1] for
each width in ltm_widths (the authors' basis).

**Update** (after each segment; the paper's "unbounded memory", as the authors' code computes it:
deep-spin/infinite-former, sorting/long_term_attention.py). The N rows leaving [short-term memory | segment] (the
layer inputs of its oldest N positions, as the Compressive Transformer's evicted rows) are the new points.

* No signal yet (a document start, or no row of the document has left the short-term memory): the authors fit the
  rows alone over [0, 1] (their Gs[n]): n rows at the midpoints (i + 1/2) / n, i = 0..n-1, and floor(n / 2)
  zero-valued padding points continuing that grid on each side of [0, 1]. n is N, except for the first block
  after a document start when M is not a multiple of N: that block's newest n = N - (M mod N) rows are the
  document's (their code cannot run this case: its fits exist only for multiples of the segment; memlm fits those
  n rows alone, as their Gs[n] would).
* Otherwise (their G_inf): the new rows at t = tau + (1 - tau) i / N, i = 1..N; the old signal sampled at S
  points s_i and contracted into t = tau i / S; zero-valued padding points: those of the grid
  linspace(-1/2 + shift, 3/2 - shift, 2(S + N)) below 0 and above 1 (floor((S + N) / 2) on each side), with the
  authors' shift = 1 / (2N + S) (not 1 / (2(S + N)): theirs, kept). Their odd-N branch never builds its grid and
  fails; every N takes this one. The samples are s_i = i / S (the authors'), or with sticky memories (`ltm_sticky`) the
  (i - 1/2) / S quantiles of the histogram (G bins on [0, 1]) of the mass the segment's attention densities put
  on each bin, summed over queries and heads: the old signal is kept where attention went. The paper draws these
  samples at random; here each is the median of its 1/S of the mass, so evaluation is deterministic and a
  resumed run is exact.

Both are ridge regressions (penalty ltm_ridge) over the real points X and the padding:

    C = (F F^T + lambda I)^-1 F_real X     F [J, points]: the basis at every point, padding included

The maps from X to C are computed once per (N, M) in float64 (`SignalFit`). A document start zeroes the
coefficients; an empty signal is zero coefficients. A lane whose long-term memory is empty has zero keys and
values, so its long-term output is exactly 0: nothing of another document can reach it.

**Attention** (the paper's continuous attention). The queries are the layer's own Transformer-XL queries
q [B, N, H, E]: the authors' code passes those in (it builds a query projection of its own but never uses it).
Keys and values are K = C W_K and V = C W_V [B, J, H, E]. Per head, the scores s = K q / sqrt(E) [J] give a
Gaussian density N(mu, sigma^2) over t, mu = sigmoid(w_mu . s) and sigma^2 = softplus(w_sigma . s), floored at
1e-6. The context is V^T E[psi(t)], with the closed form E[psi_j] = N(mu; c_j, sigma^2 + w_j^2). Its output
projection W_O (context) is added to the short-term attention's output before the residual. The coefficients
are stop-gradient, as Transformer-XL's memory is; W_K, W_V, W_O, w_mu and w_sigma learn through the attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import RelativeLayer, attend, causal_index, relative_encodings
from .backbone import Backbone, LayerInputs
from .flops import layer_dims
from .head_plan import TailPlan
from .mask_layout import causal_layout
from .output import ModelOutput, cut, map_memory
from .txl import TXLDecoder, reset_valid, roll_valid
from .txl import layer_flops as txl_layer_flops

SIGMA_SQ_FLOOR = 1e-6  # the authors' clamp on sigma^2: a density narrower than this is a point


@dataclass
class InfiniteFormerMemory:
    hidden: list[Tensor]  # L x [B, M, D] layer inputs of the last M positions (detached): the short-term memory
    valid: Tensor  # [B, M] bool: slot holds a real position of the current document
    coefficients: list[Tensor]  # L x [B, J, D] the long-term signal's coefficients (detached; zero = empty)

    @property
    def key_valid(self) -> Tensor:
        """[B, X] bool: which cached keys a segment's queries may read, in key order (the memory interface). The
        long-term memory is read through densities over t, not keys: an empty one contributes exactly 0."""
        return self.valid

    def detached(self) -> "InfiniteFormerMemory":
        return map_memory(torch.Tensor.detach, self)


def basis_functions(cfg) -> tuple[Tensor, Tensor]:
    """Centres and widths [J] (float64) of the Gaussian basis: for each centre on linspace(0, 1, J / n_widths),
    one function of every width."""
    widths = torch.tensor(list(cfg.ltm_widths), dtype=torch.float64)
    centres = torch.linspace(0, 1, cfg.ltm_basis // len(widths), dtype=torch.float64)
    return centres.repeat_interleave(len(widths)), widths.repeat(len(centres))


def gaussian(t: Tensor, centre: Tensor, width: Tensor) -> Tensor:
    """N(t; centre, width^2), broadcast."""
    return torch.exp(-0.5 * ((t - centre) / width) ** 2) / (width * math.sqrt(2 * math.pi))


def first_fit_points(n: int) -> tuple[Tensor, Tensor]:
    """(real points [n], padding points [2 floor(n / 2)]) of a fit with no past signal, float64: the grid of
    spacing 1 / n through the midpoints (i + 1/2) / n, floor(n / 2) points past each end of [0, 1] (the authors'
    linspace of 2n points from -1/2 + 1/(2n), or 2n - 1 from -1/2 + 1/n for odd n, is this grid)."""
    pad = n // 2
    grid = (torch.arange(-pad, n + pad, dtype=torch.float64) + 0.5) / n
    return grid[pad : pad + n], torch.cat([grid[:pad], grid[pad + n :]])


def update_points(n_new: int, cfg) -> tuple[Tensor, Tensor]:
    """(real points [S + n_new]: S old then n_new new, padding points) of a fit with a past signal, float64."""
    S, tau = cfg.ltm_samples, cfg.ltm_tau
    old = tau * torch.arange(1, S + 1, dtype=torch.float64) / S
    new = tau + (1 - tau) * torch.arange(1, n_new + 1, dtype=torch.float64) / n_new
    shift = 1 / (2 * n_new + S)  # the authors' (their grid has 2(S + n_new) points, but this is its shift)
    grid = torch.linspace(-0.5 + shift, 1.5 - shift, 2 * (S + n_new), dtype=torch.float64)
    return torch.cat([old, new]), grid[(grid < 0) | (grid > 1)]


class SignalFit:
    """What one update needs for segments of n_new rows and a short-term memory of mem_len, computed once in
    float64 and kept in the model's dtype. Each map takes the S + n_new points' values (S old samples, then
    the new rows) to the coefficients, [J, S + n_new]: `solve` with a past signal, (F F^T + lambda I)^-1 F_real;
    `first` and `first_partial` with none, the new rows fit alone (zero columns for the old samples and for the
    rows not of the document): all n_new rows, or the newest n_new - (mem_len mod n_new) (the first block after a
    document start when mem_len is not a multiple of n_new). Also the basis at the uniform samples s_i = i / S
    [S, J], and the centres and widths [J] (float64) the sticky samples are evaluated at."""

    def __init__(self, cfg, n_new: int, mem_len: int, device, dtype):
        centres, widths = basis_functions(cfg)
        basis_at = lambda t: gaussian(t[None, :], centres[:, None], widths[:, None])  # noqa: E731  [J, len(t)]
        eye = cfg.ltm_ridge * torch.eye(len(centres), dtype=torch.float64)

        def ridge(real: Tensor, padding: Tensor) -> Tensor:  # [J, len(real)]
            every = basis_at(torch.cat([real, padding]))
            return torch.linalg.solve(every @ every.T + eye, basis_at(real))

        S = cfg.ltm_samples
        self.solve = ridge(*update_points(n_new, cfg)).to(device, dtype)

        def alone(n: int) -> Tensor:  # [J, S + n_new]: the newest n of the new rows fit alone
            fit = torch.zeros(len(centres), S + n_new, dtype=torch.float64)
            fit[:, S + n_new - n :] = ridge(*first_fit_points(n))
            return fit.to(device, dtype)

        self.first = alone(n_new)
        self.first_partial = alone(n_new - mem_len % n_new) if mem_len % n_new else self.first
        samples = torch.arange(1, S + 1, dtype=torch.float64) / S
        self.uniform_basis = basis_at(samples).T.contiguous().to(device, dtype)  # [S, J]
        self.centres, self.widths = centres.to(device), widths.to(device)


class LongTermAttention(nn.Module):
    """One layer's continuous attention over its long-term signal (the module docstring's "Attention")."""

    def __init__(self, cfg):
        super().__init__()
        D, A, J = cfg.d_model, cfg.n_head * cfg.d_head, cfg.ltm_basis
        self.n_head, self.d_head = cfg.n_head, cfg.d_head
        self.key = nn.Linear(D, A, bias=False)
        self.value = nn.Linear(D, A, bias=False)
        self.out = nn.Linear(A, D, bias=False)
        self.mu = nn.Linear(J, 1, bias=False)  # w_mu
        self.sigma = nn.Linear(J, 1, bias=False)  # w_sigma
        for linear in (self.key, self.value, self.out, self.mu, self.sigma):
            nn.init.normal_(linear.weight, 0.0, cfg.init_std)
        self.drop = nn.Dropout(cfg.dropout)
        self.cfg = cfg
        # Derived from the config, never saved (the state dict does not depend on them): per (device, dtype)
        self._basis: dict[tuple[str, torch.dtype], tuple[Tensor, Tensor]] = {}

    def basis(self, device) -> tuple[Tensor, Tensor]:
        """Centres and squared widths [J] in the model's dtype (its parameters'), cast once from the exact float64
        values: float32 buffers cost a float64 model 1e-9 on the output."""
        key = (str(device), self.mu.weight.dtype)
        if key not in self._basis:
            centres, widths = basis_functions(self.cfg)
            self._basis[key] = (centres.to(device, key[1]), (widths**2).to(device, key[1]))
        return self._basis[key]

    def forward(
        self,
        q: Tensor,  # [B, Q, H, E] the layer's Transformer-XL queries
        coefficients: Tensor,  # [B, J, D]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """-> output [B, Q, D] (added to the attention's), mu and sigma^2 [B, H, Q] of the densities."""
        B, Q, H, E = q.shape
        J = coefficients.shape[1]
        keys = self.key(coefficients).view(B, J, H, E)
        values = self.value(coefficients).view(B, J, H, E)
        scores = torch.einsum("bqhe,bjhe->bhqj", q, keys) / math.sqrt(E)  # [B, H, Q, J]
        mu = torch.sigmoid(self.mu(scores).squeeze(-1))  # [B, H, Q]
        sigma_sq = F.softplus(self.sigma(scores).squeeze(-1)).clamp(min=SIGMA_SQ_FLOOR)
        centres, widths_sq = self.basis(q.device)
        variance = sigma_sq[..., None] + widths_sq  # [B, H, Q, J]
        expected_basis = torch.exp(-0.5 * (mu[..., None] - centres) ** 2 / variance) \
            / torch.sqrt(2 * math.pi * variance)  # E_{N(mu, sigma^2)}[psi_j(t)]
        context = torch.einsum("bhqj,bjhe->bqhe", expected_basis.to(values.dtype), values)
        return self.drop(self.out(context.reshape(B, Q, H * E))), mu, sigma_sq


def sticky_samples(mu: Tensor, sigma_sq: Tensor, n_samples: int, n_bins: int) -> Tensor:
    """Where to sample the old signal, from the attention densities N(mu, sigma^2) [B, H, Q] of the segment: the
    (i - 1/2) / S quantiles (i = 1..S) of the histogram of their mass over n_bins equal bins of [0, 1].
    -> [B, S] in [0, 1]."""
    B = mu.shape[0]
    mu, sigma = mu.detach().double().reshape(B, -1, 1), sigma_sq.detach().double().sqrt().reshape(B, -1, 1)
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=mu.device)
    cdf_at_edges = 0.5 * (1 + torch.erf((edges - mu) / (sigma * math.sqrt(2))))  # [B, H·Q, G + 1]
    mass = (cdf_at_edges[..., 1:] - cdf_at_edges[..., :-1]).sum(1)  # [B, G]
    mass = mass / mass.sum(-1, keepdim=True).clamp(min=1e-300)
    upper = mass.cumsum(-1)  # [B, G] the histogram's CDF at each bin's right edge
    quantiles = (torch.arange(n_samples, dtype=torch.float64, device=mu.device).expand(B, -1) + 0.5) / n_samples
    bins = torch.searchsorted(upper, quantiles).clamp(max=n_bins - 1)  # [B, S] the bin each quantile falls in
    below = upper.gather(1, bins) - mass.gather(1, bins)
    inside = ((quantiles - below) / mass.gather(1, bins).clamp(min=1e-300)).clamp(0, 1)
    return (bins + inside) / n_bins


class InfiniteFormer(Backbone):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.long_term = nn.ModuleList(LongTermAttention(cfg) for _ in range(cfg.n_layer))
        self._fits: dict[tuple, SignalFit] = {}  # per (rows per update, M, device, dtype); derived, never saved

    def signal_fit(self, n_new: int, device, dtype) -> SignalFit:
        key = (n_new, self.cfg.mem_len, str(device), dtype)
        if key not in self._fits:
            self._fits[key] = SignalFit(self.cfg, n_new, self.cfg.mem_len, device, dtype)
        return self._fits[key]

    def init_memory(self, batch_size: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> InfiniteFormerMemory:
        cfg = self.cfg
        # The training segment's fit and the attention's basis, made before the first forward: a compiled forward
        # guards on these caches' keys, and a key it first saw missing would recompile it at the second segment.
        self.signal_fit(cfg.tgt_len, device, dtype)
        for long_term in self.long_term:
            long_term.basis(device)
        zeros = lambda rows: [torch.zeros(batch_size, rows, cfg.d_model, device=device, dtype=dtype)  # noqa: E731
                              for _ in range(cfg.n_layer)]
        return InfiniteFormerMemory(hidden=zeros(cfg.mem_len),
                                    valid=torch.zeros(batch_size, cfg.mem_len, dtype=torch.bool, device=device),
                                    coefficients=zeros(cfg.ltm_basis))

    def forward(
        self,
        tokens: Tensor,  # [B, N]
        memory: InfiniteFormerMemory,
        reset: Tensor | None = None,  # [B] bool
        targets: Tensor | None = None,  # [B, N], -100 = ignore
        return_logits: bool = False,
        tail_plan: TailPlan | None = None,  # head_plan.tail_plan(targets) built on the host
    ) -> ModelOutput:
        cfg = self.cfg
        B, N = tokens.shape
        M = cfg.mem_len
        valid = reset_valid(memory.valid, reset)  # [B, M]
        keep = torch.ones(B, dtype=torch.bool, device=tokens.device) if reset is None \
            else ~reset.to(tokens.device)  # [B] lanes whose long-term memory carries on
        h = self.embed_tokens(tokens)  # [B, N, D]

        layout = causal_layout(N, M, valid, cfg.same_length)
        allowed = layout.allowed  # [B, N, M + N]
        kernel_mask = self.kernel_mask(layout)  # None on the einsum path
        pos_index = causal_index(N, M, tokens.device)  # [N, M + N]
        r = self.drop(relative_encodings(torch.arange(M + N, device=tokens.device), cfg.d_model, cfg.clamp_len,
                                         h.dtype))
        # The N rows leaving [memory | segment] this segment (its oldest), and which are of the current document.
        leaving_valid = torch.cat([valid, valid.new_ones(B, N)], dim=1)[:, :N]  # [B, N]
        fit = self.signal_fit(N, tokens.device, h.dtype)

        learned = self.learned.fetch()
        inputs = LayerInputs(r, pos_index, allowed, kernel_mask, None, learned["bias_u"], learned["bias_v"], "causal")
        new_hidden, new_coefficients = [], []
        for l in range(cfg.n_layer):
            mem_in = memory.hidden[l].to(h.dtype)  # [B, M, D]
            coefficients = memory.coefficients[l].to(h.dtype) * keep[:, None, None]  # [B, J, D]
            rows = torch.cat([mem_in, h], dim=1)  # [B, M + N, D] this layer's inputs, oldest first
            if M:
                new_hidden.append(cut(rows[:, N:]))
            h_out, mu, sigma_sq = self.run_layer(l, h, mem_in, inputs, self.long_term[l], coefficients)
            new_coefficients.append(cut(self.update_signal(fit, coefficients, rows[:, :N] * leaving_valid[..., None],
                                                           leaving_valid, mu, sigma_sq)))
            h = h_out

        nll, logits = self.predict(h, targets, return_logits, tail_plan)
        new_memory = InfiniteFormerMemory(hidden=new_hidden if M else memory.hidden, valid=roll_valid(valid, N, M),
                                          coefficients=new_coefficients)
        return ModelOutput(nll=nll, logits=logits, memory=new_memory)

    def layer_step(
        self,
        layer: RelativeLayer,
        h: Tensor,  # [B, N, D]
        cached: Tensor,  # [B, M, D] the short-term memory
        r: Tensor, pos_index: Tensor, allowed: Tensor, bias_u: Tensor, bias_v: Tensor, kernel_mask, record,
        pos_offset: int | None,
        long_term: LongTermAttention,
        coefficients: Tensor,  # [B, J, D] the long-term signal
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Backbone.layer_step with the long-term memory's output added to the attention's: the new h [B, N, D],
        and the densities' mu, sigma^2 [B, H, N] (sticky memories read them)."""
        q, k, v = layer.attn.project_with_memory(layer.attn_input(cached), layer.attn_input(h))  # [B, *, H, E]
        context, _ = attend(q, k, v, layer.attn.project_positions(r), pos_index, allowed, bias_u, bias_v,
                            layer.attn.dropatt, need_lognorm=False, record=record, kernel_mask=kernel_mask,
                            pos_offset=pos_offset)
        recalled, mu, sigma_sq = long_term(q, coefficients)
        return layer.finish(h, context, extra=recalled), mu, sigma_sq

    def update_signal(self, fit: SignalFit, coefficients: Tensor, new_rows: Tensor, new_valid: Tensor, mu: Tensor,
                      sigma_sq: Tensor) -> Tensor:
        """The next coefficients [B, J, D] from the new rows [B, N, D] (zeros where not of the document, new_valid
        [B, N]): fit alone where the lane has no signal yet, else with the old signal sampled at S points and
        contracted into [0, tau] (the module docstring's "Update")."""
        with torch.no_grad():
            if self.cfg.ltm_sticky:
                at = sticky_samples(mu, sigma_sq, self.cfg.ltm_samples, self.cfg.ltm_sticky_bins)  # [B, S]
                sample_basis = gaussian(at[..., None], fit.centres, fit.widths)  # [B, S, J]
                old = torch.einsum("bsj,bjd->bsd", sample_basis.to(coefficients.dtype), coefficients)
            else:
                old = torch.einsum("sj,bjd->bsd", fit.uniform_basis, coefficients)  # [B, S, D]
            points = torch.cat([old, new_rows.to(coefficients.dtype)], dim=1)  # [B, S + N, D]
            # No signal is zero coefficients (a reset zeroes them; a fit of real rows never is): read on the
            # device, per lane, so the choice needs no host sync. A lane's first block is whole or its newest
            # N - (M mod N) rows (the document's rows enter in order).
            empty = coefficients.flatten(1).abs().amax(1) == 0  # [B]
            whole = new_valid.all(1)  # [B]
            first = torch.where(whole[:, None, None], fit.first, fit.first_partial)  # [B, J, S + N]
            solve = torch.where(empty[:, None, None], first, fit.solve)
            return torch.einsum("bjt,btd->bjd", solve, points)


# ---------------------------------------------------------------------------------------------------------------
# What the registry entry names besides the model: FLOPs (models/flops.py's conventions), parameters, decoder


def layer_flops(cfg, batch_size: int) -> tuple[dict[str, float], int]:
    """∞-former: Transformer-XL's layers, plus per layer the long-term memory: keys and values of the J
    coefficients, scores and w_mu / w_sigma for the N queries, the context and its output projection
    ("long_term"), and the update: sampling the old signal at S points and the fit over S + N ("ltm_update").
    The densities' closed forms and the sticky histogram are elementwise and not counted."""
    D, A, _, L, N, _, mm = layer_dims(cfg)
    seg, rows = txl_layer_flops(cfg, batch_size)
    J, S, H = cfg.ltm_basis, cfg.ltm_samples, cfg.n_head
    seg["long_term"] = L * (2 * mm(J, D, A) + mm(N, A, J) + 2 * mm(H * N, J, 1) + mm(N, J, A) + mm(N, A, D))
    seg["ltm_update"] = L * (mm(S, J, D) + mm(J, S + N, D))
    return seg, rows


def extra_params(cfg) -> int:
    """Per layer: W_K, W_V [D, A], W_O [A, D], w_mu and w_sigma [J]."""
    A = cfg.n_head * cfg.d_head
    return cfg.n_layer * (3 * cfg.d_model * A + 2 * cfg.ltm_basis)


class InfiniteFormerDecoder(TXLDecoder):
    """∞-former: Transformer-XL's decoder, each layer adding its long-term memory's output. The signal is fixed
    for the whole segment (the model refits it after the segment), so each new token's output depends only on
    its own query."""

    def begin(self, memory) -> None:
        super().begin(memory)
        self.coefficients = [c.to(self.keys[0].dtype) for c in memory.coefficients]

    def layer_extra(self, l: int, q: Tensor) -> Tensor:
        return self.model.long_term[l](q, self.coefficients[l])[0]

