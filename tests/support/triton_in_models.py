"""Run by tests/models/test_triton_in_models.py in a fresh process, with TRITON_INTERPRET=1 on a CPU (Triton decides
between interpreter and compiler when it is first imported) or compiled on a GPU (argument `cuda`): every arch
whose layouts the Triton kernels cover, built with `attention: triton` and with `attention: eager` from the same
weights, over segments with resets; the losses and every parameter's gradient must agree in fp32 (tf32 off).
Prints one line per case; exits 1 on the first disagreement."""

import sys

import torch

from memlm.models import build_model
from support.models import tiny_model_config

# One case per way an arch builds its layouts (the ∞-former builds Transformer-XL's; each interpreted case takes
# about 4 s, and the kernels' own layouts are tested in test_attention_triton.py).
CASES = {
    "txl-same-length": dict(arch="txl", same_length=True),
    "lamemo-long-memory": dict(arch="lamemo", mem_len=6, tgt_len=4),  # M > N: the look-ahead's per-key positions
    "rmt-cache": dict(arch="rmt", num_mem_tokens=2, read_mem_from_cache=True),
    "compressive": dict(arch="compressive", compressed_len=4, compression_rate=2),
    "armt": dict(arch="armt", mem_len=0, num_mem_tokens=2, assoc_dim=3),
}


CALLS = {"n": 0}


def counted(kernel):
    """`attend` imports the kernel's entry when it calls it: wrapped here, the calls that reach it are counted (a
    model that silently took the einsum path would agree with itself)."""
    def call(*args, **kwargs):
        CALLS["n"] += 1
        return kernel(*args, **kwargs)
    return call


def run(model, tokens, resets):
    """Losses and the memory over the segments; backward of their sum."""
    N = model.cfg.tgt_len
    memory = model.init_memory(tokens.shape[0], device=tokens.device)
    total = 0.0
    for s in range(tokens.shape[1] // N - 1):
        seq = tokens[:, s * N : (s + 1) * N + 1]
        out = model(seq[:, :-1], memory, reset=resets[s], targets=seq[:, 1:])
        total = total + out.nll.sum() + (out.aux_loss if out.aux_loss is not None else 0.0)
        memory = out.memory.detached()
    total.backward()
    return total.detach()


def main(device: str) -> int:
    import memlm.models.attention_triton as attention_triton

    torch.backends.cuda.matmul.allow_tf32 = False  # the kernels' fp32 products follow torch's choice

    attention_triton.rel_attend_triton = counted(attention_triton.rel_attend_triton)
    for name, fields in CASES.items():
        torch.manual_seed(0)
        cfg = tiny_model_config(**{"dropout": 0.0, **fields, "attention": "eager"})
        eager = build_model(cfg).to(device).train()
        triton = build_model(tiny_model_config(**{"dropout": 0.0, **fields, "attention": "triton"})).to(device).train()
        triton.load_state_dict(eager.state_dict())
        N = cfg.tgt_len
        tokens = torch.randint(0, cfg.vocab_size, (3, 3 * N + 1), generator=torch.Generator().manual_seed(1)).to(device)
        resets = [torch.tensor([True, True, True], device=device), torch.tensor([False, True, False], device=device)]
        want, got = run(eager, tokens, resets), run(triton, tokens, resets)
        worst = 0.0
        for (pname, a), b in zip(eager.named_parameters(), triton.parameters(), strict=True):
            if a.grad is None and b.grad is None:
                continue
            scale = a.grad.abs().max().clamp(min=1e-12)
            worst = max(worst, float((b.grad - a.grad).abs().max() / scale))
        loss_err = abs(float(got - want)) / abs(float(want))
        print(f"{name}: loss {float(want):.6f} vs {float(got):.6f} (rel {loss_err:.1e}), worst gradient rel "
              f"{worst:.1e}, {CALLS['n']} kernel calls", flush=True)
        if CALLS["n"] == 0:
            print(f"{name}: the Triton kernels never ran", flush=True)
            return 1
        CALLS["n"] = 0
        if not (loss_err < 1e-5 and worst < 1e-4):
            print(f"{name}: the Triton kernels disagree with the einsum path", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
