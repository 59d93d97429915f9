"""Step time of RMT's two BPTT schedules at one config: window (the paper) against chunk (truncated BPTT).

    .venv/bin/python bench/benchmarks/bench_rmt_bptt.py                   # -> bench/results/rmt_bptt_cpu.json
    .venv/bin/python bench/benchmarks/bench_rmt_bptt.py --pairs 3 --warmup 1 --out /tmp/r.json   # a quick look

Both schedules are trainer/loop/recurrence.py's, driven with the bare model (forward, backward, clip, torch Adam), on
the same shape as bench_models.py (4 layers, d_model 256, 4 x 64 heads, d_inner 1024, V 8192, B 8, N 64) with
10 memory tokens and k = 3, no Transformer-XL cache. A window step forwards k + 1 segments (k replays, one new)
for B x N new tokens; a chunk step forwards k + 1 new segments for (k + 1) x B x N. So per *step* they should cost
about the same and per *token* the window costs about (k + 1) x: that is the price of every loss reaching k
segments back, which the paper calls "computationally expensive". Steps alternate between the schedules (one
model each, same weights at the start) so machine noise hits both alike; medians of per-step times. Tokens are
uniform random ids: the cost does not depend on the text. Never part of the test suite; nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from memlm.bench.common import RESULTS, load_average, paired_ratio, write_result
from memlm.bench.interrupt import stop_in_one_line
from memlm.models import ModelConfig, build_model
from memlm.trainer.loop.recurrence import make_recurrence

SHAPE = dict(arch="rmt", n_layer=4, n_head=4, d_head=64, d_model=256, d_inner=1024, vocab_size=8192, tgt_len=64,
             mem_len=0, num_mem_tokens=10, dropout=0.0)


def batches(lanes: int, seg_len: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    first = True
    while True:
        tokens = torch.randint(0, vocab, (lanes, seg_len + 1), generator=gen)
        yield SimpleNamespace(tokens=tokens[:, :-1], targets=tokens[:, 1:], reset=torch.full((lanes,), first))
        first = False


class Runner:
    def __init__(self, mode: str, depth: int, lanes: int, init_state: dict):
        self.cfg = ModelConfig(**SHAPE, bptt_depth=depth, bptt_mode=mode).validate()
        self.model = build_model(self.cfg).train()
        self.model.load_state_dict(init_state)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=2.5e-4)
        self.recurrence = make_recurrence(self.cfg, self.model.init_memory(lanes), "cpu")
        self.stream = batches(lanes, self.cfg.tgt_len, self.cfg.vocab_size, seed=0)

    def step(self) -> tuple[float, int, float]:
        t0 = time.perf_counter()
        mb = self.recurrence.step(self.model, lambda: next(self.stream))
        mb.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.25)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.recurrence.advance()
        return time.perf_counter() - t0, mb.inputs, float(mb.nll) / max(mb.count, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--out", default=str(RESULTS / "rmt_bptt_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = load_average()
    torch.manual_seed(0)
    init_state = build_model(ModelConfig(**SHAPE, bptt_depth=args.depth)).state_dict()
    runners = {mode: Runner(mode, args.depth, args.lanes, init_state) for mode in ("window", "chunk")}
    times = {mode: [] for mode in runners}
    inputs, losses = {}, {mode: [] for mode in runners}
    start = time.perf_counter()
    for i in range(args.warmup + args.pairs):
        for mode, runner in runners.items():
            seconds, inputs[mode], loss = runner.step()
            losses[mode].append(loss)
            if i >= args.warmup:
                times[mode].append(seconds)
    rows = {}
    for mode in runners:
        median = statistics.median(times[mode])
        rows[mode] = {"step_s_median": median, "forwards_per_step": args.depth + 1,
                      "new_tokens_per_step": inputs[mode], "tokens_per_s": inputs[mode] / median,
                      "first_loss": losses[mode][0], "last_loss": losses[mode][-1]}
    result = {
        "benchmark": "rmt_bptt", "torch": torch.__version__, "threads": args.threads, "nproc": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(), "loadavg_before": load_before,
        "config": {**SHAPE, "bptt_depth": args.depth, "lanes": args.lanes, "pairs": args.pairs, "warmup": args.warmup},
        "rows": rows, "step_time_ratio_window_over_chunk": paired_ratio(times["window"], times["chunk"]),
        "tokens_per_s_ratio_chunk_over_window": rows["chunk"]["tokens_per_s"] / rows["window"]["tokens_per_s"],
        "loadavg_after": load_average(), "wall_s": time.perf_counter() - start,
    }
    write_result(args.out, result)
    for mode, row in rows.items():
        print(f"{mode:6s}: {row['step_s_median'] * 1e3:7.1f} ms/step, {row['new_tokens_per_step']} new tokens/step, "
              f"{row['tokens_per_s']:8.0f} tokens/s")
    print(f"window/chunk step time {result['step_time_ratio_window_over_chunk']:.3f}x (median of paired ratios); "
          f"chunk reads {result['tokens_per_s_ratio_chunk_over_window']:.2f}x the tokens per second; "
          f"load {load_before[0]:.2f} -> {result['loadavg_after'][0]:.2f}; wrote {args.out}")


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
