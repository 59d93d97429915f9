"""The Triton relative-attention kernels (models/attention_triton.py) against two references: a slow float64 one
written here from the score's definition, and `attention.attend` (the einsum path) with the callers' own position
indices, for Transformer-XL's causal layout, RMT's blocks and LaMemo's look-ahead.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before they are imported), in fp32
and fp16: the interpreter's bf16 products are not bf16 products, so bf16 is checked on a GPU only (the tests
marked gpu_only). Every output buffer the kernels write whole is filled with NaN first (`_poisoned`), so a missed
element shows. Shapes are tiny (tiles of 16) so that several tiles, skipped tiles and partial tiles all occur.
"""

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

# `-m 'not slow'` leaves these out: fresh processes that compile Triton kernels, 74 s in all on 2 busy cores
pytestmark = pytest.mark.slow

CUDA = torch.cuda.is_available()


def _import_kernels():
    """models.attention_triton, and whether its kernels can run here: compiled on a GPU, else interpreted.

    Triton picks interpreter or compiler when a function is decorated, its own library functions (tl.max, ...)
    included, i.e. when triton is first imported. So TRITON_INTERPRET is set around that import when this module
    is the first to import triton (and stays set); in a pytest process where another module imported triton before
    (the whole suite does), the kernels cannot run in this process and `test_in_a_fresh_process` runs them in a
    new one."""
    if CUDA:
        pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
        return importlib.import_module("memlm.models.attention_triton"), True
    if "triton" not in sys.modules:
        # Left set: Triton decorates some of its own modules lazily, during a launch, and checks the variable then.
        # Nothing else on a CPU runs Triton kernels.
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    import triton.language as tl

    module = importlib.import_module("memlm.models.attention_triton")
    interpreted = type(tl.max).__name__ == "InterpretedFunction"
    return module, interpreted and module._interpreted()


attention_triton, RUNS_HERE = _import_kernels()
kernels_here = pytest.mark.skipif(not RUNS_HERE, reason="triton was imported before TRITON_INTERPRET could be set; "
                                  "test_in_a_fresh_process runs this test")

