"""Adaptive input embedding and adaptive softmax (models/adaptive.py) against slow, obvious references written
here: one token at a time, float64, explicit cluster lookup and an explicit two-level softmax.

The references know only the parameter layout (which table / projection / bias serves which token), none of the
module's batching, indexing or masking code.
"""

import math

import pytest
import torch

from memlm.models import ModelConfig, build_model
from memlm.models.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax

V = 60

# (cutoffs, div_val, d_embed, d_proj): no cutoffs with and without a projection; adaptive with one shared table
# (div_val 1) with and without a projection; per-cluster tables of widths 16/8/4 (projections for the tails only)
# and of widths 12/6/3 (projections everywhere).
SETTINGS = [
    ([], 1, 16, 16),
    ([], 1, 12, 16),
    ([10, 30], 1, 16, 16),
    ([10, 30], 1, 12, 16),
    ([10, 30], 2, 16, 16),
    ([10, 30], 2, 12, 16),
]
IDS = [f"cut{c or 'none'}-div{dv}-e{de}-p{dp}" for c, dv, de, dp in SETTINGS]


def bounds(cutoffs):
    edges = [0] + list(cutoffs) + [V]
    return list(zip(edges[:-1], edges[1:]))


def cluster_of(token, cutoffs):
    return next(i for i, (lo, hi) in enumerate(bounds(cutoffs)) if lo <= token < hi)


def make(cutoffs, div_val, d_embed, d_proj, tied, seed=0):
    """Both modules with every parameter (biases and cluster logits included) randomised, so nothing is zero."""
    torch.manual_seed(seed)
    emb = AdaptiveEmbedding(V, d_embed, d_proj, cutoffs, div_val, init_std=0.02)
    head = AdaptiveLogSoftmax(V, d_embed, d_proj, cutoffs, div_val, init_std=0.02)
    if tied:
        head.tie_to(emb)
    with torch.no_grad():
        for p in list(emb.parameters()) + list(head.parameters()):
            p.copy_(torch.randn_like(p) * 0.5)
    return emb, head


def ref_embedding(emb, token, cutoffs, div_val, d_proj):
    """Row of the token's cluster table, its projection to d_proj (if any), times sqrt(d_proj)."""
    i = cluster_of(token, cutoffs)
    lo = bounds(cutoffs)[i][0]
    if div_val == 1:
        row, proj = emb.tables[0].weight[token], emb.projs[0]
    else:
        row, proj = emb.tables[i].weight[token - lo], emb.projs[i]
    row = row.detach().double()
    if proj is not None:
        row = proj.detach().double() @ row
    return row * math.sqrt(d_proj)


def ref_logprobs(head, h, cutoffs, div_val):
    """Explicit two-level softmax for one hidden state h [D] -> log p(w) for every w, float64.

    Level 1: softmax over (shortlist tokens, one logit per tail cluster). Level 2: softmax inside each tail
    cluster. log p(w) = level-1 log-prob of w (shortlist) or of w's cluster + level-2 log-prob of w in it.
    """
    with torch.no_grad():
        return _ref_logprobs(head, h.double(), cutoffs, div_val)


def _ref_logprobs(head, h, cutoffs, div_val):
    clusters = bounds(cutoffs)

    def proj_in(i):
        t = 0 if div_val == 1 else i
        p = head.projs[t]
        return p.double().t() @ h if p is not None else h

    def token_logit(w):
        i = cluster_of(w, cutoffs)
        lo = clusters[i][0]
        row = head.weights[0][w] if div_val == 1 else head.weights[i][w - lo]
        return float(row.double() @ proj_in(i) + head.bias[w].double())

    shortlist = clusters[0][1]
    level1 = [token_logit(w) for w in range(shortlist)]
    x0 = proj_in(0)
    level1 += [float(head.cluster_weight[c].double() @ x0 + head.cluster_bias[c].double())
               for c in range(len(clusters) - 1)]
    lse1 = math.log(sum(math.exp(s) for s in level1))
    out = [s - lse1 for s in level1[:shortlist]]
    for c, (lo, hi) in enumerate(clusters[1:]):
        level2 = [token_logit(w) for w in range(lo, hi)]
        lse2 = math.log(sum(math.exp(s) for s in level2))
        out += [level1[shortlist + c] - lse1 + s - lse2 for s in level2]
    return torch.tensor(out, dtype=torch.float64)


def sample_targets(cutoffs, shape, generator):
    """Targets covering every cluster, plus some -100 (ignored) positions."""
    tgt = torch.randint(0, V, shape, generator=generator)
    flat = tgt.view(-1)
    for i, (lo, hi) in enumerate(bounds(cutoffs)):
        flat[i] = lo + (hi - lo) // 2  # at least one target per cluster
    flat[-1] = -100
    flat[-4] = -100
    return tgt


