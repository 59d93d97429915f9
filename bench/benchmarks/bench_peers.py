"""memlm against other implementations of the same models: one training step per segment, interleaved, one thread.

    python3.11 bench/benchmarks/bench_peers.py --setup     # fresh clone: make .bench-venv with the peers, run (~12 min)
    python3.11 bench/benchmarks/bench_peers.py             # run again (re-executes itself inside .bench-venv)
    python3.11 bench/benchmarks/bench_peers.py --shapes small --steps 3 --warmup 1       # quick look (~1 min)
    python3 bench/benchmarks/bench_peers.py --device cuda --shapes gpu-aligned --precisions bf16   # on a lent GPU

Peers (pinned in bench/benchmarks/peers/requirements*.txt, installed into ./.bench-venv, never into the product's
.venv):
Hugging Face TransfoXL (transformers 4.34.1, the last release that ships it), lucidrains'
recurrent-memory-transformer-pytorch with and without its XL memories, and labml-nn's Transformer-XL. memlm is
imported from this repository (`from memlm.models import ModelConfig, build_model`).

Every model gets the same shape (width, depth, heads, FFN FLOPs, segment N, memory M, RMT memory tokens,
vocabulary), the same batches, and the same training step: forward of one segment with the memory carried over
as its library's API carries it (detached between steps), mean NLL, backward, gradient clipping at 0.25, torch
Adam. The models of a group are stepped round-robin (one step each per round) after warm-up, so machine noise
hits them alike; the figure is the median step time, tokens/s = lanes x N / median, and memlm/peer is the
ratio of tokens/s (> 1: memlm faster), also as the median of per-round ratios ("paired"). Parameters and the
loss at init on the same batch (~ln V for all) are printed to show the same function class.

The hardware limit, in the same process: after warm-up, one more step of each model is recorded
(peers/matmul_floor.py) and the matrix multiplications it executed are replayed on their own, timed right after
each of that model's timed steps. "matmuls only" is that replay's median time with the step's matmul GFLOP and
the rate this core reached on them; "clip + Adam" is the step's gradient clipping and optimizer update, the same
torch code for every library, timed inside the step; "step / (matmuls + Adam)" is how much longer the whole step
takes than those two; "ceiling" is the memlm/peer ratio memlm would reach if its step took only its matmuls' and
its optimizer's time, i.e. the most that any implementation of memlm's computation on these BLAS kernels and
torch's Adam could show against that peer.

Shapes: "small" (4 layers, d 256, 4 x 64 heads, d_inner 1024, N = M = 128, 8 lanes, V 8000, plain softmax; all
models in one group) and "wt103" (preset paper/wt103/txl: 16 layers, d 410, 10 x 41 heads, d_inner 2100,
N = M = 150, V 267,735 with adaptive softmax cutoffs 20k/40k/200k, 2 lanes; 1 warm-up and 2 timed steps, 3-9 s
each on one core; the models are timed in groups of two or three, each memlm model with its peers, because all of
them at once need ~25 GB; lucidrains' RMT and labml-nn have neither adaptive softmax nor tied embeddings, so
there they meet memlm built with their head: one full softmax, untied, the "peer-head" variant). Writes
bench/results/peers_cpu.json and bench/results/peers_cpu.md. Never part of the test suite; nothing here asserts
a timing.

On a GPU (`--device cuda`, bench/benchmarks/gpu_run.sh phase `peers`): the peers come from PYTHONPATH (wheels
installed to /tmp/site; no venv is entered), the shapes are "gpu-aligned" (512 / 8 x 64 / 2048) and "gpu-paper"
(the WikiText-103 base) at 64 lanes with the adaptive softmax, the models are stepped as above with the device
synchronised at the end of each step, memlm also as "fast" (its layers compiled), and no matmul floor is
recorded: the hardware limit there is bench_mfu.py's MFU. Writes bench/results/peers_cuda.json and .md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

# The checkout on sys.path here, not through an install: this script starts under a bare python3.11 and re-executes
# itself in .bench-venv, where memlm is not installed (bench/common.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Standard library only, both: this script starts outside the peer venv and re-executes itself inside it.
from memlm.bench.common import RESULTS, ROOT, load_average, paired_ratio, write_result
from memlm.bench.interrupt import stop_in_one_line

VENV = ROOT / ".bench-venv"
VENV_PY = VENV / "bin" / "python"
PEERS = Path(__file__).resolve().parent / "peers"  # the adapters, and the pinned libraries they need
REQUIREMENTS = PEERS / "requirements.txt"
REQUIREMENTS_NODEPS = PEERS / "requirements_nodeps.txt"
TORCH_PIN = "torch==2.13.0"
EXCLUDE_LINE = "/.bench-venv/"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", action="store_true",
                   help="create or update ./.bench-venv (torch first, then the pinned peers), then run")
    p.add_argument("--setup-only", action="store_true", help="create or update ./.bench-venv and stop")
    p.add_argument("--shapes", default="small,wt103", help="comma list of: small, wt103")
    p.add_argument("--precisions", default="fp32,bf16", help="comma list of: fp32, bf16 (CPU autocast)")
    p.add_argument("--models", default="", help="comma list of model keys (default all; memlm models are kept "
                   "whenever a chosen peer needs them)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed rounds per group, every shape (default: small 20, wt103 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default: small 3, wt103 1)")
    p.add_argument("--wt103-lanes", type=int, default=2, help="lanes B at the WikiText-103 shape")
    p.add_argument("--device", default="cpu", help="cpu (one thread, in .bench-venv) or cuda (peers on PYTHONPATH)")
    p.add_argument("--no-floor", action="store_true", help="record no matmul floor (always so on cuda)")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/results/peers_DEVICE.json); the Markdown table goes next to it "
                        "with the suffix .md")
    return p.parse_args(argv)


# --- the benchmark environment ---------------------------------------------------------------------------------

def in_bench_venv() -> bool:
    return VENV.exists() and Path(sys.prefix).resolve() == VENV.resolve()


def python311() -> str:
    """An interpreter for the venv: the local torch 2.13.0 CPU wheel is built for CPython 3.11."""
    if sys.version_info[:2] == (3, 11) and not in_bench_venv():
        return sys.executable
    found = shutil.which("python3.11")
    if not found:
        sys.exit("bench_peers: error: --setup needs Python 3.11 (python3.11 on PATH): torch 2.13.0's wheel is cp311")
    return found


def setup() -> None:
    """Create .bench-venv and install the pinned peers; safe to re-run. Keeps the venv out of git's view."""
    if not VENV_PY.exists():
        print(f"bench_peers: creating {VENV.relative_to(ROOT)}", flush=True)
        subprocess.run([python311(), "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV_PY), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    print(f"bench_peers: installing {TORCH_PIN} (first, alone), then {REQUIREMENTS.name} and "
          f"{REQUIREMENTS_NODEPS.name} (--no-deps)", flush=True)
    subprocess.run(pip + [TORCH_PIN], check=True)
    subprocess.run(pip + ["-r", str(REQUIREMENTS)], check=True)
    subprocess.run(pip + ["--no-deps", "-r", str(REQUIREMENTS_NODEPS)], check=True)
    exclude = ROOT / ".git" / "info" / "exclude"
    if exclude.parent.is_dir():
        lines = exclude.read_text().splitlines() if exclude.exists() else []
        if EXCLUDE_LINE not in lines:
            with exclude.open("a") as f:
                f.write(("\n" if lines and lines[-1] else "") + EXCLUDE_LINE + "\n")
    check = ("import torch, transformers, recurrent_memory_transformer_pytorch, labml_nn.transformers.xl; "
             "print('bench_peers: .bench-venv ready: torch', torch.__version__, '| transformers', "
             "transformers.__version__)")
    subprocess.run([str(VENV_PY), "-W", "ignore", "-c", check], check=True)


def enter_bench_venv(argv: list[str]) -> None:
    """Re-execute this script with .bench-venv's interpreter and one thread, or refuse in one line."""
    if not VENV_PY.exists():
        sys.exit("bench_peers: error: the benchmark environment .bench-venv is missing; create it with "
                 "`python3.11 bench/benchmarks/bench_peers.py --setup` (installs the pinned peers, then runs)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    os.execve(str(VENV_PY), [str(VENV_PY), str(Path(__file__).resolve()), *argv], env)


# --- the benchmark ----------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, argv: list[str]) -> dict:
    cuda = args.device.startswith("cuda")
    floor_wanted = not (cuda or args.no_floor)
    if not cuda:
        os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads its OpenMP runtime
        os.environ["MKL_NUM_THREADS"] = "1"
    import gc
    import platform
    import statistics
    import warnings

    warnings.filterwarnings("ignore", message=".*_register_pytree_node.*")  # transformers 4.34 on torch 2.13
    import torch

    if not cuda:
        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
    from memlm.bench.benchmarks.peers import PRECISIONS, RUNNERS, Shape, make_batches

    KV_CACHE = {"memlm-rmt-xl": ("memlm-rmt-xl:kv-cache",)}  # the variant that caches as lucidrains' XL memories do
    from memlm.bench.benchmarks.peers.matmul_floor import MatmulFloor
    from memlm.trainer.runtime.allocator import tune_allocator

    # memlm's processes keep their step memory mapped (trainer/runtime/allocator.py); in this one process every model,
    # peers included, runs under that setting, so it changes no ratio (bench_allocator.py measures it alone).
    allocator = tune_allocator()

    shapes = {
        # one group of every model; memlm's RMT + cache also with the peer's cache of keys and values
        "small": Shape("small", n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024, vocab=8000, tgt_len=128,
                       mem_len=128, lanes=8, mem_tokens=10, warmup=3, steps=20,
                       groups=(tuple(k for key in RUNNERS for k in (key, *KV_CACHE.get(key, ()))),)),
        "wt103": Shape("wt103", n_layer=16, d_model=410, n_head=10, d_head=41, d_inner=2100, vocab=267735,
                       tgt_len=150, mem_len=150, lanes=args.wt103_lanes, mem_tokens=10,
                       cutoffs=(20000, 40000, 200000), token_law="zipf", warmup=1, steps=2,
                       # The peers without adaptive softmax or tying meet memlm with their head ("peer-head").
                       groups=(("memlm-txl", "hf-transfoxl", "memlm-lamemo"),
                               ("memlm-txl:peer-head", "labml-txl"),
                               ("memlm-rmt:peer-head", "lucidrains-rmt"),
                               ("memlm-rmt-xl:peer-head", "lucidrains-rmt-xl"))),
    }
    # On a GPU: 64 lanes (bench_mfu.py's), the adaptive softmax, memlm as the trainer runs it and "fast".
    # memlm's fast variant first: a peer's ratio is against the first memlm entry of its kind in the group.
    gpu_groups = (("memlm-txl:fast", "memlm-txl", "hf-transfoxl"),
                  ("memlm-txl:peer-head", "labml-txl"),
                  ("memlm-rmt:peer-head", "lucidrains-rmt"))
    shapes["gpu-aligned"] = Shape("gpu-aligned", n_layer=16, d_model=512, n_head=8, d_head=64, d_inner=2048,
                                  vocab=267735, tgt_len=150, mem_len=150, lanes=64, mem_tokens=10,
                                  cutoffs=(20000, 40000, 200000), token_law="zipf", warmup=3, steps=10,
                                  groups=gpu_groups)
    shapes["gpu-paper"] = replace(shapes["gpu-aligned"], name="gpu-paper", d_model=410, n_head=10, d_head=41,
                                  d_inner=2100)
    chosen_shapes = [s for s in args.shapes.split(",") if s]
    precisions = [p for p in args.precisions.split(",") if p]
    for s in chosen_shapes:
        if s not in shapes:
            sys.exit(f"bench_peers: error: unknown shape {s!r}; valid: {', '.join(shapes)}")
    for p in precisions:
        if p not in PRECISIONS:
            sys.exit(f"bench_peers: error: unknown precision {p!r}; valid: {', '.join(PRECISIONS)}")
    keys = [k for k in args.models.split(",") if k] or list(RUNNERS)
    for k in keys:
        if k not in RUNNERS:
            sys.exit(f"bench_peers: error: unknown model {k!r}; valid: {', '.join(RUNNERS)}")
    wanted = set(keys) | {RUNNERS[k].compare_with for k in keys if RUNNERS[k].compare_with}

    def lib_version(name: str) -> str | None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(name)
        except PackageNotFoundError:
            return None

    t_start = time.time()
    report = {
        "benchmark": "peers: one training step per segment (forward with carried memory, mean NLL, backward, "
                     "clip 0.25, Adam), models of a group interleaved round-robin, one thread",
        "command": " ".join(["bench/benchmarks/bench_peers.py", *argv]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "libraries": {n: lib_version(n) for n in ("transformers", "recurrent-memory-transformer-pytorch",
                                                  "hyper-connections", "labml-nn", "labml", "einops")},
        "optimizer": "torch.optim.Adam(lr=2.5e-4), defaults otherwise; clip_grad_norm_ 0.25; zero_grad(set_to_none)",
        "loadavg_start": load_average(),
        "allocator": {"tuned": allocator.tuned, "reason": allocator.reason},
        "shapes": {},
    }
    md_parts = [f"# Peer benchmark (`bench/benchmarks/bench_peers.py`)\n\ntorch {torch.__version__}, "
                f"{torch.cuda.get_device_name() if cuda else '1 thread, ' + cpu_name()}; "
                f"libraries: " + ", ".join(f"{k} {v}" for k, v in report["libraries"].items() if v) + "\n"]

    for shape_name in chosen_shapes:
        shape = shapes[shape_name]
        if args.steps is not None or args.warmup is not None:
            shape = replace(shape, steps=args.steps if args.steps is not None else shape.steps,
                            # at least one: the matmul floor is recorded on a step that carries memory
                            warmup=max(1, args.warmup) if args.warmup is not None else shape.warmup)
        groups, seen = [], set()
        for g in shape.groups or (tuple(RUNNERS),):
            g = tuple(e for e in g if e.partition(":")[0] in wanted)
            # Keep a group that times a chosen model not timed in an earlier group (memlm models that are only
            # there as a chosen peer's reference ride along).
            if any(e.partition(":")[0] in keys and e not in seen for e in g):
                groups.append(g)
                seen |= set(g)
        batches = [(tokens.to(args.device), targets.to(args.device)) for tokens, targets in make_batches(shape, 4)]
        shape_report = {"shape": shape.to_json(), "models": {}, "unavailable": {}, "results": {}}
        report["shapes"][shape_name] = shape_report
        for precision in precisions:
            group_reports = []
            for group in groups:
                print(f"[{shape_name} {precision}] {', '.join(group)}", flush=True)
                g = {"models": {}, "pairs": {}, "skipped": {}}
                runners = {}
                for key in group:  # "model" or "model:variant"
                    if key in shape_report["unavailable"]:
                        continue
                    try:
                        name, _, variant = key.partition(":")
                        runners[key] = RUNNERS[name](shape, variant, device=args.device)
                    except Exception as e:  # a peer that does not import or build here is reported, not fatal
                        shape_report["unavailable"][key] = f"{type(e).__name__}: {e}"
                        print(f"  {key}: unavailable ({shape_report['unavailable'][key]})", flush=True)
                        continue
                    r = runners[key]
                    shape_report["models"].setdefault(key, {
                        "label": r.label, "library": r.library, "compare_with": r.compare_with,
                        "params": r.param_counts(), "settings": r.settings(), "notes": list(r.notes),
                    })
                g["loadavg_before"] = load_average()
                t0 = time.time()

                def drop(key: str, what: str, e: Exception) -> None:
                    g["skipped"][key] = f"{what} failed under {precision}: {type(e).__name__}: {e}"
                    print(f"  {key}: skipped ({g['skipped'][key]})", flush=True)
                    runners.pop(key, None)
                    g["models"].pop(key, None)

                floors = {}
                for key, r in list(runners.items()):
                    try:
                        g["models"][key] = {"loss_at_init": r.loss_at_init(batches[0], precision)}
                    except Exception as e:
                        drop(key, "forward", e)
                times = {k: [] for k in runners}
                floor_times = {k: [] for k in runners}
                optimizer_times = {k: [] for k in runners}
                losses = {k: [] for k in runners}
                for i in range(shape.warmup + shape.steps):
                    for key, r in list(runners.items()):
                        if floor_wanted and i == max(1, shape.warmup) and key not in floors:
                            # one extra step, with the memory that warm-up carried in, recorded: its matmuls are
                            # replayed after each of the model's timed steps
                            try:
                                floors[key] = MatmulFloor(r, batches[-1], precision)
                            except Exception as e:
                                drop(key, "matmul recording", e)
                                continue
                        t = time.perf_counter()
                        try:
                            loss = r.step(batches[i % len(batches)], precision)
                        except Exception as e:
                            drop(key, "training step", e)
                            continue
                        dt = time.perf_counter() - t
                        if i >= shape.warmup:
                            times[key].append(dt)
                            optimizer_times[key].append(r.optimizer_s)
                            if key in floors:
                                floor_times[key].append(floors[key].time())
                        losses[key].append(loss)
                g["wall_s"] = time.time() - t0
                g["loadavg_after"] = load_average()
                tokens = shape.lanes * shape.tgt_len
                for key in runners:
                    med = statistics.median(times[key])
                    optimizer = statistics.median(optimizer_times[key])
                    g["models"][key].update({
                        "optimizer_s": optimizer, "optimizer_times_s": optimizer_times[key],
                        "median_step_s": med, "min_step_s": min(times[key]), "step_times_s": times[key],
                        "tokens_per_s": tokens / med, "losses": losses[key],
                    })
                    if key in floors:  # CPU only
                        floor = statistics.median(floor_times[key])
                        g["models"][key].update({
                            "step_over_floor_and_optimizer": med / (floor + optimizer),
                            "matmul_floor_s": floor, "matmul_floor_times_s": floor_times[key],
                            "matmul_calls": floors[key].n_calls, "matmul_flops_per_step": floors[key].flops,
                            "matmul_gflops_per_s": floors[key].flops / floor / 1e9, "step_over_floor": med / floor,
                        })
                for key, r in runners.items():
                    kind = [e for e in runners if r.compare_with and e.partition(":")[0] == r.compare_with]
                    base = kind[0] if kind else None
                    if base:
                        peer_t, memlm_t = times[key], times[base]
                        g["pairs"][key] = {
                            "memlm": base,
                            "memlm_over_peer_tokens_per_s": statistics.median(peer_t) / statistics.median(memlm_t),
                            "memlm_over_peer_paired": paired_ratio(peer_t, memlm_t),
                            # the other memlm entries of its kind in the group (variants), against the same peer
                            "also": {e: {"memlm_over_peer_tokens_per_s": statistics.median(peer_t)
                                         / statistics.median(times[e]),
                                         "memlm_over_peer_paired": paired_ratio(peer_t, times[e])}
                                     for e in kind[1:]},
                        }
                    if base and base in floors:
                        g["pairs"][key].update({
                            # what memlm/peer would be if memlm's step took only its matmuls' time, and with
                            # its clip + Adam (the same torch code in every library) added
                            "ceiling_peer_over_memlm_floor": statistics.median(peer_t) / statistics.median(
                                floor_times[base]),
                            "ceiling_peer_over_memlm_floor_and_optimizer": statistics.median(peer_t) / (
                                statistics.median(floor_times[base]) + statistics.median(optimizer_times[base])),
                        })
                line = "  ".join(f"{k} {v['tokens_per_s']:.0f} tok/s" for k, v in g["models"].items())
                print(f"  {line}  (load {g['loadavg_before'][0]:.2f} -> {g['loadavg_after'][0]:.2f}, "
                      f"{g['wall_s']:.0f} s)", flush=True)
                group_reports.append(g)
                runners.clear()
                r = None  # the last model built must not outlive its group (WikiText-103 models are GBs)
                gc.collect()
            shape_report["results"][precision] = group_reports
            md_parts.append(markdown_table(shape_name, shape, precision, shape_report))
            print(md_parts[-1], flush=True)

    report["loadavg_end"] = load_average()
    report["wall_s"] = time.time() - t_start
    out = write_result(args.out or RESULTS / f"peers_{args.device.split(':')[0]}.json", report)
    md = out.with_suffix(".md")
    md.write_text("\n".join(md_parts))
    print(f"wrote {out} and {md} ({report['wall_s'] / 60:.1f} min, load {report['loadavg_start'][0]:.2f} -> "
          f"{report['loadavg_end'][0]:.2f})")
    return report


def cpu_name() -> str:
    from memlm.trainer.runtime.process import cpu_model  # stdlib only: importable in the bench venv

    return cpu_model()


def markdown_table(shape_name: str, shape, precision: str, shape_report: dict) -> str:
    s = shape
    head = (f"\n## {shape_name}, {precision}: {s.n_layer} layers, d {s.d_model}, {s.n_head} x {s.d_head} heads, "
            f"d_inner {s.d_inner}, N = M = {s.tgt_len}, {s.lanes} lanes, V {s.vocab:,}"
            + (f" (adaptive softmax {'/'.join(f'{c // 1000}k' for c in s.cutoffs)})" if s.cutoffs else "")
            + f", R = {s.mem_tokens} RMT memory tokens; {s.warmup} warm-up + {s.steps} timed rounds\n\n")
    rows = ["| group | model | library | params (body) | loss at init | ms/step | tokens/s | matmuls only: ms "
            "(GFLOP, GFLOP/s) | clip + Adam: ms | step / (matmuls + Adam) | memlm/peer (paired) | ceiling "
            "| load avg |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    models = shape_report["models"]
    for gi, g in enumerate(shape_report["results"][precision], 1):
        load = f"{g['loadavg_before'][0]:.2f} -> {g['loadavg_after'][0]:.2f}"
        for key, m in g["models"].items():
            info = models[key]
            pair = g["pairs"].get(key)
            ratio = (f"{pair['memlm_over_peer_tokens_per_s']:.2f}x ({pair['memlm_over_peer_paired']:.2f}x)"
                     if pair else "")
            for other, also in (pair or {}).get("also", {}).items():
                ratio += (f"; {models[other]['label']}: {also['memlm_over_peer_tokens_per_s']:.2f}x "
                          f"({also['memlm_over_peer_paired']:.2f}x)")
            ceiling = (f"{pair['ceiling_peer_over_memlm_floor_and_optimizer']:.2f}x"
                       if pair and "ceiling_peer_over_memlm_floor_and_optimizer" in pair else "")
            floor = (f"{1000 * m['matmul_floor_s']:.0f} ({m['matmul_flops_per_step'] / 1e9:.1f}, "
                     f"{m['matmul_gflops_per_s']:.0f})" if "matmul_floor_s" in m else "-")
            over = f"{m['step_over_floor_and_optimizer']:.2f}" if "step_over_floor_and_optimizer" in m else "-"
            rows.append(
                f"| {gi} | {info['label']} | {info['library']} | {info['params']['total']:,} "
                f"({info['params']['body']:,}) | {m['loss_at_init']:.3f} | {1000 * m['median_step_s']:.0f} "
                f"| {m['tokens_per_s']:,.0f} | {floor} | {1000 * m['optimizer_s']:.0f} "
                f"| {over} | {ratio} | {ceiling} | {load} |"
            )
        for key, why in g["skipped"].items():
            rows.append(f"| {gi} | {models.get(key, {}).get('label', key)} | | | | | | | | | skipped: {why} | | |")
    for key, why in shape_report["unavailable"].items():
        rows.append(f"| | {key} | | | | | | | | | unavailable: {why} | | |")
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.setup or args.setup_only:
        setup()
        if args.setup_only:
            return
        argv = [a for a in argv if a not in ("--setup", "--setup-only")]
    if not args.device.startswith("cuda") and not in_bench_venv():  # a GPU machine has the peers as wheels
        enter_bench_venv(argv)
    run(args, argv)


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
