"""The chunked adaptive softmax under torch.compile: with a tail plan it compiles whole, tails included (no graph
break), and keeps one graph while the tails' row counts change from batch to batch (the plan's lengths are marked
dynamic). Without a plan the only break is the fallback that finds the rows on the device.

Captured with the aot_eager backend, as tests/models/test_compile.py does (same capture, guards and recompiles as
inductor, without its code generation).
"""

import pytest
import torch
from torch import nn

from memlm.models.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from memlm.models.head_plan import tail_plan

VOCAB, CUTOFFS, D = 300, [40, 120], 16
B, N = 4, 48  # 192 rows: tail row counts from 0 to well past 64, so the padded counts change


class TinyLM(nn.Module):
    """Embedding -> one nonlinear layer -> chunked adaptive softmax: the head's place in a model. With one table
    (div_val 1) the adaptive embedding, tied; with a table per cluster a plain embedding, because the adaptive one
    still finds each cluster's tokens with `nonzero` (a break of its own, not this test's subject)."""

    def __init__(self, div_val):
        super().__init__()
        if div_val == 1:
            self.embed = AdaptiveEmbedding(VOCAB, D, D, CUTOFFS, div_val, init_std=0.1)
        else:
            self.embed = nn.Embedding(VOCAB, D)
        self.layer = nn.Linear(D, D)
        self.head = AdaptiveLogSoftmax(VOCAB, D, D, CUTOFFS, div_val, init_std=0.1, head_loss="chunked")
        if div_val == 1:
            self.head.tie_to(self.embed)

    def forward(self, tokens, targets, plan=None):
        return self.head(torch.tanh(self.layer(self.embed(tokens))), targets, False, plan=plan)[0]


def batches():
    """8 batches whose targets spread differently over the clusters: all in the head, mostly in a tail, mixed."""
    gen = torch.Generator().manual_seed(1)
    for top in (VOCAB, 40, VOCAB, 130, 60, VOCAB, 250, 121):
        targets = torch.randint(0, top, (B, N), generator=gen)
        targets[0, :3] = -100
        yield torch.randint(0, VOCAB, (B, N), generator=gen), targets


def step(model, tokens, targets, plan):
    model.zero_grad(set_to_none=True)
    nll = model(tokens, targets, plan=plan)
    nll.sum().backward()
    return nll.detach(), [p.grad.clone() for p in model.parameters()]


def run_compiled(div_val, planned):
    """(graphs captured after each batch, graph-break reasons, tail row counts per batch); compiled = eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    # float64: compiled and eager may sum an embedding row's contributions in another order (aot decomposes the
    # embedding's backward; torch 2.11's CPU kernels disagreed at 1e-6 in fp32), and the subject is the capture
    model = TinyLM(div_val).double()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    graphs, counts = [], []
    for tokens, targets in batches():
        plan = tail_plan(targets, CUTOFFS, VOCAB) if planned else None
        got = step(compiled, tokens, targets, plan)
        want = step(model, tokens, targets, None)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        for (name, _), g, w in zip(model.named_parameters(), got[1], want[1], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)
        graphs.append(int(counters["stats"]["unique_graphs"]))
        counts.append([int(((targets >= lo) & (targets < hi)).sum()) for lo, hi in zip(CUTOFFS, CUTOFFS[1:] + [VOCAB])])
    return graphs, list(counters["graph_break"]), counts


@pytest.mark.slow
@pytest.mark.parametrize("div_val", [1, 2])
def test_with_a_plan_the_head_compiles_whole_and_once(div_val):
    graphs, breaks, counts = run_compiled(div_val, planned=True)
    padded = {tuple(max(64, -(-n // 64) * 64) for n in c) for c in counts}
    assert len(padded) >= 4 and any(0 in c for c in counts), counts  # the batches do vary, and one tail is empty
    assert not breaks, breaks
    assert graphs == [graphs[0]] * len(graphs), graphs  # nothing captured after the first batch


def test_without_a_plan_the_only_break_is_finding_the_rows():
    graphs, breaks, _ = run_compiled(1, planned=False)
    assert breaks and all("_find_tail_nll_rows" in reason for reason in breaks), breaks
    assert graphs[1:] == [graphs[1]] * (len(graphs) - 1), graphs  # nothing captured after the second batch
