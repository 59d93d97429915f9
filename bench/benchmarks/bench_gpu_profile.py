"""The compiled fast path on one GPU, measured AND profiled per arch, with torch and this checkout only.

    python bench/benchmarks/bench_gpu_profile.py --out $OUT                  # default runs, 360 s budget (H100)
    python bench/benchmarks/bench_gpu_profile.py --runs aligned:txl:64:layer --budget-s 200 --out /tmp/p
    python bench/benchmarks/bench_gpu_profile.py --device cpu --tiny --attention eager --runs aligned:txl:2:layer \
        --out /tmp/p                                                         # CPU smoke run

Each run (SHAPE:ARCH:LANES:SCOPE, in its own process so a compile failure costs one row) times bench_mfu's step
(bf16 autocast forward of one segment with the carried memory, mean NLL, backward, clip 0.25, fused AdamW) and then
records what the next speed work needs and bench_mfu lacks:
  * per-phase device time (CUDA events) beside host enqueue time (perf_counter): forward, backward, clip, optimizer;
    host > device in a phase means the GPU waited on Python there;
  * a torch.profiler window: kernel time by category (gemm, flex fwd/bwd, triton fused, aten elementwise, copies,
    index/scatter, reductions, optimizer), launches per step, GPU busy fraction and idle gaps from the kernel timeline;
  * host syncs of one step (torch.cuda.set_sync_debug_mode) with the memlm source lines that caused them;
  * torch.compile's graphs, graph breaks (with reasons) and recompiles.
Before the runs: the device's GEMM rate at the step's own shapes and its copy bandwidth (what an ideal budget uses).
Results: OUT/gpu_profile.json (rewritten after every run), OUT/run_*.json, OUT/trace_*.json.gz (optional).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from memlm.bench.interrupt import stop_in_one_line

SHAPES = {"paper": dict(d_model=410, n_head=10, d_head=41, d_inner=2100),
          "aligned": dict(d_model=512, n_head=8, d_head=64, d_inner=2048),
          "tiny": dict(d_model=32, n_head=2, d_head=16, d_inner=64)}
BASE = dict(n_layer=16, vocab_size=267735, tgt_len=150, mem_len=150, cutoffs=[20000, 40000, 200000], div_val=1,
            tie_weight=True, dropout=0.1)
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
CATEGORIES = [  # first match wins; lower-cased kernel names
    ("flex_bwd", ("flex_attention_backward",)),
    ("flex_fwd", ("flex_attention",)),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "wgmma", "xmma", "triton_tem_fused_mm",
              "triton_tem_fused_addmm", "triton_tem_fused_bmm")),
    ("optimizer_clip_foreach", ("multi_tensor_apply", "fused_adam", "adam")),
    ("triton_fused", ("triton_poi", "triton_red", "triton_per", "triton_")),
    ("fill_zero", ("fillfunctor", "memset")),
    ("copy", ("copy", "memcpy", "cat")),
    ("index_scatter_gather", ("index", "scatter", "gather", "embedding", "nonzero", "bucketize", "sort")),
    ("reduction_softmax_norm", ("reduce", "softmax", "logsumexp", "norm", "sum", "max")),
    ("elementwise", ("elementwise",)),
]


# A run is SHAPE:ARCH:LANES:SCOPE[:VARIANT,VARIANT...]; the variants change one thing each against the plain run.
VARIANTS = {
    "clipfold": "the clip folded into the fused AdamW step (trainer/loop/fused_clip.py)",
    "triton": "model.attention triton (models/attention_triton.py) instead of --attention",
    "noplan": "no tail plan: the head finds its tail rows on the device (a sync and a graph break per cluster)",
    "cudagraph": "CUDA graphs over the compiled forward and backward (mode reduce-overhead; model scope), the tail "
                 "plans padded to fixed capacities (one shape), the carried state copied out of the graph's pool",
    "bf16model": "the model in bf16 without autocast, as DeepSpeed's bf16 runs it (a bf16 residual stream and memory;"
                 " the optimizer here keeps no fp32 master copy, so its time is not DeepSpeed's)",
}


def file_stem(run: str) -> str:
    """A run's name as a file name of letters, digits, '.', '_' and '-' (what the device tool brings back)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run)


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


