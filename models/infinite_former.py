"""∞-former (Martins et al., 2022): Transformer-XL's short-term memory plus an unbounded long-term memory held as a
continuous signal.

Shape legend: B lanes, N segment length, M short-term memory length, J basis functions (ltm_basis), S samples of
the old signal per update (ltm_samples), T = S + N points one fit reads, G sticky-memory bins, L layers, D model
width, H heads, E head width.

The long-term memory of layer l is a signal x(t) = C^T psi(t) over t in [0, 1]: coefficients C [B, J, D] of J
Gaussian radial basis functions psi_j(t) = N(t; c_j, w_j^2), J / len(ltm_widths) centres evenly on [0, 1] for
each width in ltm_widths (the authors' basis).

**Update** (after each segment; the paper's "unbounded memory"). The N rows leaving [short-term memory | segment]
(the layer inputs of its oldest N positions, as the Compressive Transformer's evicted rows) are new points at
t = tau + (1 - tau) i / N, i = 1..N. The old signal is sampled at S points s_i and contracted into
t = tau i / S. The samples are s_i = i / S (the authors'), or with sticky memories (`ltm_sticky`) the
(i - 1/2) / S quantiles of the histogram (G bins on [0, 1]) of the mass the segment's attention densities put on
each bin, summed over queries and heads: the old signal is kept where attention went. The paper draws these
samples at random; here each is the median of its 1/S of the mass, so evaluation is deterministic and a resumed
run is exact. The coefficients are the ridge
regression (penalty ltm_ridge) over the T points plus P = ceil(T / 2) zero-valued points on each side of
[0, 1], evenly in [-1/2, 0) and (1, 3/2] (the authors' padding: it keeps the fit from blowing up at the edges):

    C = (F F^T + lambda I)^-1 F_real X     F [J, 2P + T]: the basis at every point; X [T, D]: the real points

A document start zeroes the coefficients, and an evicted row of no current document (the memory's empty slots)
enters as zeros. A lane whose long-term memory is empty has zero keys and values, so its long-term output is
exactly 0: nothing of another document can reach it.

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
from .backbone import Backbone
from .decoders import TXLDecoder
from .flops import layer_dims, txl_layers
from .head_plan import TailPlan
from .mask_layout import causal_layout
from .output import ModelOutput, cut, map_memory
from .txl import reset_valid, roll_valid

SIGMA_SQ_FLOOR = 1e-6  # the authors' clamp on sigma^2: a density narrower than this is a point


@dataclass
class InfiniteFormerMemory:
    hidden: list[Tensor]  # L x [B, M, D] layer inputs of the last M positions (detached): the short-term memory
    valid: Tensor  # [B, M] bool: slot holds a real position of the current document
    coefficients: list[Tensor]  # L x [B, J, D] the long-term signal's coefficients (detached; zero = empty)

    @property
    def key_valid(self) -> Tensor:
        """[B, P] bool: which cached keys a segment's queries may read, in key order (the memory interface). The
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


def fit_points(n_new: int, cfg) -> tuple[Tensor, Tensor]:
    """(real points [T]: S old then n_new new, padding points [2P]) on the t axis, float64."""
    S, tau = cfg.ltm_samples, cfg.ltm_tau
    old = tau * torch.arange(1, S + 1, dtype=torch.float64) / S
    new = tau + (1 - tau) * torch.arange(1, n_new + 1, dtype=torch.float64) / n_new
    P = math.ceil((S + n_new) / 2)
    offsets = 0.5 * (torch.arange(1, P + 1, dtype=torch.float64) - 0.5) / P
    return torch.cat([old, new]), torch.cat([-offsets.flip(0), 1 + offsets])