@pytest.mark.parametrize("cutoffs,div_val,d_embed,d_proj", SETTINGS, ids=IDS)
@pytest.mark.parametrize("tied", [True, False])
def test_embedding_equals_lookup_projection_scale(cutoffs, div_val, d_embed, d_proj, tied):
    emb, _ = make(cutoffs, div_val, d_embed, d_proj, tied)
    tokens = torch.randint(0, V, (3, 7))
    tokens[0, :] = torch.tensor([0, 9, 10, 29, 30, 59, 31])  # both sides of every cluster edge
    got = emb(tokens)
    assert got.shape == (3, 7, d_proj)
    want = torch.stack([torch.stack([ref_embedding(emb, int(t), cutoffs, div_val, d_proj) for t in row])
                        for row in tokens])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cutoffs,div_val,d_embed,d_proj", SETTINGS, ids=IDS)
@pytest.mark.parametrize("tied", [True, False])
def test_logprobs_equal_explicit_two_level_softmax(cutoffs, div_val, d_embed, d_proj, tied):
    _, head = make(cutoffs, div_val, d_embed, d_proj, tied)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, d_proj, generator=g)
    targets = sample_targets(cutoffs, (2, 5), g)
    with torch.no_grad():
        nll, logprobs = head(hidden, targets, want_logprobs=True)
    assert logprobs.shape == (2, 5, V) and nll.shape == (2, 5)

    want = torch.stack([torch.stack([ref_logprobs(head, hidden[b, n], cutoffs, div_val) for n in range(5)])
                        for b in range(2)])
    torch.testing.assert_close(logprobs.double(), want, rtol=1e-5, atol=1e-5)
    # A proper distribution over the whole vocabulary.
    torch.testing.assert_close(logprobs.double().exp().sum(-1), torch.ones(2, 5, dtype=torch.float64),
                               rtol=0, atol=1e-5)
    # nll = -log p(target), and exactly 0 where the target is ignored.
    for b in range(2):
        for n in range(5):
            t = int(targets[b, n])
            expect = 0.0 if t == -100 else -float(want[b, n, t])
            assert float(nll[b, n]) == pytest.approx(expect, abs=1e-5), (b, n, t)
    assert (nll[targets == -100] == 0).all()
    assert (targets == -100).any() and (nll[targets != -100] > 0).all()