# ---------------------------------------------------------------------------------------------------------------
# one run, in its own process


def carried(memory, copy: bool):
    """The state the next step reads, as the trainer carries it (`memory.detached()`: no contiguous copy, so a
    state whose layout changes shows up as a recompile); copied out of the CUDA graph's memory pool under the
    cudagraph variant, where the next replay overwrites the graph's outputs."""
    from memlm.models.output import map_memory

    state = memory.detached()
    return map_memory(torch.clone, state) if copy else state


def run_one(args) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from memlm.models import build_model
    from memlm.models.config import ModelConfig
    from memlm.models.flops import flops_per_token
    from memlm.models.head_plan import tail_plan
    from memlm.models.registry import arch_spec
    from memlm.trainer.loop.fused_clip import fused_clipped_step

    shape, arch, lanes, scope, *extra = args.run.split(":")
    lanes = int(lanes)
    variants = set(extra[0].split(",")) if extra else set()
    unknown = variants - set(VARIANTS)
    if unknown:
        raise SystemExit(f"{args.run}: unknown variant(s) {sorted(unknown)}; valid: {', '.join(VARIANTS)}")
    attention = "triton" if "triton" in variants else args.attention
    settings = {**BASE, **SHAPES["tiny" if args.tiny else shape]}
    if args.tiny:
        settings.update(n_layer=2, tgt_len=16, mem_len=16)
    spec = arch_spec(arch)
    if spec.mem_len == "zero":
        settings["mem_len"] = 0
    if spec.memory_tokens:
        settings.update(mem_len=0, **{spec.memory_tokens: 10})
    cfg = ModelConfig(arch=arch, attention=attention, head_loss=args.head_loss, **settings).validate()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    bf16_model = "bf16model" in variants
    model = build_model(cfg).to(dev, torch.bfloat16 if bf16_model else None).train()
    torch._dynamo.reset()
    counters.clear()
    forward = model
    if scope in ("layer", "layers+head"):
        model.compile_layers(dynamic=False)
        if scope == "layers+head":  # the head's graph of its own too: a short compile, no eager head
            model.head.compile(dynamic=False)
    elif scope == "model":
        # cudagraph: CUDA graphs over the compiled forward and backward (cudagraph trees), static tail plans
        forward = torch.compile(model, dynamic=False, mode="reduce-overhead" if "cudagraph" in variants else None)
    opt = torch.optim.AdamW(model.parameters(), lr=2.5e-4, fused=cuda or "clipfold" in variants)
    gen = torch.Generator().manual_seed(1)
    weights = 1.0 / torch.arange(1, cfg.vocab_size + 1, dtype=torch.float64)
    host_pool = [torch.multinomial(weights, lanes * (cfg.tgt_len + 1), replacement=True, generator=gen).view(lanes, -1)
                 for _ in range(4)]
    pool = [seq.to(dev) for seq in host_pool]
    # The trainer's tail plans (trainer/loop/batch_transfer.py): made from the host's targets, sent along
    capacity = None
    if "cudagraph" in variants and cfg.cutoffs:  # one shape for every batch: the pool's largest, one multiple more
        sizes = [[len(r) for r in tail_plan(seq[:, 1:], cfg.cutoffs, cfg.vocab_size).rows] for seq in host_pool]
        capacity = [max(column) + 64 for column in zip(*sizes)]
    plans = [None if "noplan" in variants or not cfg.cutoffs else
             tail_plan(seq[:, 1:], cfg.cutoffs, cfg.vocab_size, capacity=capacity).to(dev) for seq in host_pool]
    memory_dtype = torch.bfloat16 if bf16_model else torch.float32
    state = {"memory": model.init_memory(lanes, device=dev, dtype=memory_dtype), "i": 0}
    params = list(model.parameters())

    def step(marks=None):
        if "cudagraph" in variants:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are no longer read
        seq, plan = pool[state["i"] % len(pool)], plans[state["i"] % len(pool)]
        state["i"] += 1
        mark = marks or (lambda name: None)
        mark("start")
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not bf16_model), \
                torch.profiler.record_function("fwd"):
            out = forward(seq[:, :-1], state["memory"], targets=seq[:, 1:], tail_plan=plan)
            loss = out.nll.float().mean()
        mark("fwd")
        with torch.profiler.record_function("bwd"):
            loss.backward()
        mark("bwd")
        if "clipfold" in variants:  # trainer/loop/fused_clip.py: the clip divisor handed to the fused step
            mark("clip")
            with torch.profiler.record_function("opt"):
                fused_clipped_step(opt, params, 0.25)
                opt.zero_grad(set_to_none=True)
        else:
            with torch.profiler.record_function("clip"):
                torch.nn.utils.clip_grad_norm_(params, 0.25)
            mark("clip")
            with torch.profiler.record_function("opt"):
                opt.step()
                opt.zero_grad(set_to_none=True)
        mark("opt")
        state["memory"] = carried(out.memory, copy="cudagraph" in variants)

    row = {"run": args.run, "arch": arch, "shape": shape, "lanes": lanes, "scope": scope, "torch": torch.__version__,
           "attention": attention, "head_loss": args.head_loss, "variants": sorted(variants),
           "params": sum(p.numel() for p in params),
           "device": torch.cuda.get_device_name() if cuda else "cpu"}
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
        sync()
    row["warmup_s"] = time.perf_counter() - t0
    row["graphs_at_warmup"] = int(counters["stats"]["unique_graphs"])
    graphs_before = row["graphs_at_warmup"]

    # timed steps: whole-step wall (synchronised per step, as bench_mfu) and per-phase device vs host time
    names = ["start", "fwd", "bwd", "clip", "opt"]
    walls, phases_dev, phases_host = [], collections.defaultdict(list), collections.defaultdict(list)
    for _ in range(args.steps):
        events, hosts = {}, {}

        def marks(name):
            hosts[name] = time.perf_counter()
            if cuda:
                events[name] = torch.cuda.Event(enable_timing=True)
                events[name].record()

        sync()
        w0 = time.perf_counter()
        step(marks)
        sync()
        walls.append(time.perf_counter() - w0)
        for a, b in zip(names, names[1:]):
            phases_host[b].append(1e3 * (hosts[b] - hosts[a]))
            if cuda:
                phases_dev[b].append(events[a].elapsed_time(events[b]))
    median = statistics.median(walls)
    fwd_flops = flops_per_token(cfg, batch_size=lanes)["total"]
    tokens = lanes * cfg.tgt_len
    achieved = tokens / median * 3 * fwd_flops
    peak = next((v for k, v in PEAK_BF16.items() if k in row["device"]), None) if cuda else None
    row.update(step_ms_median=1e3 * median, step_ms_min=1e3 * min(walls), tokens_per_s=tokens / median,
               achieved_tflops=achieved / 1e12, mfu=achieved / peak if peak else None,
               phase_ms_host={k: statistics.median(v) for k, v in phases_host.items()},
               phase_ms_device={k: statistics.median(v) for k, v in phases_dev.items()},
               recompiles_after_warmup=int(counters["stats"]["unique_graphs"]) - graphs_before,
               graph_breaks=dict(collections.Counter({k[:200]: v for k, v in counters["graph_break"].items()})))
    if cuda:
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30

    row["syncs"] = count_syncs(step) if cuda else None
    row["profile"] = profile(step, args, cuda, sync)
    mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] else "n/a"
    print(f"{args.run}: {row['step_ms_median']:.1f} ms, {row['tokens_per_s']:,.0f} tok/s, MFU {mfu}, warm-up "
          f"{row['warmup_s']:.0f} s, graphs {row['graphs_at_warmup']}, breaks {sum(row['graph_breaks'].values())}, "
          f"recompiles {row['recompiles_after_warmup']}, syncs {row['syncs'] and row['syncs']['count']}", flush=True)
    return row


