"""What memory costs on a pretrained backbone: hf_rmt and hf_armt around a GPT-2-shaped model, step time and peak
memory against the BPTT window, with and without per-segment checkpointing, and the 1-segment step against the bare
transformers model's forward + backward on the same tokens (issue 37 item 8).

    .venv/bin/python bench/benchmarks/bench_pretrained_memory.py    # -> bench/results/pretrained_memory_cpu.json
    python bench/benchmarks/bench_pretrained_memory.py --profile gpu  # a lent GPU: results/pretrained_memory_gpu.json
    .venv/bin/python bench/benchmarks/bench_pretrained_memory.py --profile smoke --out /tmp/p.json  # seconds

The backbone is a transformers GPT-2 built from its config inline (`model.backbone_config`, random weights: speed and
memory do not depend on training; nothing downloaded), dropout 0, trained in full (model.backbone_train: full; the
optimizer is left out of a step: it costs the same with or without memory). Profiles: `cpu` a GPT-2 of 6 layers,
width 256, 4 heads x 64, 8,192 tokens, B = 4 lanes of N = 128 tokens, R = 4 memory tokens (2R / N as at the `gpu`
shape), fp32, one thread (two on a busy 2-core machine made a step 10x slower: bench/README.md); `gpu` GPT-2
small's shape (12 layers, width 768, 12 heads, 1,024 positions, 50,257 tokens, 124M parameters), B = 8, N = 512,
R = 16, ARMT's assoc_dim 64, bf16 autocast; `smoke` a 2-layer width-32 GPT-2 (CI).

A memory arch's step is the trainer's own: trainer/loop/recurrence.py's window BPTT (make_recurrence, step, the
backward of its loss, advance), so at model.bptt_depth = k a step forwards k + 1 segments (the last k replayed with
the current weights, then the new one) and backpropagates through all of them. k = 0 is the 1-segment step. Each
case warms up k more steps than --warmup, so its window is full when the timing starts. `hf` (the backbone behind
memlm's contract, no memory) runs through the trainer's segment recurrence; `bare` is the transformers model alone:
lm(input_ids).logits, cross-entropy on the same targets, backward. Every arch starts from one set of weights (the
cases of an arch that differ in k alone share its model; build_cases says why that is the same), and the cases are
timed round-robin --repeats times, so load hits all alike; medians. A step's time is this process's CPU time on the
CPU (one thread: the step's own work, whoever else holds the core; its wall time is kept beside it) and the wall
time between synchronizations on CUDA (timed_step). The overhead at one segment is timed apart:
--overhead-rounds rounds of bare, hf, hf_rmt and hf_armt at k = 0 alone, back to back (a round of every case
takes half a minute on the CPU, and another process's burst falls between a pair's two steps far less often in a
round of four short ones); each ratio is the median of per-round ratios (bench/common.py, paired_ratio).

Memory, measured after the timing on one more step of each case, the same two figures on either device, each above
the bytes allocated when the step began (the model's weights, and on the GPU the other cases' models, are not in
them; the step's gradients are: they are freed between steps):
- `held_bytes`: allocated when the backward starts: what the forward keeps for it (the activations that per-segment
  checkpointing trades for a recomputation) plus the loss and the memory state;
- `peak_bytes`: the highest allocation during the step, the backward's transient tensors, recomputed segments and
  the gradients included.
On CUDA from torch.cuda.memory_allocated and max_memory_allocated. On the CPU, which keeps no such counter, from the
allocation records of torch's profiler (profile_memory=True: every allocation and free of torch's CPU allocator in
order, summed). That counts tensors, not the process: the allocator's and the libraries' own caches and RSS are
outside it (bench_memory.py measures RSS).

Never part of the test suite (tests/bench/test_pretrained_memory_bench.py runs the smoke profile); nothing asserts a
timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from itertools import accumulate
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from memlm.bench.common import RESULTS, load_average, paired_ratio, write_result
from memlm.bench.interrupt import stop_in_one_line
from memlm.models import ModelConfig, build_model
from memlm.models.flops import flops_per_token
from memlm.models.registry import arch_spec
from memlm.trainer.loop.recurrence import make_recurrence
from memlm.trainer.runtime.allocator import tune_allocator

NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@dataclass(frozen=True)
class Profile:
    backbone: dict  # a transformers GPT-2 config, inline (its vocabulary is model.vocab_size, the data's)
    vocab: int  # V
    lanes: int  # B
    seg_len: int  # N
    mem_tokens: int  # R
    assoc_dim: int  # ARMT's d_mem
    depths: tuple[int, ...]  # the BPTT windows k (k = 0, the 1-segment step, is always added)
    repeats: int
    overhead_rounds: int  # rounds of the four 1-segment steps alone (the overhead's pairs)
    warmup: int
    device: str
    dtype: str  # fp32, or bf16 autocast
    threads: int


PROFILES = {
    "cpu": Profile(
        backbone={"model_type": "gpt2", "n_layer": 6, "n_embd": 256, "n_head": 4, "n_positions": 512, **NO_DROPOUT},
        vocab=8192, lanes=4, seg_len=128, mem_tokens=4, assoc_dim=16, depths=(1, 2, 4, 8), repeats=5,
        overhead_rounds=40, warmup=1,
        device="cpu", dtype="fp32", threads=1),
    "gpu": Profile(  # GPT-2 small's shape
        backbone={"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
                  **NO_DROPOUT},
        vocab=50257, lanes=8, seg_len=512, mem_tokens=16, assoc_dim=64, depths=(1, 2, 4, 8), repeats=10,
        overhead_rounds=30, warmup=2,
        device="cuda", dtype="bf16", threads=2),
    "smoke": Profile(
        backbone={"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, **NO_DROPOUT},
        vocab=128, lanes=2, seg_len=16, mem_tokens=2, assoc_dim=4, depths=(1,), repeats=1,
        overhead_rounds=2, warmup=0,
        device="cpu", dtype="fp32", threads=1),
}
MEMORY_ARCHS = ("hf_rmt", "hf_armt")
TARGET_OVERHEAD = 1.15  # issue 37: the wrapped model's 1-segment step within 15% of the bare backbone's


def model_config(profile: Profile, arch: str, depth: int = 0, checkpointing: bool = False) -> ModelConfig:
    options = dict(arch=arch, backbone_config=dict(profile.backbone), vocab_size=profile.vocab, mem_len=0,
                   tgt_len=profile.seg_len, segment_checkpointing=checkpointing)
    if arch in MEMORY_ARCHS:
        options.update(num_mem_tokens=profile.mem_tokens, bptt_depth=depth)
    if arch == "hf_armt":
        options.update(assoc_dim=profile.assoc_dim)
    return ModelConfig(**options).validate()


def segments(profile: Profile, seed: int):
    """Uniform random tokens (the cost does not depend on the text), one document per lane: reset at the first
    segment only, so every window reaches its full k segments back."""
    gen = torch.Generator().manual_seed(seed)
    first, vocab = True, profile.vocab
    while True:
        tokens = torch.randint(0, vocab, (profile.lanes, profile.seg_len + 1), generator=gen)
        yield SimpleNamespace(tokens=tokens[:, :-1], targets=tokens[:, 1:], reset=torch.full((profile.lanes,), first))
        first = False


class Case:
    """One timed configuration: a model and how its step runs (forward() -> loss; after the backward, done())."""

    def __init__(self, name: str, arch: str, depth: int, checkpointing: bool, model: torch.nn.Module):
        self.name, self.arch, self.depth, self.checkpointing = name, arch, depth, checkpointing
        self.model = model.train()
        self.times: list[float] = []  # by the profile's clock (timed_step)
        self.overhead_times: list[float] = []  # the overhead rounds' (1-segment cases only)
        self.wall: list[float] = []  # the same steps' wall times
        self.overhead_wall: list[float] = []
        self.losses: list[float] = []

    def forward(self) -> torch.Tensor:
        raise NotImplementedError

    def done(self) -> None:
        self.model.zero_grad(set_to_none=True)


class TrainerCase(Case):
    """A memlm arch stepped by the trainer's recurrence (window BPTT for hf_rmt and hf_armt, one segment for hf)."""

    def __init__(self, profile: Profile, cfg: ModelConfig, model: torch.nn.Module, device):
        name = f"{cfg.arch} k={cfg.bptt_depth}" + (" ckpt" if cfg.segment_checkpointing else "")
        super().__init__(name, cfg.arch, cfg.bptt_depth, cfg.segment_checkpointing, model)
        self.recurrence = make_recurrence(cfg, model.init_memory(profile.lanes, device=device), device)
        self.stream = segments(profile, seed=0)

    def forward(self) -> torch.Tensor:
        return self.recurrence.step(self.model, lambda: next(self.stream)).loss

    def done(self) -> None:
        super().done()
        self.recurrence.advance()


