"""The Triton relative-attention kernels (models/attention_triton.py) against FlexAttention and the einsum path, one
layer's attention at the model's shape, on one GPU.

    python bench/benchmarks/bench_triton_attention.py --out $OUT            # aligned shape, bf16, 64 lanes (H100)
    python bench/benchmarks/bench_triton_attention.py --lanes 2 --n 24 --mem 40 --heads 2 --d-head 16 \
        --blocks 16:4 --dtype fp32 --out /tmp/t                               # CPU smoke run (TRITON_INTERPRET=1)

Per kernel choice (tile size : warps), Transformer-XL's layout (N queries over M + N keys, memory full): the
largest error against `attend` computed in fp32 from the same inputs (context and every gradient, relative to the
reference's largest entry), then the forward and forward + backward times (triton.testing.do_bench medians, ms).
Then FlexAttention (`flex_attend`, compiled, mask from `flex_mask`) and the einsum path at the same inputs, and
LaMemo's look-ahead (sign -1, lognorm gradient) with the first choice. Results: OUT/triton_attention.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

from memlm.bench.interrupt import stop_in_one_line
from memlm.models import attention_triton
from memlm.models.attention import attend, causal_allowed, causal_index
from memlm.models.lamemo import lookahead_layout

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed(fn, device) -> float:
    """Median ms of fn (do_bench on a GPU; a few wall-clock runs elsewhere)."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=60)
    start = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - start) / 2 * 1e3


