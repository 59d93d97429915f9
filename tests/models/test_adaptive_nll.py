"""The adaptive softmax's chunked training NLL (model.head_loss: chunked; models/adaptive_nll.py), with and without a
tail plan (models/head_plan.py), against a slow float64 reference written here: one position at a time, the
explicit two-level softmax, its gradients by autograd. The reference knows only the parameter layout (which table,
projection and bias serve which token).

Then what the path is for: no host sync with a plan (a census of the ops it dispatches), one write of the tied
table's gradient (a census of the full-table tensors its backward makes), and the head's padding to a multiple of
64 columns, which must change nothing.
"""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memlm.models import chunked_nll
from memlm.models.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from memlm.models.head_plan import tail_plan

V = 60

# (cutoffs, div_val, d_embed, d_proj): no cutoffs with and without a projection; one shared table (div_val 1) with
# and without a projection; a table per cluster (widths 16/8/4, projections for the tails only; 12/6/3 everywhere).
SETTINGS = [
    ([], 1, 16, 16),
    ([], 1, 12, 16),
    ([10, 30], 1, 16, 16),
    ([10, 30], 1, 12, 16),
    ([10, 30], 2, 16, 16),
    ([10, 30], 2, 12, 16),
]
IDS = [f"cut{c or 'none'}-div{dv}-e{de}-p{dp}" for c, dv, de, dp in SETTINGS]


def clusters(cutoffs):
    edges = [0] + list(cutoffs) + [V]
    return list(zip(edges[:-1], edges[1:]))


def make_head(cutoffs, div_val, d_embed, d_proj, seed=0):
    """A float64 chunked head with every parameter random (biases and cluster logits too)."""
    torch.manual_seed(seed)
    head = AdaptiveLogSoftmax(V, d_embed, d_proj, cutoffs, div_val, init_std=0.02, head_loss="chunked").double()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return head


def sample_targets(cutoffs, shape, seed):
    """Targets in every cluster, and some ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, V, shape, generator=g)
    flat = targets.view(-1)
    for i, (lo, hi) in enumerate(clusters(cutoffs)):
        flat[2 * i] = lo
        flat[2 * i + 1] = hi - 1
    flat[-1] = flat[-5] = -100
    return targets


def reference_nll(params, hidden, targets, cutoffs, div_val):
    """-log p(target) for each position, float64, 0 where the target is -100.

    p(w) = p_head(w) for a shortlist word; p_head(cluster c) * p_c(w) for a word of tail cluster c. The head's
    softmax is over the shortlist words' logits and one logit per tail cluster; p_c over cluster c's words."""
    spans = clusters(cutoffs)
    shortlist = spans[0][1]

    def projected(h, c):  # the hidden state in cluster c's table width
        proj = params.get(f"proj{0 if div_val == 1 else c}")
        return h if proj is None else proj.t() @ h

    def word_rows(c):  # cluster c's output embeddings
        lo, hi = spans[c]
        return params["weight0"][lo:hi] if div_val == 1 else params[f"weight{c}"]

    out = []
    for h, y in zip(hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).tolist()):
        if y < 0:
            out.append(h.sum() * 0.0)
            continue
        x = projected(h, 0)
        head_logits = word_rows(0) @ x + params["bias"][:shortlist]
        if len(spans) > 1:
            head_logits = torch.cat([head_logits, params["cluster_weight"] @ x + params["cluster_bias"]])
        head_logp = torch.log_softmax(head_logits, dim=0)
        c = next(i for i, (lo, hi) in enumerate(spans) if lo <= y < hi)
        if c == 0:
            out.append(-head_logp[y])
            continue
        lo, hi = spans[c]
        tail_logp = torch.log_softmax(word_rows(c) @ projected(h, c) + params["bias"][lo:hi], dim=0)
        out.append(-head_logp[shortlist + c - 1] - tail_logp[y - lo])
    return torch.stack(out).view(targets.shape)


def head_result(head, hidden, targets, weights, plan):
    """(nll, d/dhidden, {parameter name: gradient}) of the head's sum(weights * nll)."""
    head.zero_grad(set_to_none=True)
    h = hidden.clone().requires_grad_(True)
    nll, logprobs = head(h, targets, want_logprobs=False, plan=plan)
    assert logprobs is None
    (nll * weights).sum().backward()
    return nll.detach(), h.grad, {n: p.grad for n, p in head.named_parameters()}