PHASE_MARKS = ("fwd", "bwd", "clip", "opt")


def is_annotation(event) -> bool:
    return bool(getattr(event, "is_user_annotation", False)) or event.name in PHASE_MARKS \
        or event.name.startswith("Optimizer.")


def count_syncs(step) -> dict:
    """Host syncs of one step, with the innermost memlm (or bench) frame of each."""
    sites = collections.Counter()

    def show(message, category_, filename, lineno, file=None, line=None):
        # the innermost frame outside torch and the standard library; syncs inside backward are re-raised by the
        # autograd engine at loss.backward(), so they show up there
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "site-packages/torch" not in f.filename and "/lib/python3" not in f.filename]
        f = frames[-1] if frames else None
        if f is None:
            where = "?"
        elif "torchinductor" in f.filename:
            where = f"compiled graph {Path(f.filename).name}"
        else:
            where = f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.line}"
        sites[where] += 1

    old = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.synchronize()  # the work before this step, so that nothing of it is charged here
        torch.cuda.set_sync_debug_mode(1)
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)  # before the final synchronize: that one is ours, not the step's
            warnings.showwarning = old
        torch.cuda.synchronize()
    return {"count": sum(sites.values()), "sites": dict(sites.most_common(20))}


def profile(step, args, cuda: bool, sync) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    n = args.profile_steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with torch_profile(activities=acts) as prof:
        w0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        wall = time.perf_counter() - w0
    out = {"steps": n, "wall_ms_per_step": 1e3 * wall / n}
    if args.trace:
        prof.export_chrome_trace(str(Path(args.out) / f"trace_{file_stem(args.run)}.json"))
    if not cuda:
        ops = prof.key_averages()
        out["cpu_ops_per_step"] = sum(e.count for e in ops) / n
        return out
    # The record_function phase markers ("fwd", "bwd", "clip", "opt", "Optimizer.step#...") show on the GPU timeline
    # as user annotations spanning their kernels: counted as kernels they double the kernel time and fill the gaps.
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not is_annotation(e)]
    dur = lambda e: e.time_range.end - e.time_range.start  # noqa: E731 - microseconds
    by_cat, calls_by_cat, by_name = collections.Counter(), collections.Counter(), collections.Counter()
    for e in kernels:
        cat = category(e.name)
        by_cat[cat] += dur(e)
        calls_by_cat[cat] += 1
        by_name[e.name[:140]] += dur(e)
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, gaps, cur_s, cur_e = 0.0, [], None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    out.update(kernel_ms_per_step=sum(by_cat.values()) / 1e3 / n, launches_per_step=len(kernels) / n,
               busy_ms_per_step=busy / 1e3 / n, span_ms_per_step=span / 1e3 / n,
               gpu_busy_fraction_of_span=busy / span if span else None,
               gaps_over_20us_per_step=sum(g > 20 for g in gaps) / n,
               gap_ms_over_20us_per_step=sum(g for g in gaps if g > 20) / 1e3 / n,
               category_ms_per_step={k: v / 1e3 / n for k, v in by_cat.most_common()},
               category_launches_per_step={k: v / n for k, v in calls_by_cat.most_common()},
               top_kernels=[{"kernel": k, "ms_per_step": v / 1e3 / n} for k, v in by_name.most_common(15)])
    return out