from memlm.models.attention import attend, causal_allowed, causal_index  # noqa: E402
from memlm.models.lamemo import lookahead_layout  # noqa: E402
from memlm.models.rmt import rmt_allowed, rmt_positions  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="bf16 products need a GPU (the interpreter's are not bf16)")


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    def nan_filled(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(attention_triton, "_empty", nan_filled)


# --- the slow reference: the score's definition, float64, one (i, j) pair at a time through explicit indices ---

def slow_attention(q, k, v, r_k, bias_u, bias_v, structure, key_valid, offset, sign):
    """score(i, j) = [(q_i + u) . k_j + (q_i + v) . R[offset + sign (i - j)]] / sqrt(E) over allowed(b, i, j) =
    structure[i, j] & key_valid[b, j]; softmax over j; context = sum_j p v_j; lognorm = log sum_j exp score.
    Inputs [B, Q, H, E], [B, K, H, E] x2, [P, H, E], [H, E] x2 (any float dtype, computed in float64)."""
    q, k, v, r_k, bias_u, bias_v = (t.double() for t in (q, k, v, r_k, bias_u, bias_v))
    B, Q, H, E = q.shape
    K, P = k.shape[1], r_k.shape[0]
    i = torch.arange(Q, device=q.device)[:, None]
    j = torch.arange(K, device=q.device)[None, :]
    slot = offset + sign * (i - j)  # [Q, K]
    allowed = structure[None] & key_valid[:, None, :]  # [B, Q, K]
    assert allowed.any(-1).all(), "every query row must have an allowed key"
    assert ((slot >= 0) & (slot < P))[allowed.any(0)].all(), "an allowed pair reads a slot outside r_k"
    r_pair = r_k[slot.clamp(0, P - 1)]  # [Q, K, H, E] the encoding each pair reads
    content = torch.einsum("bqhe,bkhe->bhqk", q + bias_u, k)
    position = torch.einsum("bqhe,qkhe->bhqk", q + bias_v, r_pair)
    scores = ((content + position) / math.sqrt(E)).masked_fill(~allowed[:, None], float("-inf"))
    lognorm = torch.logsumexp(scores, dim=-1)  # [B, H, Q]
    probs = torch.exp(scores - lognorm[..., None])
    context = torch.einsum("bhqk,bkhe->bqhe", probs, v)
    return context, lognorm.transpose(1, 2)


# --- helpers -------------------------------------------------------------------------------------------------

def _inputs(B, Q, K, H, E, P, seed, dtype=torch.float32):
    """Fresh random q, k, v, r_k, bias_u, bias_v (leaves, requiring grad). k and v are the two halves of one
    [B, K, 2, H, E] projection, as `RelativeAttention.project` returns them (strided, not contiguous)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    kv = draw(B, K, 2, H, E).requires_grad_()
    k, v = kv.unbind(dim=2)
    leaves = [draw(B, Q, H, E), draw(P, H, E), draw(H, E).float(), draw(H, E).float()]
    q, r_k, bias_u, bias_v = (t.requires_grad_() for t in leaves)
    return q, kv, k, v, r_k, bias_u, bias_v


def _run(fn, q, kv, k, v, r_k, bias_u, bias_v, seed):
    """context, lognorm, and the gradients of a random linear loss of both w.r.t. q, k, v, r_k, bias_u, bias_v."""
    context, lognorm = fn(q, k, v, r_k, bias_u, bias_v)
    gen = torch.Generator().manual_seed(seed + 1000)
    w_context = torch.randn(context.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    w_lognorm = torch.randn(lognorm.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    loss = (context.double() * w_context).sum() + (lognorm.double() * w_lognorm).sum()
    d_q, d_kv, d_r, d_u, d_w = torch.autograd.grad(loss, (q, kv, r_k, bias_u, bias_v))
    d_k, d_v = d_kv.unbind(dim=2)
    return {"context": context, "lognorm": lognorm, "q": d_q, "k": d_k, "v": d_v, "r_k": d_r, "bias_u": d_u,
            "bias_v": d_w}


def _assert_close(got: dict, want: dict, tol: float):
    """Each output within tol of the reference, relative to the reference's largest entry (gradients sum many
    terms of both signs, so an entry-wise relative error means little near zero)."""
    for name, ref in want.items():
        value = got[name]
        assert value.shape == ref.shape, name
        assert torch.isfinite(value).all(), f"{name}: non-finite entries (an element left unwritten?)"
        err = (value.double() - ref.double()).abs().max().item()
        scale = ref.double().abs().max().item()
        assert err <= tol * scale, f"{name}: max error {err:.3g} against max {scale:.3g} (tol {tol})"


def _check(layout, seed, dtype=torch.float32, tol=2e-5, block=16, attend_index=None, E=16):
    """The kernels against the slow reference (and against `attend` with the caller's index, when given) for one
    layout: dict(B, Q, K, H, P, structure [Q, K], key_valid [B, K], offset, sign)."""
    B, Q, K, H, P = (layout[n] for n in ("B", "Q", "K", "H", "P"))
    structure, key_valid = layout["structure"].to(DEVICE), layout["key_valid"].to(DEVICE)
    offset, sign = layout["offset"], layout["sign"]
    tensors = _inputs(B, Q, K, H, E, P, seed, dtype)

    def triton_fn(q, k, v, r_k, u, w):
        return attention_triton.rel_attend_triton(q, k, v, r_k, u, w, structure, key_valid, offset, sign, True,
                                                  block_q=block, block_k=block)

    def slow_fn(q, k, v, r_k, u, w):
        return slow_attention(q, k, v, r_k, u, w, structure, key_valid, offset, sign)

    got = _run(triton_fn, *tensors, seed)
    want = _run(slow_fn, *tensors, seed)
    _assert_close(got, want, tol)
    if attend_index is not None:
        allowed = structure[None] & key_valid[:, None, :]

        def einsum_fn(q, k, v, r_k, u, w):
            return attend(q, k, v, r_k, attend_index.to(DEVICE), allowed, u, w, nn.Identity())

        _assert_close(got, _run(einsum_fn, *tensors, seed), tol)
    return got


def _txl_layout(B, N, M, same_length, mem_valid):
    structure = causal_allowed(N, M, torch.ones(1, M, dtype=torch.bool), same_length)[0]
    key_valid = torch.cat([mem_valid, torch.ones(B, N, dtype=torch.bool)], dim=1)
    return dict(B=B, Q=N, K=M + N, H=2, P=M + N, structure=structure, key_valid=key_valid, offset=M, sign=1)


def _memory_validity(B, M):
    """Lane 0 full, lane 1 empty (a reset), lane 2 (if any) only its last 5 slots: whole tiles of lanes 1 and 2
    are skipped, and lane 2's first live tile is partly masked."""
    rows = [[True] * M, [False] * M, [False] * (M - 5) + [True] * 5]
    return torch.tensor(rows[:B])


# --- the three callers' layouts ------------------------------------------------------------------------------

@kernels_here
@pytest.mark.parametrize("same_length", [False, True], ids=["causal", "same_length"])
def test_transformer_xl_causal_layout_with_memory(same_length):
    B, N, M = 3, 24, 40
    layout = _txl_layout(B, N, M, same_length, _memory_validity(B, M))
    # The einsum path's index clamps future keys to slot 0 (masked there); the kernel reads M + i - j directly.
    _check(layout, seed=1 + same_length, attend_index=causal_index(N, M, "cpu"))


@kernels_here
def test_transformer_xl_without_memory():
    layout = _txl_layout(2, 40, 0, False, torch.zeros(2, 0, dtype=torch.bool))
    _check(layout, seed=3, attend_index=causal_index(40, 0, "cpu"))


@kernels_here
@pytest.mark.parametrize("read_mem_from_cache", [False, True], ids=["memory_rows_skip_cache", "read_cache"])
def test_rmt_layout(read_mem_from_cache):
    """[read R | tokens N | write R] queries over [cache M | same] keys, signed distances offset M + R - 1; head
    width 24 pads to 32 inside the kernel."""
    B, R, N, M = 2, 3, 16, 20
    distances, index = rmt_positions(R, N, M, "cpu")
    cache_valid = torch.tensor([[True] * M, [False] * 12 + [True] * (M - 12)])
    structure = rmt_allowed(R, N, torch.ones(1, M, dtype=torch.bool), False, read_mem_from_cache)[0]
    Q, K = 2 * R + N, M + 2 * R + N
    key_valid = torch.cat([cache_valid, torch.ones(B, 2 * R + N, dtype=torch.bool)], dim=1)
    layout = dict(B=B, Q=Q, K=K, H=2, P=len(distances), structure=structure, key_valid=key_valid,
                  offset=M + R - 1, sign=1)
    _check(layout, seed=4 + read_mem_from_cache, attend_index=index, E=24)


@kernels_here
def test_lamemo_lookahead_layout():
    """Memory queries look ahead at the window [start, M]: slot (start + j) - i - 1, i.e. offset start - 1 and
    sign -1, distances 1..M in P = M slots."""
    B, M, N = 2, 40, 24
    mem_valid = torch.tensor([[True] * M, [False] * 30 + [True] * (M - 30)])
    key_valid_all = torch.cat([mem_valid, torch.ones(B, N, dtype=torch.bool)], dim=1)
    start, allowed, index = lookahead_layout(M, N, key_valid_all)
    structure = lookahead_layout(M, N, torch.ones(1, M + N, dtype=torch.bool))[1][0]
    window_valid = key_valid_all[:, start : M + 1]
    # Memory rows with no valid key to their right are masked whole by LaMemo's caller; here every row needs one.
    assert allowed.any(-1).all()
    layout = dict(B=B, Q=M, K=M + 1 - start, H=2, P=M, structure=structure, key_valid=window_valid,
                  offset=start - 1, sign=-1)
    _check(layout, seed=6, attend_index=index)


@kernels_here
def test_fp16_products():
    """fp16 q, k, v, r_k (fp32 biases, as under autocast): products in fp16, accumulation in fp32."""
    B, N, M = 2, 24, 40
    layout = _txl_layout(B, N, M, False, _memory_validity(B, M))
    _check(layout, seed=7, dtype=torch.float16, tol=4e-3)


# --- the wrapper's contract ----------------------------------------------------------------------------------

@kernels_here
def test_no_lognorm_when_not_asked_and_a_shared_layout_gives_the_same():
    B, N, M, H, E = 2, 20, 20, 2, 16
    layout = _txl_layout(B, N, M, False, _memory_validity(B, M))
    structure, key_valid = layout["structure"].to(DEVICE), layout["key_valid"].to(DEVICE)
    q, kv, k, v, r_k, u, w = _inputs(B, N, M + N, H, E, M + N, seed=8)
    context, lognorm = attention_triton.rel_attend_triton(q, k, v, r_k, u, w, structure, key_valid, M, 1, False,
                                                          block_q=16, block_k=16)
    assert lognorm is None
    shared = attention_triton.triton_layout(structure, key_valid, 16, 16)
    again, _ = attention_triton.rel_attend_triton(q, k, v, r_k, u, w, None, None, M, 1, False, layout=shared)
    assert torch.equal(context, again)
    want, _ = slow_attention(q, k, v, r_k, u, w, structure, key_valid, M, 1)
    _assert_close({"context": context}, {"context": want}, 2e-5)
    grads = torch.autograd.grad(context.sum(), (q, kv, r_k, u, w))
    want_grads = torch.autograd.grad(want.sum(), (q, kv, r_k, u, w))
    for got, ref in zip(grads, want_grads):
        _assert_close({"grad": got}, {"grad": ref}, 2e-5)


def test_spans_skip_the_future_and_empty_memory():
    """Transformer-XL, N = M = 32, tiles of 16: query tile t sees key tiles 0..t+2 (memory, then causal), and a
    lane with an empty memory starts at the first segment tile."""
    N = M = 32
    layout = _txl_layout(2, N, M, False, torch.tensor([[True] * M, [False] * M]))
    spans = attention_triton.triton_layout(layout["structure"], layout["key_valid"], 16, 16)
    assert spans.q_spans.tolist() == [[[0, 3], [0, 4]], [[2, 3], [2, 4]]]
    # Key tiles: memory tiles are read by both query tiles (lane 0) or none (lane 1); segment tile 2 by both, 3 by
    # the second only.
    assert spans.k_spans.tolist() == [[[0, 2], [0, 2], [0, 2], [1, 2]], [[0, 0], [0, 0], [0, 2], [1, 2]]]


def test_arguments_are_checked():  # before any kernel runs
    layout = _txl_layout(1, 16, 0, False, torch.zeros(1, 0, dtype=torch.bool))
    q, kv, k, v, r_k, u, w = _inputs(1, 16, 16, 2, 16, 16, seed=9)
    structure, key_valid = layout["structure"].to(DEVICE), layout["key_valid"].to(DEVICE)
    with pytest.raises(ValueError, match="sign"):
        attention_triton.rel_attend_triton(q, k, v, r_k, u, w, structure, key_valid, 0, 2)
    with pytest.raises(ValueError, match="block_q must equal block_k"):
        attention_triton.rel_attend_triton(q, k, v, r_k, u, w, structure, key_valid, 0, 1, block_q=16, block_k=32)


# --- on a GPU: compiled kernels, bf16, model-sized tiles ------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_model_sized(dtype, block):
    """Head width 64 as in the models, several tiles of the real sizes; bf16 against float64 within bf16's
    rounding (inputs are rounded to bf16 first, so only the kernel's own rounding counts)."""
    B, N, M = 4, 150, 150
    mem_valid = torch.tensor([[True] * M, [False] * M, [True] * M, [False] * 70 + [True] * 80])
    layout = _txl_layout(B, N, M, False, mem_valid)
    layout["H"] = 4
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    _check(layout, seed=10, dtype=dtype, tol=tol, block=block, E=64)


@gpu_only
def test_gpu_lamemo_bf16():
    B, M, N = 2, 64, 96
    mem_valid = torch.tensor([[True] * M, [False] * 20 + [True] * (M - 20)])
    key_valid_all = torch.cat([mem_valid, torch.ones(B, N, dtype=torch.bool)], dim=1)
    start, _, _ = lookahead_layout(M, N, key_valid_all)
    structure = lookahead_layout(M, N, torch.ones(1, M + N, dtype=torch.bool))[1][0]
    layout = dict(B=B, Q=M, K=M + 1 - start, H=4, P=M, structure=structure,
                  key_valid=key_valid_all[:, start : M + 1], offset=start - 1, sign=-1)
    _check(layout, seed=11, dtype=torch.bfloat16, tol=2e-2, block=32, E=64)


# --- where triton was imported before this module: the interpreter tests in a process of their own ------------

@pytest.mark.skipif(CUDA or RUNS_HERE, reason="the kernel tests run in this process")
def test_in_a_fresh_process():
    """The tests marked kernels_here, in one new pytest process whose first triton import sees TRITON_INTERPRET=1
    (one process, not one per group: each start imports pytest, torch and triton again, 5 s on a busy machine)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-k", "not fresh_process and not gpu"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
