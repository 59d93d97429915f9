"""`memlm demo`: a short, real comparison of the memory architectures on a corpus every Python machine has.

The corpus is the standard library's own source files, read as bytes (vocabulary 256), one document per file;
a held-out tenth of the files is the evaluation split. Each architecture trains for the same wall-clock budget
on lanes of document-contiguous segments (memory reset at every new file) and is then evaluated on the held-out
files with per-document memory. This is a smoke-scale demo of the models, not the trainer: it runs in one
process with a plain torch optimizer.
"""

from __future__ import annotations

import math
import sysconfig
import time
from pathlib import Path

import torch

from models import ModelConfig, build_model

DEMO_ARCHS = {
    "transformer": dict(arch="transformer", mem_len=0),
    "txl": dict(arch="txl"),
    "lamemo": dict(arch="lamemo"),
    "rmt": dict(arch="rmt", mem_len=0, num_mem_tokens=4, bptt_depth=1),
}


def stdlib_documents(limit_bytes: int) -> tuple[list[bytes], list[bytes]]:
    """Sorted stdlib .py files as byte strings, split 9:1 into train and held-out documents."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)
    docs, total = [], 0
    for path in files:
        data = path.read_bytes()
        docs.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    held_out = docs[::10]
    train = [d for i, d in enumerate(docs) if i % 10]
    return train, held_out


def lane_batches(docs: list[bytes], lanes: int, seg_len: int):
    """Endless (tokens [B, N], targets [B, N], reset [B]) batches: each lane reads documents one after another."""
    next_doc = 0
    state = [None] * lanes  # per lane: (tensor of the document, offset)
    while True:
        tokens = torch.zeros(lanes, seg_len, dtype=torch.long)
        targets = torch.full((lanes, seg_len), -100, dtype=torch.long)
        reset = torch.zeros(lanes, dtype=torch.bool)
        for b in range(lanes):
            if state[b] is None or state[b][1] >= len(state[b][0]) - 1:
                state[b] = (torch.tensor(list(docs[next_doc % len(docs)])), 0)
                next_doc += 1
                reset[b] = True
            doc, off = state[b]
            piece = doc[off : off + seg_len + 1]
            tokens[b, : len(piece) - 1] = piece[:-1]
            targets[b, : len(piece) - 1] = piece[1:]
            state[b] = (doc, off + seg_len)
        yield tokens, targets, reset


@torch.no_grad()
def evaluate(model, docs: list[bytes], seg_len: int) -> tuple[float, int]:
    """Mean NLL (nats/byte) over every byte of the held-out documents, one document at a time."""
    model.eval()
    total, count = 0.0, 0
    for doc in docs:
        ids = torch.tensor(list(doc))[None]
        memory = model.init_memory(1)
        for s in range(0, ids.shape[1] - 1, seg_len):
            tokens = ids[:, s : s + seg_len]
            targets = ids[:, s + 1 : s + seg_len + 1]
            if targets.shape[1] < tokens.shape[1]:
                tokens = tokens[:, : targets.shape[1]]
            out = model(tokens, memory, targets=targets)
            memory = out.memory
            total += float(out.nll.sum())
            count += targets.numel()
    model.train()
    return total / count, count


def train_one(arch_options: dict, train_docs, seconds: float, seed: int) -> tuple[torch.nn.Module, int, float]:
    torch.manual_seed(seed)
    settings = dict(n_layer=2, n_head=4, d_model=128, d_head=32, d_inner=512, vocab_size=256, tgt_len=64, mem_len=64)
    cfg = ModelConfig(**{**settings, **arch_options})
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = lane_batches(train_docs, lanes=8, seg_len=cfg.tgt_len)
    memory = model.init_memory(8)
    start, steps, loss = time.perf_counter(), 0, float("nan")
    while time.perf_counter() - start < seconds:
        tokens, targets, reset = next(batches)
        out = model(tokens, memory, reset=reset, targets=targets)
        n = (targets != -100).sum().clamp(min=1)
        (out.nll.sum() / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        opt.zero_grad(set_to_none=True)
        memory = _detach(out.memory)
        loss = float(out.nll.detach().sum() / n)
        steps += 1
    return model, steps, loss


def _detach(memory):
    from models import map_memory

    return map_memory(lambda t: t.detach(), memory)


def main(args) -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train_docs, held_out = stdlib_documents(limit_bytes=4_000_000)
    budget = float(args.seconds)
    print(f"corpus: {len(train_docs)} stdlib source files for training, {len(held_out)} held out; "
          f"{budget:.0f} s of training per architecture")
    rows = []
    for name, options in DEMO_ARCHS.items():
        model, steps, loss = train_one(options, train_docs, budget, seed=0)
        nll, count = evaluate(model, held_out[:8], model.cfg.tgt_len)
        rows.append((name, steps, loss, nll, count))
        print(f"  {name:12s} {steps:5d} steps  train loss {loss:.3f}  held-out bpc {nll / math.log(2):.3f}")
    print("\narch          steps  held-out bytes   nll     bpc     ppl")
    for name, steps, loss, nll, count in rows:
        print(f"{name:12s} {steps:6d} {count:14d} {nll:7.3f} {nll / math.log(2):7.3f} {math.exp(nll):7.2f}")
    return 0