@pytest.mark.parametrize("cutoffs,div_val,d_embed,d_proj", SETTINGS, ids=IDS)
@pytest.mark.parametrize("tied", [True, False])
def test_fast_target_only_nll_equals_full_path(cutoffs, div_val, d_embed, d_proj, tied):
    """want_logprobs=False evaluates only the clusters that hold a target: same values, same gradients."""
    _, head = make(cutoffs, div_val, d_embed, d_proj, tied)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 6, d_proj, generator=g)
    targets = sample_targets(cutoffs, (3, 6), g)

    grads = []
    for want_logprobs in (True, False):
        head.zero_grad()
        h = hidden.clone().requires_grad_(True)
        nll, logprobs = head(h, targets, want_logprobs=want_logprobs)
        assert (logprobs is None) == (not want_logprobs)
        (nll * torch.linspace(0.5, 1.5, nll.numel()).view_as(nll)).sum().backward()
        grads.append((nll.detach(), h.grad,
                      {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    (full, gh_full, gp_full), (fast, gh_fast, gp_fast) = grads
    torch.testing.assert_close(fast, full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh_fast, gh_full, rtol=1e-5, atol=1e-6)
    assert gp_fast.keys() == gp_full.keys()
    for name in gp_full:
        torch.testing.assert_close(gp_fast[name], gp_full[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("cutoffs,div_val,d_embed,d_proj", SETTINGS, ids=IDS)
@pytest.mark.parametrize("tied", [True, False])
def test_chunked_head_nll_equals_the_reference_and_the_full_gradients(cutoffs, div_val, d_embed, d_proj, tied,
                                                                      monkeypatch):
    """model.head_loss=chunked (the head's softmax a few rows at a time, models/chunked_nll.py), with chunks of 5
    rows over 18: the NLL of every target equals the explicit two-level softmax, and every gradient equals the
    full path's."""
    from memlm.models import chunked_nll

    monkeypatch.setattr(chunked_nll, "CHUNK_ROWS", 5)
    _, head = make(cutoffs, div_val, d_embed, d_proj, tied)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 6, d_proj, generator=g)
    targets = sample_targets(cutoffs, (3, 6), g)
    weights = torch.linspace(0.5, 1.5, targets.numel()).view_as(targets)

    results = {}
    for kind in ("full", "chunked"):
        head.head_loss = kind
        head.zero_grad()
        h = hidden.clone().requires_grad_(True)
        nll, _ = head(h, targets, want_logprobs=False)
        (nll * weights).sum().backward()
        results[kind] = (nll.detach(), h.grad, {n: p.grad.clone() for n, p in head.named_parameters()
                                                if p.grad is not None})
    chunked, gh_chunked, gp_chunked = results["chunked"]
    for b in range(3):
        for n in range(6):
            t = int(targets[b, n])
            want = 0.0 if t < 0 else -float(ref_logprobs(head, hidden[b, n], cutoffs, div_val)[t])
            assert float(chunked[b, n]) == pytest.approx(want, abs=1e-5), (b, n, t)
    _, gh_full, gp_full = results["full"]
    torch.testing.assert_close(gh_chunked, gh_full, rtol=1e-5, atol=1e-6)
    assert gp_chunked.keys() == gp_full.keys()
    for name in gp_full:
        torch.testing.assert_close(gp_chunked[name], gp_full[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fast_path_with_an_empty_cluster_and_all_ignored():
    """A tail cluster with no target is skipped; a batch of only ignored targets gives zeros."""
    _, head = make([10, 30], 2, 16, 16, tied=False)
    hidden = torch.randn(1, 4, 16)
    targets = torch.tensor([[1, 5, 40, -100]])  # nothing in cluster [10, 30)
    fast, _ = head(hidden, targets, want_logprobs=False)
    _, logprobs = head(hidden, None, want_logprobs=True)
    want = -logprobs[0, torch.arange(3), targets[0, :3]]
    torch.testing.assert_close(fast[0, :3], want)
    assert fast[0, 3] == 0
    none, _ = head(hidden, torch.full((1, 4), -100), want_logprobs=False)
    assert (none == 0).all()
    nothing, nothing_lp = head(hidden, None, want_logprobs=False)
    assert nothing is None and nothing_lp is None


@pytest.mark.parametrize("cutoffs,div_val,d_embed,d_proj", SETTINGS, ids=IDS)
def test_tying_shares_storage_and_gradients(cutoffs, div_val, d_embed, d_proj):
    emb, head = make(cutoffs, div_val, d_embed, d_proj, tied=True)
    assert len(head.weights) == len(emb.tables) and len(head.projs) == len(emb.projs)
    for table, weight in zip(emb.tables, head.weights):
        assert weight is table.weight and weight.data_ptr() == table.weight.data_ptr()
    for p_emb, p_head in zip(emb.projs, head.projs):
        assert p_head is p_emb
        if p_emb is not None:
            assert p_head.data_ptr() == p_emb.data_ptr()
    # Writing through one side is seen by the other.
    with torch.no_grad():
        emb.tables[0].weight[0, 0] = 123.0
    assert float(head.weights[0].detach()[0, 0]) == 123.0

    # The shared tensor's gradient is the sum of what the embedding and the head each send it.
    tokens = torch.tensor([[0, 12, 35, 59, 3]])
    targets = torch.tensor([[12, 35, 59, 3, 1]])
    shared = [t.weight for t in emb.tables] + [p for p in emb.projs if p is not None]

    def grads(loss_fn):
        for p in shared:
            p.grad = None
        loss_fn().backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in shared]

    fixed_hidden = torch.randn(1, 5, d_proj)
    g_emb = grads(lambda: (emb(tokens) * fixed_hidden).sum())
    g_head = grads(lambda: head(fixed_hidden, targets, want_logprobs=False)[0].sum())
    g_both = grads(lambda: ((emb(tokens) * fixed_hidden).sum()
                            + head(fixed_hidden, targets, want_logprobs=False)[0].sum()))
    assert any(g.abs().sum() > 0 for g in g_emb) and any(g.abs().sum() > 0 for g in g_head)
    for a, b, both in zip(g_emb, g_head, g_both):
        torch.testing.assert_close(both, a + b)


@pytest.mark.parametrize("cutoffs,div_val", [([], 1), ([10, 30], 1), ([10, 30], 2)])
def test_build_model_ties_or_not(cutoffs, div_val):
    """Through build_model: tie_weight shares every table and projection, untied shares nothing."""
    kw = dict(arch="txl", n_layer=1, n_head=2, d_model=16, d_head=8, d_inner=32, vocab_size=V, tgt_len=4, mem_len=4,
              cutoffs=cutoffs, div_val=div_val, d_embed=12)
    tied, untied = build_model(ModelConfig(tie_weight=True, **kw)), build_model(ModelConfig(tie_weight=False, **kw))
    for t, w in zip(tied.embed.tables, tied.head.weights):
        assert w.data_ptr() == t.weight.data_ptr()
    for t, w in zip(untied.embed.tables, untied.head.weights):
        assert w.data_ptr() != t.weight.data_ptr()
    shared = (sum(t.weight.numel() for t in tied.embed.tables)
              + sum(p.numel() for p in tied.embed.projs if p is not None))
    assert shared > 0
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == shared



@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="bf16 autocast on CUDA (bench/benchmarks/gpu_run.sh runs this)")
def test_gpu_chunked_head_under_bf16_autocast_matches_the_full_path():
    """On a GPU model.head_loss=auto is chunked: under bf16 autocast its NLL and gradients match the full path's
    (both round the same bf16 matmuls; tolerances of bf16)."""
    _, head = make([10, 30], 1, 16, 16, tied=False)
    head = head.cuda()
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(8, 64, 16, generator=g).cuda()
    targets = sample_targets([10, 30], (8, 64), g).cuda()
    results = {}
    for kind in ("full", "chunked"):
        head.head_loss = kind
        head.zero_grad()
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            nll, _ = head(h, targets, want_logprobs=False)
        nll.float().sum().backward()
        results[kind] = (nll.float(), h.grad.float())
    torch.testing.assert_close(results["chunked"][0], results["full"][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results["chunked"][1], results["full"][1], rtol=5e-2, atol=5e-3)