class BareCase(Case):
    """The transformers model alone (the `hf` arch's backbone, `lm`): logits of the same tokens, cross-entropy."""

    def __init__(self, profile: Profile, lm: torch.nn.Module, device):
        super().__init__("bare", "bare", 0, False, lm)
        self.stream, self.device = segments(profile, seed=0), device

    def forward(self) -> torch.Tensor:
        seg = next(self.stream)
        tokens, targets = seg.tokens.to(self.device), seg.targets.to(self.device)
        logits = self.model(input_ids=tokens).logits  # [B, N, V]
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def autocast(profile: Profile, device):
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=profile.dtype == "bf16")


def run_step(case: Case, profile: Profile, device, backward_mark=None) -> float:
    """One step of `case` (forward, backward, gradients freed); returns its loss. backward_mark(), if given, runs
    between the forward and the backward (the memory figures split there)."""
    with autocast(profile, device):
        loss = case.forward()
    if backward_mark is not None:
        backward_mark()
    loss.backward()
    value = float(loss.detach())  # a device read: the step's work is done when it returns
    case.done()
    return value


def timed_step(case: Case, profile: Profile, device) -> tuple[float, float]:
    """(the step's time by the clock, its wall time). The clock on the CPU is this process's CPU time: with one
    thread that is the step's own work, without the time another process held the core (on this shared 2-core
    machine the wall time of one and the same step varied 2x within a minute under load; quiet, the two agree);
    on CUDA the wall time between synchronizations."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    case.losses.append(run_step(case, profile, device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    return (wall if device.type == "cuda" else time.process_time() - cpu), wall


CLOCKS = {"cpu": "process CPU time (time.process_time; one torch thread)",
          "cuda": "wall time between torch.cuda.synchronize() calls"}


def cuda_memory(cases: list[Case], profile: Profile, device) -> None:
    for case in cases:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        held = []
        run_step(case, profile, device, lambda: held.append(torch.cuda.memory_allocated(device) - before))
        torch.cuda.synchronize()
        case.memory = {"held_bytes": held[0], "peak_bytes": torch.cuda.max_memory_allocated(device) - before}


MARK = "bench_pretrained_memory"


def cpu_memory(cases: list[Case], profile: Profile, device) -> None:
    """Every case's step under one profiler (profile_memory), marked where it starts, where its backward starts and
    where it ends; the allocation records between its marks, summed in order, are its live bytes above its start.
    Each case first runs one unmarked step under the profiler: the profiler sees no free of a block allocated
    before it started (the memory state a step replaces, for one), and would count such a block as live."""
    from torch import profiler

    def mark(name: str) -> None:
        with profiler.record_function(f"{MARK}.{name}"):
            pass

    gc.collect()
    with profiler.profile(activities=[profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, case in enumerate(cases):
            run_step(case, profile, device)
            mark(f"start.{i}")
            run_step(case, profile, device, lambda: mark(f"backward.{i}"))  # noqa: B023 (called before i moves on)
            mark(f"end.{i}")
    allocations, marks = allocation_records(prof)
    for i, case in enumerate(cases):
        try:
            start, backward, end = (marks[f"{MARK}.{name}.{i}"] for name in ("start", "backward", "end"))
        except KeyError as missing:
            raise RuntimeError(f"torch {torch.__version__}'s profiler recorded no {missing} event") from None
        step = [(when, size) for when, size in allocations if start <= when <= end]
        live = list(accumulate(size for _, size in step))
        held = [value for (when, _), value in zip(step, live) if when <= backward]
        case.memory = {"held_bytes": max(held[-1], 0) if held else 0, "peak_bytes": max([0, *live]),
                       "allocations": sum(1 for _, size in step if size > 0)}


def allocation_records(prof) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """(time in ns, bytes: + allocated, - freed) of every CPU allocator record in time order, and when each mark
    started. The records are in the profiler's event tree (what torch's own memory timeline reads: a private API,
    which the smoke test exercises at every torch upgrade)."""
    from torch._C._profiler import _EventType

    allocations, marks, todo = [], {}, list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
        elif node.name.startswith(MARK + "."):
            marks[node.name] = node.start_time_ns
    return sorted(allocations), marks


def measure_memory(cases: list[Case], profile: Profile, device) -> None:
    (cuda_memory if device.type == "cuda" else cpu_memory)(cases, profile, device)


def build_cases(profile: Profile, depths: tuple[int, ...], device) -> list[Case]:
    """bare and hf first (the overhead's denominators), then each memory arch at k = 0, then the windows.

    The cases of one arch share a model where their configs differ in bptt_depth alone and the model reads nothing
    of it (it reads bptt_choice("memory_init_grad"), which depends on k under the authors' recipe only: the key
    below): the window lives in each case's recurrence, and a step frees its gradients (Case.done). Fewer models
    to build, and on a GPU fewer resident weights."""
    torch.manual_seed(0)
    states = {arch: build_model(model_config(profile, arch)).state_dict() for arch in ("hf", *MEMORY_ARCHS)}
    models: dict[tuple, torch.nn.Module] = {}

    def model_for(cfg: ModelConfig) -> torch.nn.Module:
        key = (cfg.arch, cfg.segment_checkpointing, cfg.bptt_choice("memory_init_grad"))
        if key not in models:
            model = build_model(cfg)
            model.load_state_dict(states[cfg.arch])
            models[key] = model.to(device)
        return models[key]

    bare = build_model(model_config(profile, "hf"))
    bare.load_state_dict(states["hf"])
    cases: list[Case] = [BareCase(profile, bare.lm.to(device), device)]
    configs = [model_config(profile, "hf", 0, ckpt) for ckpt in (False, True)]
    configs += [model_config(profile, arch, depth, ckpt)
                for depth in (0, *depths) for arch in MEMORY_ARCHS for ckpt in (False, True)]
    return cases + [TrainerCase(profile, cfg, model_for(cfg), device) for cfg in configs]


def overhead(cases: dict[str, Case], profile: Profile) -> dict:
    """Each memlm arch's 1-segment step against the bare backbone's, with what the rows and FLOPs predict, and the
    memory archs' against memlm's hf (the same wrapper without memory: the memory's own share)."""
    bare, hf = cases["bare"], cases["hf k=0"]
    bare_flops = flops_per_token(model_config(profile, "hf"))["total"]
    rows = {"hf": profile.seg_len, "hf_rmt": profile.seg_len + 2 * profile.mem_tokens,
            "hf_armt": profile.seg_len + profile.mem_tokens}
    out = {}
    for arch in ("hf", *MEMORY_ARCHS):
        case = cases[f"{arch} k=0"]
        ratio = paired_ratio(case.overhead_times, bare.overhead_times)
        out[arch] = {
            "step_ratio_paired": ratio,  # the overhead rounds'
            "step_ratio_medians": statistics.median(case.overhead_times) / statistics.median(bare.overhead_times),
            "step_ratio_over_hf_paired": paired_ratio(case.overhead_times, hf.overhead_times),
            "step_ratio_paired_in_the_sweep": paired_ratio(case.times, bare.times),  # the --repeats rounds'
            "rows_ratio": rows[arch] / profile.seg_len,
            "fwd_flops_ratio": flops_per_token(model_config(profile, arch))["total"] / bare_flops,
            "target": TARGET_OVERHEAD, "target_met": ratio <= TARGET_OVERHEAD,
        }
    return out


def checkpointing_effect(cases: dict[str, Case], depths: tuple[int, ...]) -> dict:
    """Per memory arch and k: checkpointed over plain, step time (paired) and the two memory figures."""
    out = {}
    for arch in MEMORY_ARCHS:
        for depth in (0, *depths):
            plain, ckpt = cases[f"{arch} k={depth}"], cases[f"{arch} k={depth} ckpt"]
            out[f"{arch} k={depth}"] = {
                "step_ratio_paired": paired_ratio(ckpt.times, plain.times),
                "held_ratio": ckpt.memory["held_bytes"] / max(plain.memory["held_bytes"], 1),
                "peak_ratio": ckpt.memory["peak_bytes"] / max(plain.memory["peak_bytes"], 1),
            }
    return out


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # platform.processor() is only "x86_64" on Linux
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--depths", help="comma-separated BPTT windows k (default: the profile's, 1,2,4,8)")
    parser.add_argument("--repeats", type=int, help="timed rounds (default: the profile's)")
    parser.add_argument("--overhead-rounds", type=int, help="rounds of the 1-segment steps alone (the profile's)")
    parser.add_argument("--warmup", type=int, help="untimed steps per case beyond filling its window")
    parser.add_argument("--threads", type=int, help="torch threads (default: the profile's)")
    parser.add_argument("--seg-len", type=int, help="N, the segment length (default: the profile's)")
    parser.add_argument("--mem-tokens", type=int, help="R, the memory tokens (default: the profile's)")
    parser.add_argument("--out", help="result JSON (default: bench/results/pretrained_memory_PROFILE.json)")
    args = parser.parse_args(argv)
    if args.profile == "smoke" and not args.out:
        parser.error("--profile smoke needs --out (never over the committed results)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profile = PROFILES[args.profile]
    profile = dataclasses.replace(
        profile, repeats=args.repeats or profile.repeats, threads=args.threads or profile.threads,
        overhead_rounds=args.overhead_rounds or profile.overhead_rounds, seg_len=args.seg_len or profile.seg_len,
        mem_tokens=args.mem_tokens or profile.mem_tokens,
        warmup=profile.warmup if args.warmup is None else args.warmup,
        depths=tuple(int(k) for k in args.depths.split(",")) if args.depths else profile.depths)
    if profile.device == "cuda" and not torch.cuda.is_available():
        print(f"bench_pretrained_memory: --profile {args.profile} needs a CUDA GPU; this torch sees none",
              file=sys.stderr)
        return 2
    out = args.out or str(RESULTS / f"pretrained_memory_{args.profile}.json")
    # glibc as every memlm process sets it (prepare_process): a step's freed memory stays mapped for the next one;
    # with the defaults each step faults it in again, and 1-segment steps of one shape ran 0.45-1.9x each other
    allocator = tune_allocator()
    torch.set_num_threads(profile.threads)
    device = torch.device(profile.device)
    load_before = load_average()
    start = time.perf_counter()
    cases = build_cases(profile, profile.depths, device)
    progress(start, f"{len(cases)} cases built")
    for case in cases:  # untimed: fill each window, then --warmup more
        for _ in range(case.depth + profile.warmup):
            run_step(case, profile, device)
    progress(start, "warmed up")
    loads = []
    for r in range(profile.repeats):
        for case in cases:
            clock, wall = timed_step(case, profile, device)
            case.times.append(clock)
            case.wall.append(wall)
        loads.append(load_average()[0])
        progress(start, f"round {r + 1}/{profile.repeats} timed")
    one_segment = [case for case in cases if case.depth == 0 and not case.checkpointing]  # bare, hf, hf_rmt, hf_armt
    for _ in range(profile.overhead_rounds):
        for case in one_segment:
            clock, wall = timed_step(case, profile, device)
            case.overhead_times.append(clock)
            case.overhead_wall.append(wall)
    load_overhead_rounds = load_average()
    progress(start, f"{profile.overhead_rounds} rounds of the 1-segment steps timed")
    measure_memory(cases, profile, device)
    progress(start, "memory measured")
    by_name = {case.name: case for case in cases}
    tokens = profile.lanes * profile.seg_len
    rows = []
    for case in cases:
        median = statistics.median(case.times)
        rows.append({"name": case.name, "arch": case.arch, "bptt_depth": case.depth,
                     "segment_checkpointing": case.checkpointing, "forwards_per_step": case.depth + 1,
                     "step_s": case.times, "step_s_median": median, "new_tokens_per_s": tokens / median,
                     "step_wall_s": case.wall, "step_wall_s_median": statistics.median(case.wall),
                     **({"overhead_step_s": case.overhead_times, "overhead_step_wall_s": case.overhead_wall}
                        if case.overhead_times else {}),
                     **case.memory, "first_loss": case.losses[0], "last_loss": case.losses[-1]})
    import transformers

    result = {
        "benchmark": "pretrained_memory", "profile": args.profile, "device": device.type,
        "device_name": device_name(device), "dtype": profile.dtype, "threads": profile.threads,
        "nproc": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
        "allocator": allocator.reason if allocator.tuned else f"glibc defaults ({allocator.reason})",
        "config": {**dataclasses.asdict(profile), "backbone_train": "full",
                   "params": {arch: arch_spec(arch).load("params")(model_config(profile, arch))
                              for arch in ("hf", *MEMORY_ARCHS)}},
        "clock": CLOCKS[device.type],
        "memory_measure": ("torch.cuda memory_allocated / max_memory_allocated" if device.type == "cuda" else
                           "torch profiler (profile_memory) CPU allocator records, summed in order"),
        "loadavg_before": load_before, "loadavg_per_round": loads,
        "loadavg_after_overhead_rounds": load_overhead_rounds,
        "cases": rows, "overhead_at_one_segment": overhead(by_name, profile),
        "checkpointing": checkpointing_effect(by_name, profile.depths),
        "loadavg_after": load_average(), "wall_s": time.perf_counter() - start,
    }
    write_result(out, result)
    print_table(result)
    print(f"load {load_before[0]:.2f} -> {result['loadavg_after'][0]:.2f}; {result['wall_s']:.0f} s; wrote {out}")
    return 0


def progress(start: float, what: str) -> None:
    print(f"[{time.perf_counter() - start:6.0f} s, load {load_average()[0]:.2f}] {what}", flush=True)


def print_table(result: dict) -> None:
    MiB = 2 ** 20
    print(f"{'case':24s} {'step ms':>9s} {'held MiB':>9s} {'peak MiB':>9s}")
    for row in result["cases"]:
        print(f"{row['name']:24s} {row['step_s_median'] * 1e3:9.1f} {row['held_bytes'] / MiB:9.1f} "
              f"{row['peak_bytes'] / MiB:9.1f}")
    for arch, row in result["overhead_at_one_segment"].items():
        verdict = "met" if row["target_met"] else "NOT met"
        print(f"{arch} 1 segment / bare: {row['step_ratio_paired']:.3f}x, / hf {row['step_ratio_over_hf_paired']:.3f}x "
              f"(rows {row['rows_ratio']:.3f}x, forward FLOPs {row['fwd_flops_ratio']:.3f}x; target {row['target']}x "
              f"{verdict})")


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