class SignalFit:
    """What one update needs for a segment of n_new rows, computed once: the ridge regression's map from the T
    real points' values to the coefficients, W = (F F^T + lambda I)^-1 F_real [J, T], and the basis at the uniform
    samples s_i = i / S, [S, J]."""

    def __init__(self, cfg, n_new: int, device, dtype):
        centres, widths = basis_functions(cfg)
        real, padding = fit_points(n_new, cfg)
        basis_at = lambda t: gaussian(t[None, :], centres[:, None], widths[:, None])  # noqa: E731  [J, len(t)]
        every = basis_at(torch.cat([real, padding]))
        gram = every @ every.T + cfg.ltm_ridge * torch.eye(len(centres), dtype=torch.float64)
        self.solve = torch.linalg.solve(gram, basis_at(real)).to(device, dtype)  # [J, T]
        samples = torch.arange(1, cfg.ltm_samples + 1, dtype=torch.float64) / cfg.ltm_samples
        self.uniform_basis = basis_at(samples).T.contiguous().to(device, dtype)  # [S, J]


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
        centres, widths = basis_functions(cfg)
        # Derived from the config, never saved: the state dict does not depend on them.
        self.register_buffer("centres", centres.float(), persistent=False)
        self.register_buffer("widths_sq", widths.float() ** 2, persistent=False)

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
        variance = sigma_sq[..., None] + self.widths_sq  # [B, H, Q, J]
        expected_basis = torch.exp(-0.5 * (mu[..., None] - self.centres) ** 2 / variance) \
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
    cdf_at_edges = 0.5 * (1 + torch.erf((edges - mu) / (sigma * math.sqrt(2))))  # [B, HQ, G + 1]
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
        self._fits: dict[tuple, SignalFit] = {}  # per (rows per update, device, dtype); derived, never saved

    def signal_fit(self, n_new: int, device, dtype) -> SignalFit:
        key = (n_new, str(device), dtype)
        if key not in self._fits:
            self._fits[key] = SignalFit(self.cfg, n_new, device, dtype)
        return self._fits[key]

    def init_memory(self, batch_size: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> InfiniteFormerMemory:
        cfg = self.cfg
        # The training segment's fit, made before the first forward: a compiled forward guards on this cache's
        # keys, and a key it first saw missing would recompile the whole forward at the second segment.
        self.signal_fit(cfg.tgt_len, device, dtype)
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
        new_hidden, new_coefficients = [], []
        for l, layer in enumerate(self.layers):
            mem_in = memory.hidden[l].to(h.dtype)  # [B, M, D]
            coefficients = memory.coefficients[l].to(h.dtype) * keep[:, None, None]  # [B, J, D]
            rows = torch.cat([mem_in, h], dim=1)  # [B, M + N, D] this layer's inputs, oldest first
            if M:
                new_hidden.append(cut(rows[:, N:]))
            h_out, mu, sigma_sq = self.layer_step(
                layer, self.long_term[l], h, mem_in, coefficients, r, pos_index, allowed,
                self.layer_bias(learned["bias_u"], l), self.layer_bias(learned["bias_v"], l), kernel_mask,
                self.record_to("causal", l))
            new_coefficients.append(cut(self.update_signal(fit, coefficients, rows[:, :N] * leaving_valid[..., None],
                                                           mu, sigma_sq)))
            h = h_out

        nll, logits = self.predict(h, targets, return_logits, tail_plan)
        new_memory = InfiniteFormerMemory(hidden=new_hidden if M else memory.hidden, valid=roll_valid(valid, N, M),
                                          coefficients=new_coefficients)
        return ModelOutput(nll=nll, logits=logits, memory=new_memory)

    def layer_step(
        self,
        layer: RelativeLayer,
        long_term: LongTermAttention,
        h: Tensor,  # [B, N, D]
        cached: Tensor,  # [B, M, D] the short-term memory
        coefficients: Tensor,  # [B, J, D] the long-term signal
        r: Tensor, pos_index: Tensor, allowed: Tensor, bias_u: Tensor, bias_v: Tensor, kernel_mask, record,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Backbone.layer_step with the long-term memory's output added to the attention's: the new h [B, N, D],
        and the densities' mu, sigma^2 [B, H, N] (sticky memories read them)."""
        q, k, v = layer.attn.project_with_memory(layer.attn_input(cached), layer.attn_input(h))  # [B, *, H, E]
        context, _ = attend(q, k, v, layer.attn.project_positions(r), pos_index, allowed, bias_u, bias_v,
                            layer.attn.dropatt, need_lognorm=False, record=record, kernel_mask=kernel_mask)
        recalled, mu, sigma_sq = long_term(q, coefficients)
        return layer.finish(h, context, extra=recalled), mu, sigma_sq

    def update_signal(self, fit: SignalFit, coefficients: Tensor, new_rows: Tensor, mu: Tensor,
                      sigma_sq: Tensor) -> Tensor:
        """The next coefficients [B, J, D]: the old signal sampled at S points and contracted into [0, tau], the
        new rows [B, N, D] (zeros where empty) on [tau, 1], refitted (the module docstring's "Update")."""
        with torch.no_grad():
            if self.cfg.ltm_sticky:
                at = sticky_samples(mu, sigma_sq, self.cfg.ltm_samples, self.cfg.ltm_sticky_bins)  # [B, S]
                centres, widths = basis_functions(self.cfg)
                sample_basis = gaussian(at[..., None], centres.to(at.device), widths.to(at.device))  # [B, S, J]
                old = torch.einsum("bsj,bjd->bsd", sample_basis.to(coefficients.dtype), coefficients)
            else:
                old = torch.einsum("sj,bjd->bsd", fit.uniform_basis, coefficients)  # [B, S, D]
            points = torch.cat([old, new_rows.to(coefficients.dtype)], dim=1)  # [B, T, D]
            return torch.einsum("jt,btd->bjd", fit.solve, points)


# ---------------------------------------------------------------------------------------------------------------
# What the registry entry names besides the model: FLOPs (models/flops.py's conventions), parameters, decoder


def layer_flops(cfg, batch_size: int) -> tuple[dict[str, float], int]:
    """∞-former: Transformer-XL's layers, plus per layer the long-term memory: keys and values of the J
    coefficients, scores and w_mu / w_sigma for the N queries, the context and its output projection
    ("long_term"), and the update: sampling the old signal at S points and the fit over T = S + N ("ltm_update").
    The densities' closed forms and the sticky histogram are elementwise and not counted."""
    D, A, _, L, N, _, mm = layer_dims(cfg)
    seg, rows = txl_layers(cfg, batch_size)
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

