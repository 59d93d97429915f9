"""The tail clusters' row plan (models/head_plan.py) against a plain loop over the targets."""

import pytest
import torch

from memlm.models.head_plan import TailPlan, tail_plan


def loop_plan(targets, cutoffs, vocab_size, multiple):
    """Per tail cluster: the flattened positions whose target is in it, then -1 up to a multiple (at least one)."""
    edges = list(cutoffs) + [vocab_size]
    flat = [int(t) for t in targets.reshape(-1)]
    plan = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        rows = [n for n, t in enumerate(flat) if lo <= t < hi]
        size = multiple
        while size < len(rows):
            size += multiple
        plan.append(rows + [-1] * (size - len(rows)))
    return plan


@pytest.mark.parametrize("multiple", [1, 8, 64])
@pytest.mark.parametrize("shape", [(3, 7), (5, 40), (1, 1)])
def test_plan_equals_a_loop_over_the_targets(multiple, shape):
    g = torch.Generator().manual_seed(sum(shape) + multiple)
    targets = torch.randint(0, 100, shape, generator=g)
    targets.view(-1)[:: 3] = -100  # ignored targets belong to no cluster
    plan = tail_plan(targets, [10, 30, 60], 100, multiple=multiple)
    assert plan.bounds == ((10, 30), (30, 60), (60, 100))
    want = loop_plan(targets, [10, 30, 60], 100, multiple)
    assert [r.tolist() for r in plan.rows] == want
    assert all(r.dtype == torch.int64 for r in plan.rows)


def test_empty_cluster_gets_one_multiple_of_padding_and_no_cutoffs_no_rows():
    targets = torch.tensor([[1, 2, 45, -100]])  # nothing in [10, 30)
    plan = tail_plan(targets, [10, 30], 50)
    assert [r.tolist() for r in plan.rows] == [[-1] * 64, [2] + [-1] * 63]
    assert tail_plan(targets, [], 50) == TailPlan((), ())


def test_to_and_pin_memory_keep_the_rows():
    targets = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(0))
    plan = tail_plan(targets, [10, 30], 50)
    moved = plan.to("cpu", non_blocking=True)
    assert moved.bounds == plan.bounds
    assert all(torch.equal(a, b) for a, b in zip(moved.rows, plan.rows))
    if torch.cuda.is_available():
        pinned = plan.pin_memory()
        assert all(r.is_pinned() and torch.equal(r, s) for r, s in zip(pinned.rows, plan.rows))


def test_a_capacity_plan_has_one_shape_while_batches_fit_and_the_next_multiple_past_it():
    """CUDA graphs replay one shape: with capacities every batch that fits plans the same lengths (static for
    torch.compile), and a batch over a capacity still gets every row (the next multiple), never loses one."""
    gen = torch.Generator().manual_seed(3)
    plans = [tail_plan(torch.randint(0, 100, (4, 16), generator=gen), [10, 30, 60], 100, multiple=8,
                       capacity=[48, 48, 48]) for _ in range(5)]
    assert {tuple(len(r) for r in p.rows) for p in plans} == {(48, 48, 48)}
    assert all(p.static for p in plans)
    crowded = torch.full((4, 16), 40)  # all 64 targets in [30, 60)
    plan = tail_plan(crowded, [10, 30, 60], 100, multiple=8, capacity=[48, 48, 48])
    assert [len(r) for r in plan.rows] == [48, 64, 48] and plan.rows[1].tolist() == list(range(64))
    want = loop_plan(crowded, [10, 30, 60], 100, 8)
    assert [r[r >= 0].tolist() for r in plan.rows] == [[n for n in w if n >= 0] for w in want]


def test_a_model_given_capacity_plans_compiles_one_static_graph():
    """The precondition of a CUDA graph over the step: one graph, static shapes (no symbolic size), no break, over
    batches whose tail row counts differ."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from memlm.models import build_model
    from support.models import tiny_model_config

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = build_model(tiny_model_config(vocab_size=300, cutoffs=[40, 120], head_loss="chunked")).train()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(
            n.meta.get("example_value", n.meta.get("val")), torch.SymInt)])
        return gm.forward

    compiled = torch.compile(model, backend=backend, dynamic=False)
    memory = model.init_memory(3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        tokens = torch.randint(0, 300, (3, model.cfg.tgt_len + 1), generator=gen)
        plan = tail_plan(tokens[:, 1:], [40, 120], 300, capacity=[64, 64])
        out = compiled(tokens[:, :-1], memory, targets=tokens[:, 1:], tail_plan=plan)
        out.nll.sum().backward()
        memory = out.memory.detached()
    assert len(graphs) == 1 and graphs[0] == [], graphs  # one graph, no symbolic size among its inputs
    assert not counters["graph_break"], dict(counters["graph_break"])