def make_inputs(B, Q, K, H, E, P, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    kv = draw(B, K, 2, H, E).requires_grad_()  # k, v strided as the model's projection gives them
    q, r_k = draw(B, Q, H, E).requires_grad_(), draw(P, H, E).requires_grad_()
    u = torch.randn(H, E, generator=gen).to(device).requires_grad_()  # fp32 biases, as under autocast
    w = torch.randn(H, E, generator=gen).to(device).requires_grad_()
    return q, kv, r_k, u, w


def forward_backward(fn, leaves, want_lognorm):
    """(fwd closure, fwd+bwd closure) for fn(q, k, v, r_k, u, w) -> (context, lognorm)."""
    q, kv, r_k, u, w = leaves
    k, v = kv.unbind(dim=2)
    context, lognorm = fn(q, k, v, r_k, u, w)
    gen = torch.Generator().manual_seed(99)  # the same output gradients for every path compared
    g_context = torch.randn(context.shape, generator=gen).to(context.device, context.dtype)
    g_lognorm = torch.randn(lognorm.shape, generator=gen).to(lognorm.device) if want_lognorm else None

    def forward():
        with torch.no_grad():
            fn(q, k, v, r_k, u, w)

    def both():
        kk, vv = kv.unbind(dim=2)
        c, ln = fn(q, kk, vv, r_k, u, w)
        outs, grads = [c], [g_context]
        if want_lognorm:
            outs.append(ln)
            grads.append(g_lognorm)
        torch.autograd.grad(outs, (q, kv, r_k, u, w), grads)

    def gradients():
        kk, vv = kv.unbind(dim=2)
        c, ln = fn(q, kk, vv, r_k, u, w)
        outs, grads = [c.float()], [g_context.float()]
        if want_lognorm:
            outs.append(ln.float())
            grads.append(g_lognorm.float())
        names = ("q", "kv", "r_k", "bias_u", "bias_v")
        return {"context": c, **dict(zip(names, torch.autograd.grad(outs, (q, kv, r_k, u, w), grads)))}

    return forward, both, gradients


def worst_error(got: dict, want: dict) -> dict:
    return {n: float((got[n].detach().double() - want[n].detach().double()).abs().max()
                     / want[n].detach().double().abs().max().clamp(min=1e-30)) for n in want}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lanes", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-head", type=int, default=64)
    parser.add_argument("--n", type=int, default=150)
    parser.add_argument("--mem", type=int, default=150)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--blocks", default="32:4,64:4,64:8", help="tile:warps choices, the first also for LaMemo")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--out", default="bench/results/triton_attention")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype]
    B, H, E, N, M = args.lanes, args.heads, args.d_head, args.n, args.mem
    Q, K = N, M + N
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "triton": __import__("triton").__version__, "shape": dict(B=B, H=H, E=E, Q=Q, K=K),
              "dtype": args.dtype, "triton_runs": [], "errors": []}

    def save():
        (out / "triton_attention.json").write_text(json.dumps(result, indent=1))

    mem_valid = torch.ones(B, M, dtype=torch.bool, device=device)
    structure = causal_allowed(N, M, torch.ones(1, M, dtype=torch.bool, device=device), False)[0]
    key_valid = torch.cat([mem_valid, torch.ones(B, N, dtype=torch.bool, device=device)], dim=1)
    allowed = causal_allowed(N, M, mem_valid, False)
    index = causal_index(N, M, device)
    leaves = make_inputs(B, Q, K, H, E, M + N, dtype, device)

    # The reference: attend in fp32 from the same (rounded) inputs.
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    _, _, ref_grads = forward_backward(
        lambda q, k, v, r, u, w: attend(q, k, v, r, index, allowed, u, w, nn.Identity()), ref_leaves, True)
    want = ref_grads()

    for choice in args.blocks.split(","):
        block, warps = (int(x) for x in choice.split(":"))
        try:
            for name in attention_triton.LAUNCH:
                attention_triton.LAUNCH[name]["num_warps"] = warps
            start = time.perf_counter()
            layout = attention_triton.triton_layout(structure, key_valid, block, block)
            if device == "cuda":
                torch.cuda.synchronize()
            layout_ms = timed(lambda: attention_triton.triton_layout(structure, key_valid, block, block), device)

            def fn(q, k, v, r, u, w, layout=layout):
                return attention_triton.rel_attend_triton(q, k, v, r, u, w, None, None, M, 1, True, layout=layout)

            forward, both, gradients = forward_backward(fn, leaves, True)
            errors = worst_error(gradients(), want)
            compiled_s = time.perf_counter() - start
            fwd_ms, both_ms = timed(forward, device), timed(both, device)
            run = dict(block=block, warps=warps, fwd_ms=fwd_ms, fwd_bwd_ms=both_ms, bwd_ms=both_ms - fwd_ms,
                       layout_ms=layout_ms, first_call_s=compiled_s, max_rel_error=errors)
        except Exception as exc:  # one choice failing must not cost the others
            run = dict(block=block, warps=warps, failed=repr(exc)[-2000:])
            traceback.print_exc()
        result["triton_runs"].append(run)
        print(json.dumps(run), flush=True)
        save()

    baselines = {"einsum": lambda q, k, v, r, u, w: attend(q, k, v, r, index, allowed, u, w, nn.Identity(),
                                                          need_lognorm=False)}
    if device == "cuda" and not args.no_flex:
        from memlm.models.attention_flex import flex_attend, flex_mask

        mask = flex_mask(allowed, B)
        baselines["flex"] = lambda q, k, v, r, u, w: flex_attend(q, k, v, r, index, mask, u, w, need_lognorm=False)
    for name, fn in baselines.items():
        try:
            start = time.perf_counter()
            def under_autocast(*a, fn=fn):  # bf16 activations beside fp32 biases, as in the model's step
                with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                    return fn(*a)[0], None

            forward, both, _ = forward_backward(under_autocast, leaves, False)
            both()
            first = time.perf_counter() - start
            fwd_ms, both_ms = timed(forward, device), timed(both, device)
            result[name] = dict(fwd_ms=fwd_ms, fwd_bwd_ms=both_ms, bwd_ms=both_ms - fwd_ms, first_call_s=first)
        except Exception as exc:
            result[name] = dict(failed=repr(exc)[-2000:])
            traceback.print_exc()
        print(name, json.dumps(result[name]), flush=True)
        save()

    # LaMemo's look-ahead: M memory queries over a window of W = min(M, N) keys, sign -1, lognorm's gradient used.
    try:
        block, warps = (int(x) for x in args.blocks.split(",")[0].split(":"))
        for name in attention_triton.LAUNCH:
            attention_triton.LAUNCH[name]["num_warps"] = warps
        key_valid_all = torch.ones(B, M + N, dtype=torch.bool, device=device)
        start_key, allowed_ahead, index_ahead = lookahead_layout(M, N, key_valid_all)
        W = M + 1 - start_key
        ahead = make_inputs(B, M, W, H, E, M, dtype, device, seed=1)
        layout = attention_triton.triton_layout(allowed_ahead[0], key_valid_all[:, start_key:M + 1], block, block)

        def fn_ahead(q, k, v, r, u, w):
            return attention_triton.rel_attend_triton(q, k, v, r, u, w, None, None, start_key - 1, -1, True,
                                                      layout=layout)

        forward, both, gradients = forward_backward(fn_ahead, ahead, True)
        ref = [t.detach().float().requires_grad_() for t in ahead]
        _, _, ref_grads = forward_backward(
            lambda q, k, v, r, u, w: attend(q, k, v, r, index_ahead, allowed_ahead, u, w, nn.Identity()), ref, True)
        result["lamemo_ahead"] = dict(block=block, warps=warps, max_rel_error=worst_error(gradients(), ref_grads()),
                                      fwd_ms=timed(forward, device), fwd_bwd_ms=timed(both, device))
    except Exception as exc:
        result["lamemo_ahead"] = dict(failed=repr(exc)[-2000:])
        traceback.print_exc()
    print("lamemo_ahead", json.dumps(result["lamemo_ahead"]), flush=True)
    save()


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
