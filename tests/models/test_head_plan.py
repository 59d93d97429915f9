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
