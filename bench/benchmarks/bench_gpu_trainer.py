"""The real trainer (`memlm train`, DeepSpeed) on a lent GPU: bf16 at ZeRO 0-3, resume, fused Adam (for a GPU machine).

    python bench/benchmarks/bench_gpu_trainer.py --data DATA_DIR --runs /tmp/gpu_runs \
        --out bench/results/trainer_cuda.json
    python bench/benchmarks/bench_gpu_trainer.py --data DATA_DIR --size tiny --runs /tmp/r --out /tmp/t.json \
        --phases resume timing                                 # CPU smoke run of the same procedure

Every run is a separate `python -m memlm train` process (a fresh CUDA context, so peak_mem_mb is that run's own),
on a prepared word-level WikiText-2 (vocabulary 33,278), with the WikiText-103 base shape of
the presets paper/wt103/{txl,lamemo} (16 layers, 10 x 41, d_model 410, d_inner 2100, N = M = 150, 64 lanes) and
an adaptive softmax with one cutoff at 20,000. Phases:

- timing: txl and lamemo at ZeRO 0, 1, 2, 3, bf16, DeepSpeed's torch Adam; metrics rows every 10 steps.
- fused: txl and lamemo at ZeRO 0 and 2 with deepspeed.torch_adam=false (DeepSpeed's FusedAdam, JIT-built with
  nvcc on first use; build it beforehand with --build-fused-adam so its minutes stay out of the timed runs).
- resume: an uninterrupted run, the same run stopped after half the steps (--stop-at), and its --resume; losses
  per step compared (bit-identical or not, max |difference|). Three settings: txl ZeRO-0 and lamemo ZeRO-2 with
  dropout 0 and train.deterministic=true, and txl ZeRO-0 with the preset's dropout 0.1 and deterministic=true.
  The stopped run's first half against the uninterrupted run's is the run-to-run floor of the same setting.

tokens/s is the median of the metrics rows after the first (the first window holds CUDA warm-up: cuBLAS
handles, allocator growth). Nothing here asserts a timing; the JSON holds every metrics row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT, child_env, write_result
from memlm.bench.interrupt import stop_in_one_line

SIZES = {
    # The WikiText-103 base shape on WikiText-2's word vocabulary.
    "base": dict(presets={"txl": "paper/wt103/txl", "lamemo": "paper/wt103/lamemo"},
                 overrides=["model.vocab_size=33278", "model.cutoffs=[20000]", "data.batch_size=64"],
                 steps=40, log_every=10, resume_steps=30),
    # CPU smoke run of the same procedure.
    "tiny": dict(presets={"txl": "tiny/txl", "lamemo": "tiny/lamemo"},
                 overrides=["model.vocab_size=33278", "model.cutoffs=[20000]"], steps=6, log_every=2, resume_steps=6),
}


def train(name: str, args, arch: str, overrides: list[str], env_extra: dict | None = None,
          stop_at: int | None = None, resume: bool = False, run_dir: Path | None = None) -> dict:
    size = SIZES[args.size]
    run_dir = run_dir or Path(args.runs) / name
    if args.deadline and time.time() > args.deadline:
        print(f"skipping {name}{' (resume)' if resume else ''}: past the deadline", flush=True)
        return {"name": name, "arch": arch, "rc": None, "skipped": "past the deadline", "wall_s": 0.0,
                "run_dir": str(run_dir), "env": env_extra or {}, "rows": []}
    cmd = [sys.executable, "-m", "memlm", "train", size["presets"][arch], f"data.path={args.data}",
           *size["overrides"], "deepspeed.precision=bf16", "tracking.enabled=false", "train.eval_every=0",
           "train.save_every=0", "train.warmup_steps=0", *overrides, "--out", str(run_dir)]
    if stop_at is not None:
        cmd += ["--stop-at", str(stop_at)]
    if resume:
        cmd += ["--resume"]
    env = child_env(PYTHONUNBUFFERED="1", **(env_extra or {}))
    log = Path(args.runs) / f"{name}{'-resume' if resume else ''}.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    rows = read_rows(run_dir / "metrics.jsonl")
    result = {"name": name, "arch": arch, "rc": rc, "wall_s": wall, "cmd": cmd[1:], "run_dir": str(run_dir),
              "env": env_extra or {}}
    if rc != 0:
        result["error_tail"] = log.read_text()[-3000:]
    print(f"[{time.strftime('%H:%M:%S')}] {name}{' (resume)' if resume else ''}: rc {rc}, {wall:.1f} s, "
          f"{len(rows)} metrics rows", flush=True)
    return {**result, "rows": rows}


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(result: dict) -> dict:
    rows = result["rows"]
    steady = rows[1:] if len(rows) > 1 else rows
    summary = {k: result[k] for k in ("name", "arch", "rc", "wall_s", "env")}
    if result.get("skipped"):
        summary["skipped"] = result["skipped"]
    if result.get("error_tail"):
        summary["error_tail"] = result["error_tail"]
    if rows:
        summary.update(steps=rows[-1]["step"], final_loss=rows[-1]["loss"], first_loss=rows[0]["loss"],
                       tokens_per_s_median=statistics.median(r["tokens_per_s"] for r in steady),
                       tokens_per_s_first_window=rows[0]["tokens_per_s"],
                       peak_mem_mb=max(r["peak_mem_mb"] for r in rows),
                       grad_norm_last=rows[-1]["grad_norm"])
    ds = Path(result["run_dir"]) / "ds_config.json"
    if ds.exists():
        conf = json.loads(ds.read_text())
        summary["ds_config"] = {"zero_stage": conf["zero_optimization"]["stage"], "bf16": conf.get("bf16"),
                                "torch_adam": conf["optimizer"]["params"].get("torch_adam"),
                                "optimizer": conf["optimizer"]["type"]}
    return summary


def compare_losses(a: list[dict], b: list[dict], steps: range) -> dict:
    la = {r["step"]: r["loss"] for r in a}
    lb = {r["step"]: r["loss"] for r in b}
    common = [s for s in steps if s in la and s in lb]
    if not common:
        return {"steps_compared": 0}
    diffs = [abs(la[s] - lb[s]) for s in common]
    return {"steps_compared": len(common), "first_step": common[0], "last_step": common[-1],
            "bit_identical": all(la[s] == lb[s] for s in common), "max_abs_diff": max(diffs),
            "first_step_diff": diffs[0], "last_step_diff": diffs[-1],
            "first_differing_step": next((s for s in common if la[s] != lb[s]), None)}


def phase_timing(args, stages, archs, fused: bool) -> list[dict]:
    size = SIZES[args.size]
    specs = [(f"{arch}-z{stage}-{'fused' if fused else 'torchadam'}", arch, stage)
             for arch in archs for stage in stages]
    if args.only:  # these runs only, in the order given
        specs = sorted((s for s in specs if s[0] in args.only), key=lambda s: args.only.index(s[0]))
    out = []
    for name, arch, stage in specs:
        over = [f"deepspeed.zero_stage={stage}", f"train.steps={size['steps']}", f"train.log_every={size['log_every']}"]
        if fused:
            over.append("deepspeed.torch_adam=false")
        out.append(summarize(train(name, args, arch, over)))
    return out


def phase_resume(args) -> list[dict]:
    size = SIZES[args.size]
    steps = size["resume_steps"]
    half = steps // 2
    # CUBLAS_WORKSPACE_CONFIG: cuBLAS needs it for torch.use_deterministic_algorithms on CUDA.
    det_env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    settings = [("txl", 0, ["model.dropout=0.0"]), ("lamemo", 2, ["model.dropout=0.0"]), ("txl", 0, [])]
    out = []
    for arch, stage, extra in settings:
        tag = "drop0" if extra else "drop0.1"
        name = f"resume-{arch}-z{stage}-{tag}-det"
        over = [f"deepspeed.zero_stage={stage}", f"train.steps={steps}", "train.log_every=1",
                "train.deterministic=true", *extra]
        full = train(name + "-full", args, arch, over, det_env)
        if full["rc"] not in (0, None):  # deterministic algorithms refused on this device: measure without them
            print(f"  {name}: failed with train.deterministic=true; again without it", flush=True)
            name, over = name[: -len("-det")] + "-nondet", [o for o in over if o != "train.deterministic=true"]
            full = train(name + "-full", args, arch, over, det_env)
        stopped_dir = Path(args.runs) / (name + "-stopped")
        stopped = train(name + "-stopped", args, arch, over, det_env, stop_at=half, run_dir=stopped_dir)
        stopped_rows = list(stopped["rows"])
        resumed = train(name + "-stopped", args, arch, over, det_env, resume=True, run_dir=stopped_dir)
        resumed_rows = [r for r in resumed["rows"] if r["step"] > half]
        out.append({"name": name, "arch": arch, "zero_stage": stage, "dropout": "0" if extra else "preset (0.1)",
                    "deterministic": "train.deterministic=true" in over, "steps": steps, "stopped_at": half,
                    "rc": [full["rc"], stopped["rc"], resumed["rc"]],
                    "errors": [r.get("error_tail") for r in (full, stopped, resumed) if r.get("error_tail")],
                    "wall_s": [full["wall_s"], stopped["wall_s"], resumed["wall_s"]],
                    "before_stop_vs_full": compare_losses(stopped_rows, full["rows"], range(1, half + 1)),
                    "after_resume_vs_full": compare_losses(resumed_rows, full["rows"], range(half + 1, steps + 1)),
                    "losses_full": [r["loss"] for r in full["rows"]],
                    "losses_stopped_then_resumed": [r["loss"] for r in resumed["rows"]]})
        print(f"  {name}: before stop {out[-1]['before_stop_vs_full']}, after resume {out[-1]['after_resume_vs_full']}",
              flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a prepared word-level WikiText-2 DATA_DIR")
    parser.add_argument("--runs", required=True, help="folder for the run folders and their logs")
    parser.add_argument("--out", default=str(RESULTS / "trainer_cuda.json"))
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--phases", nargs="+", default=["resume", "timing", "fused"],
                        choices=["resume", "timing", "fused"])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--fused-stages", nargs="+", type=int, default=[0, 2])
    parser.add_argument("--archs", nargs="+", default=["txl", "lamemo"])
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="timing/fused runs by name (e.g. lamemo-z2-torchadam txl-z0-fused), in this order")
    parser.add_argument("--fused-ready", default=None, metavar="FILE",
                        help="before the fused phase, wait (until the deadline) for FILE: the FusedAdam build's marker")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="seconds since the epoch after which no further run starts (0: none)")
    args = parser.parse_args()
    args.data = str(Path(args.data).resolve())
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    result = {"benchmark": "trainer_cuda", "size": args.size, "data": args.data, "phases": {}}
    try:
        import torch

        result["torch"] = torch.__version__
        result["cuda"] = torch.version.cuda
        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        import deepspeed

        result["deepspeed"] = deepspeed.__version__
    except Exception as exc:  # noqa: BLE001 - recorded, the runs say the rest
        result["import_error"] = repr(exc)
    for phase in args.phases:
        if args.deadline and time.time() > args.deadline:
            result["phases"][phase] = "skipped: past the deadline"
            print(f"skipping {phase}: past the deadline", flush=True)
            continue
        if phase == "fused" and args.fused_ready:
            t_wait = time.perf_counter()
            while not Path(args.fused_ready).exists() and (not args.deadline or time.time() < args.deadline):
                time.sleep(1)
            result["fused_build_wait_s"] = time.perf_counter() - t_wait
            if Path(args.fused_ready).exists():
                result["fused_build"] = Path(args.fused_ready).read_text().strip()
            print(f"fused phase: waited {result['fused_build_wait_s']:.0f} s for {args.fused_ready}: "
                  f"{result.get('fused_build', 'not there')}", flush=True)
        t0 = time.perf_counter()
        if phase == "timing":
            rows = phase_timing(args, args.stages, args.archs, fused=False)
        elif phase == "fused":
            rows = phase_timing(args, args.fused_stages, args.archs, fused=True)
        else:
            rows = phase_resume(args)
        result["phases"][phase] = {"wall_s": time.perf_counter() - t0, "runs": rows}
        write_result(out, result)  # after every phase: a killed call keeps what ran
    write_result(out, result)
    print(f"wrote {out}")
    for phase in ("timing", "fused"):
        data = result["phases"].get(phase)
        if isinstance(data, dict):
            for r in data["runs"]:
                print(f"{r['name']:>24}: rc {r['rc']} tokens/s {r.get('tokens_per_s_median', float('nan')):,.0f} "
                      f"loss {r.get('final_loss', float('nan')):.4f} "
                      f"peak {r.get('peak_mem_mb', float('nan')):,.0f} MiB "
                      f"wall {r['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
