"""The tiled softmax NLL (models/chunked_nll.py) against the plain float64 one, for every way of tiling it."""

import pytest
import torch

from memlm.models.chunked_nll import nll_backward, nll_forward

R, W, K = 11, 6, 23


def plain(x, weight, bias, index):
    """-log softmax(x @ weight.T + bias)[index], row by row."""
    return torch.stack([-torch.log_softmax(weight @ x[t] + bias, dim=0)[index[t]] for t in range(x.shape[0])])


@pytest.mark.parametrize("rows,cols", [(None, None), (4, None), (None, 5), (3, 7), (1, 1), (R, K), (50, 50)])
def test_tiles_equal_the_plain_softmax_and_its_gradients(rows, cols):
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((R, W), (K, W), (K,)))
    index = torch.randint(0, K, (R,), generator=g)
    index[0], index[1] = 0, K - 1  # both ends of the columns
    upstream = torch.rand(R, generator=g, dtype=torch.float64)

    nll, lse = nll_forward(x, weight, bias, index, rows=rows, cols=cols)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    want = plain(*leaves, index)
    torch.testing.assert_close(nll, want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(x @ weight.T + bias, dim=1), rtol=0, atol=1e-12)
    (want * upstream).sum().backward()

    # The weight's gradient in two pieces with a gap: outputs [5, 9) belong to no piece and are dropped.
    low, high = torch.full((5, W), float("nan"), dtype=torch.float64), torch.full((K - 9, W), float("nan"),
                                                                                   dtype=torch.float64)
    grad_b = torch.full((K,), float("nan"), dtype=torch.float64)
    grad_x = nll_backward(x, weight, bias, index, lse, upstream, [(0, 5, low), (9, K, high)], [(0, K, grad_b)],
                          rows=rows, cols=cols)
    torch.testing.assert_close(grad_x, leaves[0].grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([low, high]), torch.cat([leaves[1].grad[:5], leaves[1].grad[9:]]),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_b, leaves[2].grad, rtol=0, atol=1e-12)


def test_no_rows_still_writes_zero_gradients():
    """A tail cluster whose plan holds no row: its table rows get zeros, not whatever the buffer held."""
    x = torch.zeros(0, W, dtype=torch.float64)
    weight, bias = torch.randn(K, W, dtype=torch.float64), torch.randn(K, dtype=torch.float64)
    index = torch.zeros(0, dtype=torch.long)
    for rows, cols in [(None, 5), (4, None)]:
        nll, lse = nll_forward(x, weight, bias, index, rows=rows, cols=cols)
        assert nll.shape == (0,)
        grad_w, grad_b = torch.full((K, W), float("nan"), dtype=torch.float64), torch.full((K,), float("nan"),
                                                                                          dtype=torch.float64)
        grad_x = nll_backward(x, weight, bias, index, lse, nll, [(0, K, grad_w)], [(0, K, grad_b)], rows=rows,
                              cols=cols)
        assert grad_x.shape == (0, W) and (grad_w == 0).all() and (grad_b == 0).all()