# ---------------------------------------------------------------------------------------------------------------
# device figures and the driver


def device_figures() -> dict:
    """The GEMM rate at the step's shapes (aligned txl, 64 lanes) and the copy bandwidth of this device."""
    dev, bf16 = "cuda", torch.bfloat16
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

    def timed(fn, reps=20):
        for _ in range(3):
            fn()
        a, b = ev(), ev()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / reps  # ms

    T = 9600
    shapes = {"q/o 9600x512x512": (T, 512, 512), "kv 9600x512x1024": (T, 512, 1024),
              "ffn up 9600x512x2048": (T, 512, 2048), "ffn down 9600x2048x512": (T, 2048, 512),
              "head 4096x512x20003": (4096, 512, 20003), "head padded 4096x512x20032": (4096, 512, 20032),
              "tail2 1181x512x160000": (1181, 512, 160000), "ref 8192^3": (8192, 8192, 8192)}
    out = {}
    for name, (m, k, n) in shapes.items():
        x = torch.randn(m, k, device=dev, dtype=bf16)
        w = torch.randn(n, k, device=dev, dtype=bf16)
        ms = timed(lambda: torch.nn.functional.linear(x, w))
        out[name] = {"ms": ms, "tflops": 2 * m * k * n / ms / 1e9}
    x = torch.empty(2**28, device=dev, dtype=torch.float32)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), reps=10)
    out["copy_1GiB_tb_per_s"] = 2 * x.numel() * 4 / ms / 1e9
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=["aligned:txl:64:layer", "aligned:lamemo:64:layer",
                                                  "aligned:rmt:64:layer", "aligned:txl:128:layer",
                                                  "aligned:txl:64:model"])
    p.add_argument("--run", help=argparse.SUPPRESS)  # one run in this process (the driver's child)
    p.add_argument("--out", default="bench/results/gpu_profile")
    p.add_argument("--device", default="cuda")
    p.add_argument("--attention", default="flex", choices=["auto", "eager", "flex"])
    p.add_argument("--head-loss", default="chunked", choices=["auto", "full", "chunked"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--trace", action="store_true", help="also export a chrome trace per run")
    p.add_argument("--tiny", action="store_true", help="2 layers, d 32, N = M = 16 (CPU smoke)")
    p.add_argument("--budget-s", type=float, default=360, help="no run starts after this; each is cut at it")
    p.add_argument("--run-limit-s", type=float, default=240, help="one run's most seconds (compile included)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.run:  # child
        torch.backends.cuda.matmul.allow_tf32 = True
        row = run_one(args)
        (out / f"run_{file_stem(args.run)}.json").write_text(json.dumps(row, indent=1))
        return 0
    start = time.time()
    result = {"torch": torch.__version__, "runs": [], "failed": [], "argv": sys.argv[1:]}
    if args.device == "cuda":
        result["device"] = torch.cuda.get_device_name()
        result["device_figures"] = device_figures()
        print(json.dumps(result["device_figures"], indent=1), flush=True)
    for run in args.runs:
        left = args.budget_s - (time.time() - start)
        if left < 60:
            result["failed"].append({"run": run, "why": f"skipped: {left:.0f} s left"})
            continue
        child = [sys.executable, __file__, "--run", run] + [a for a in sys.argv[1:] if a != "--runs"
                                                             and a not in args.runs]
        limit = min(args.run_limit_s, left - 10)
        print(f"=== {run} (limit {limit:.0f} s)", flush=True)
        try:
            rc = subprocess.run(child, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        f = out / f"run_{file_stem(run)}.json"
        if rc == 0 and f.exists():
            result["runs"].append(json.loads(f.read_text()))
        else:
            result["failed"].append({"run": run, "why": f"rc {rc}"})
        (out / "gpu_profile.json").write_text(json.dumps(result, indent=1))
    for r in result["runs"]:
        prof = r.get("profile", {})
        cats = ", ".join(f"{k} {v:.1f}" for k, v in prof.get("category_ms_per_step", {}).items())
        print(f"{r['run']}: {r['step_ms_median']:.1f} ms MFU {100 * (r['mfu'] or 0):.1f}% | device fwd/bwd/clip/opt "
              f"{r['phase_ms_device']} host {r['phase_ms_host']} | kernels {prof.get('kernel_ms_per_step', 0):.1f} ms "
              f"busy {prof.get('gpu_busy_fraction_of_span')} launches {prof.get('launches_per_step')} | {cats} | "
              f"syncs {r['syncs']}")
    print(f"wrote {out / 'gpu_profile.json'} ({len(result['runs'])} runs, {len(result['failed'])} not)")
    return 0


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