def reference_result(head, hidden, targets, weights, cutoffs, div_val):
    params = {n: p.detach().clone().requires_grad_(True) for n, p in head.named_parameters()}
    h = hidden.clone().requires_grad_(True)
    nll = reference_nll(params, h, targets, cutoffs, div_val)
    (nll * weights).sum().backward()
    # A parameter no target reaches (a batch of only ignored targets) gets a zero gradient.
    return nll.detach(), h.grad, {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in params.items()}


def assert_results_equal(got, want, atol):
    (nll, gh, gp), (want_nll, want_gh, want_gp) = got, want
    torch.testing.assert_close(nll, want_nll, rtol=0, atol=atol)
    torch.testing.assert_close(gh, want_gh, rtol=0, atol=atol)
    assert gp.keys() == want_gp.keys()
    for name in want_gp:
        torch.testing.assert_close(gp[name], want_gp[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("cutoffs,div_val,d_embed,d_proj", SETTINGS, ids=IDS)
@pytest.mark.parametrize("planned", [True, False], ids=["plan", "noplan"])
@pytest.mark.parametrize("tiles", [(5, 7), (chunked_nll.CHUNK_ROWS, chunked_nll.CHUNK_COLS)],
                         ids=["small-tiles", "default-tiles"])
def test_chunked_nll_and_gradients_equal_the_float64_reference(cutoffs, div_val, d_embed, d_proj, planned, tiles,
                                                               monkeypatch):
    """Small tiles: 5 rows of the head at a time over 24, 7 columns of a tail at a time over 20 and 30."""
    monkeypatch.setattr(chunked_nll, "CHUNK_ROWS", tiles[0])
    monkeypatch.setattr(chunked_nll, "CHUNK_COLS", tiles[1])
    head = make_head(cutoffs, div_val, d_embed, d_proj)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 6, d_proj, generator=g, dtype=torch.float64)
    targets = sample_targets(cutoffs, (4, 6), seed=2)
    weights = torch.rand(4, 6, generator=g, dtype=torch.float64) + 0.5
    plan = tail_plan(targets, cutoffs, V) if planned else None

    got = head_result(head, hidden, targets, weights, plan)
    assert_results_equal(got, reference_result(head, hidden, targets, weights, cutoffs, div_val), atol=1e-12)
    assert (got[0][targets == -100] == 0).all() and (got[0][targets >= 0] > 0).all()


@pytest.mark.parametrize("div_val", [1, 2])
def test_a_tail_cluster_with_no_target_and_a_batch_of_only_ignored_targets(div_val):
    """The plan gives the empty cluster 64 padding rows: they change neither the NLL nor any gradient."""
    cutoffs = [10, 30]
    head = make_head(cutoffs, div_val, 16, 16)
    hidden = torch.randn(2, 5, 16, dtype=torch.float64)
    weights = torch.ones(2, 5, dtype=torch.float64)
    for targets in (torch.tensor([[1, 5, 40, -100, 59], [0, 31, 9, 45, 2]]), torch.full((2, 5), -100)):
        plan = tail_plan(targets, cutoffs, V)
        got = head_result(head, hidden, targets, weights, plan)
        assert_results_equal(got, reference_result(head, hidden, targets, weights, cutoffs, div_val), atol=1e-12)
    assert (got[0] == 0).all()


@pytest.mark.parametrize("cutoffs,div_val,d_embed,d_proj", SETTINGS, ids=IDS)
def test_padding_the_head_to_64_columns_changes_nothing(cutoffs, div_val, d_embed, d_proj, monkeypatch):
    """Zero weights and bias -inf in the padding columns: the NLL and every gradient equal the unpadded head's in
    float64 to 1e-14 (measured: 1.8e-15 at most, a few ulps; not bit for bit, because logsumexp's vectorised sum
    adds a longer row in another order, exp(-inf) = 0 terms included)."""
    monkeypatch.setattr(chunked_nll, "CHUNK_ROWS", 5)
    head = make_head(cutoffs, div_val, d_embed, d_proj)
    width = clusters(cutoffs)[0][1] + len(cutoffs)
    assert head.layout.head_cols % 64 == 0 and head.layout.head_cols - width in range(1, 64)
    hidden = torch.randn(4, 6, d_proj, dtype=torch.float64)
    targets = sample_targets(cutoffs, (4, 6), seed=3)
    weights = torch.rand(4, 6, dtype=torch.float64)
    plan = tail_plan(targets, cutoffs, V)
    padded = head_result(head, hidden, targets, weights, plan)
    head.layout = dataclasses.replace(head.layout, head_cols=width)
    assert_results_equal(padded, head_result(head, hidden, targets, weights, plan), atol=1e-14)


def test_a_plan_from_other_targets_is_refused():
    """A plan that does not match the targets would train on a wrong loss: the head's device-side check stops it
    (on a GPU at the next sync, here at once)."""
    head = make_head([10, 30], 1, 16, 16)
    hidden = torch.randn(2, 5, 16, dtype=torch.float64)
    targets = sample_targets([10, 30], (2, 5), seed=4)
    shifted = torch.roll(targets, 1, dims=1)
    with pytest.raises(RuntimeError, match="tail plan does not match"):
        head(hidden, targets, want_logprobs=False, plan=tail_plan(shifted, [10, 30], V))
    with pytest.raises(ValueError, match="tail plan for clusters"):
        head(hidden, targets, want_logprobs=False, plan=tail_plan(targets, [10, 40], V))


class OpCensus(TorchDispatchMode):
    """Every aten op dispatched while active: (op, its name, whether it copies across devices, its output's shape).
    Holds no tensor: a reference kept here would make autograd copy a gradient it could otherwise take as is."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        crosses = isinstance(out, torch.Tensor) and bool(devices - {out.device})
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        self.ops.append((func, func.overloadpacket.__name__, crosses, shape))
        return out


# Ops that make the host wait for the device: data-dependent output sizes, reading a value back, and tensors made
# from Python data (torch.tensor(list, device=cuda) is a host-to-device copy).
SYNCING = {"nonzero", "masked_select", "unique", "_unique2", "_local_scalar_dense", "item", "is_nonzero", "equal",
           "lift_fresh", "lift_fresh_copy", "nonzero_static"}


def syncs(census):
    """The ops of a census that would sync on a GPU: SYNCING ones, and copies between devices."""
    return [name for _, name, crosses, _ in census.ops if name in SYNCING or crosses]


@pytest.mark.parametrize("div_val", [1, 2])
def test_no_host_sync_in_the_training_nll_with_a_plan(div_val):
    """Forward and backward of the chunked NLL with a plan dispatch no syncing op; without a plan the census sees
    the fallback's one nonzero per tail cluster (so it would see one anywhere)."""
    cutoffs = [10, 30]
    head = make_head(cutoffs, div_val, 16, 16)
    hidden = torch.randn(3, 8, 16, dtype=torch.float64, requires_grad=True)
    targets = sample_targets(cutoffs, (3, 8), seed=5)
    for plan, want in ((tail_plan(targets, cutoffs, V), []), (None, ["nonzero", "nonzero"])):
        with OpCensus() as census:
            nll, _ = head(hidden, targets, want_logprobs=False, plan=plan)
            nll.sum().backward()
        assert syncs(census) == want


def test_the_tied_table_gradient_is_written_once():
    """With one table tied to the embedding (div_val 1), the head's backward makes one tensor of the table's shape
    (its gradient buffer; every cluster writes its own rows of it), where the full path makes one per cluster
    (slice_backward, zero-filled) plus the sums. Counted: ops that are not views whose output has the table's
    shape [V, W]; the embedding's own gradient is not in this graph."""
    cutoffs = [10, 30]
    emb = AdaptiveEmbedding(V, 16, 16, cutoffs, 1, init_std=0.02).double()
    head = make_head(cutoffs, 1, 16, 16)
    head.tie_to(emb)
    table = emb.tables[0].weight
    hidden = torch.randn(3, 8, 16, dtype=torch.float64)
    targets = sample_targets(cutoffs, (3, 8), seed=6)
    counts, grads = {}, {}
    for kind in ("full", "chunked"):
        head.head_loss = kind
        table.grad = None
        nll, _ = head(hidden, targets, want_logprobs=False, plan=tail_plan(targets, cutoffs, V))
        with OpCensus() as census:
            nll.sum().backward()
        counts[kind] = [name for func, name, _, shape in census.ops if shape == table.shape and not func.is_view]
        grads[kind] = table.grad
    assert len(counts["full"]) == 5, counts  # 3 slice_backward (head, 2 tails) + 2 adds
    assert len(counts["chunked"]) == 1, counts
    ones = torch.ones(targets.shape, dtype=torch.float64)
    want = reference_result(head, hidden, targets, ones, cutoffs, 1)[2]["weight0"]
    torch.testing.assert_close(grads["chunked"], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(grads["full"], want, rtol=1e-5, atol=1e-6)  # the full path's softmax is fp32
