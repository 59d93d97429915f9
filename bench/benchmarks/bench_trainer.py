"""Trainer overhead and data-parallel scaling on CPU: `memlm train` against the bare model loop, 2 ranks against 1.

    .venv/bin/python bench/benchmarks/bench_trainer.py                  # -> bench/results/trainer_cpu.json
    .venv/bin/python bench/benchmarks/bench_trainer.py --steps 20 --repeats 1 --out /tmp/t.json   # a quick look

Corpus: WikiText-2 (../shared/data/wikitext-2) prepared with an 8k BPE sentencepiece model, so the model is
bench_models.py's configuration (4 layers, d_model 256, 4 x 64 heads, d_inner 1024, V 8192, B 8, N = M = 64).

1. Overhead. The trainer (DeepSpeed engine at ZeRO 0, fp32, the lane stream, memory carried and detached, the
   step's one all-reduce of its figures, the non-finite check with its gradient norm on every step, clipping, Adam,
   LR schedule) against a bare loop over the same model and the same batches (read beforehand, so the loop does no
   I/O): forward with carried memory, mean NLL, backward, clip, torch Adam step. Headline: the Trainer, opened and
   stepped through its public entry (open_trainer, build, train_step: trainer/loop/train.py) one optimizer step at
   a time, alternating step by step with the bare loop after `--warmup` steps of each; overhead = median of the
   per-step ratios - 1
   (target < 10%): on a shared machine, separate blocks differ by +-10% in kernel time alone. Also reported:
   whole `memlm train` runs in this process (their own metrics rows: tokens_per_s of each --log-every window,
   writing the row included) against bare blocks run between them.
2. Scaling. Global tokens/s of 1 rank (B 8, all cores) against 2 ranks under torchrun at ZeRO-2 (B 4 each, one
   thread each, the same global batch), from the runs' metrics.jsonl. On a 2-core machine this measures what
   splitting the cores between two ranks costs (gloo all-reduce of the gradients on the same cores), not
   multi-node scaling.
Never part of the test suite; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT, WIKITEXT2, child_env, load_average, paired_ratio, write_result
from memlm.bench.interrupt import stop_in_one_line
from memlm.models.registry import arch_spec


def run_overrides(args, data: Path, arch: str, steps: int, **extra) -> dict:
    base = {
        "model.arch": arch, "model.n_layer": 4, "model.n_head": 4, "model.d_head": 64, "model.d_model": 256,
        "model.d_inner": 1024, "model.vocab_size": 8192, "model.tgt_len": 64,
        "model.mem_len": 0 if arch_spec(arch).mem_len == "zero" else 64, "model.dropout": 0.0, "model.dropatt": 0.0,
        "data.path": str(data), "data.batch_size": args.batch, "train.steps": steps, "train.warmup_steps": 0,
        "train.lr": 2.5e-4, "train.save_every": 0, "train.keep_last": 1, "train.eval_every": 0,
        "train.log_every": args.log_every, "tracking.enabled": False, "deepspeed.zero_stage": 0,
        "deepspeed.precision": "fp32",
    }
    base.update(extra)
    return base


def prepare_corpus(work: Path) -> Path:
    from memlm.data_pipeline.prepare import prepare

    if not (WIKITEXT2 / "wiki.train.tokens").is_file():
        sys.exit(f"bench_trainer: WikiText-2 not found at {WIKITEXT2}")
    out = work / "wt2-bpe8k"
    prepare("wikitext", WIKITEXT2, out, tokenizer="spm-bpe", vocab_size=8192, workers=2, progress=False)
    return out


def trainer_step_times(args, data: Path, arch: str, work: Path, block: int) -> list[float]:
    """Seconds per step of one in-process `memlm train` run, from its metrics rows (after warm-up)."""
    from memlm.trainer.config.run_config import config_from_dict
    from memlm.trainer.loop.train import run

    out = work / f"trainer-{arch}-{block}"
    cfg = config_from_dict({}, run_overrides(args, data, arch, args.warmup + args.steps))
    run(cfg, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = args.batch * 64
    times = [tokens_per_step / r["tokens_per_s"] for r in rows[args.warmup // args.log_every:]]
    shutil.rmtree(out)
    return times


def collect_batches(args, data: Path, count: int) -> list:
    from memlm.data_pipeline.stream import LaneStream

    stream = LaneStream(data, "train", rank=0, world_size=1, lanes=args.batch, seg_len=64, mode="train", seed=1234)
    return [next(stream) for _ in range(count)]


class BareLoop:
    """The least any trainer must do per step: forward with carried memory, backward, clip, Adam."""

    def __init__(self, args, data: Path, arch: str, batches: list):
        import torch

        from memlm.models import build_model
        from memlm.trainer.config.run_config import config_from_dict

        cfg = config_from_dict({}, run_overrides(args, data, arch, 1))
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg.model).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.train.lr)
        self.clip = cfg.train.clip
        self.memory = self.model.init_memory(args.batch)
        self.batches, self.i = batches, 0

    def step(self) -> float:
        import torch

        from memlm.models import map_memory

        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        t0 = time.perf_counter()
        out = self.model(batch.tokens, self.memory, reset=batch.reset, targets=batch.targets)
        scored = (batch.targets != -100).sum().clamp(min=1)
        (out.nll.sum() / scored).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.memory = map_memory(torch.Tensor.detach, out.memory)
        return time.perf_counter() - t0


class TrainerSteps:
    """The real Trainer (engine, stream, memory, the step's all-reduce and non-finite check, clipping, Adam,
    schedule), opened as `memlm train` opens it and stepped one optimizer step at a time through train_step(), so
    its steps can alternate with the bare loop's. The metrics row itself is not written (the whole-run figure
    includes it)."""

    def __init__(self, args, data: Path, arch: str, work: Path):
        import torch

        from memlm.trainer.config.run_config import config_from_dict
        from memlm.trainer.loop.train import open_trainer

        cfg = config_from_dict({}, run_overrides(args, data, arch, 10**6))
        self.trainer = open_trainer(cfg, work / f"paired-{arch}")
        # open_trainer fits the threads to the cores as `memlm train` does; both loops here run at --threads.
        torch.set_num_threads(args.threads)
        self.trainer.build()

    def step(self) -> float:
        t0 = time.perf_counter()
        self.trainer.train_step()
        return time.perf_counter() - t0


def overhead(args, data: Path, work: Path) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    batches = collect_batches(args, data, args.warmup + args.steps)
    result = {}
    for arch in args.archs:
        bare = BareLoop(args, data, arch, batches)
        # Paired: one trainer step, one bare step, alternately, so drifts of a shared machine hit both alike.
        stepper = TrainerSteps(args, data, arch, work)
        for _ in range(args.warmup):
            stepper.step()
            bare.step()
        pairs = [(stepper.step(), bare.step()) for _ in range(args.repeats * args.steps)]
        # Whole runs (`memlm train` in this process, metrics rows included), alternating with bare blocks.
        run_times: list[float] = []
        block_times: list[float] = []
        for block in range(args.repeats):
            run_times += trainer_step_times(args, data, arch, work, block)
            block_times += [bare.step() for _ in range(args.steps)]
        trainer_s, bare_s = [t for t, _ in pairs], [b for _, b in pairs]
        t_med, b_med = statistics.median(trainer_s), statistics.median(bare_s)
        result[arch] = {
            "paired_overhead_median_ratio": paired_ratio(trainer_s, bare_s) - 1.0,
            "paired_trainer_step_s_median": t_med, "paired_bare_step_s_median": b_med,
            "paired_overhead_of_medians": t_med / b_med - 1.0,
            "trainer_tokens_per_s": args.batch * 64 / t_med, "bare_tokens_per_s": args.batch * 64 / b_med,
            "whole_run_step_s_median": statistics.median(run_times),
            "blocks_bare_step_s_median": statistics.median(block_times),
            "whole_run_overhead": statistics.median(run_times) / statistics.median(block_times) - 1.0,
        }
        r = result[arch]
        print(f"{arch}: paired trainer {t_med * 1e3:.1f} ms/step vs bare {b_med * 1e3:.1f} ms/step: overhead "
              f"{100 * r['paired_overhead_median_ratio']:+.1f}% (median of per-step ratios); whole runs vs bare "
              f"blocks {100 * r['whole_run_overhead']:+.1f}%", flush=True)
    return result


def launched_tokens_per_s(args, data: Path, work: Path, nproc: int, arch: str) -> float:
    """Median global tokens/s of a `memlm train` subprocess run (torchrun for nproc > 1) after warm-up."""
    out = work / f"scale-{arch}-{nproc}"
    extra = {"deepspeed.zero_stage": 2, "data.batch_size": args.batch // nproc}
    pairs = [f"{k}={v}" for k, v in run_overrides(args, data, arch, args.warmup + args.steps, **extra).items()]
    config = work / "empty.yaml"
    config.write_text("{}\n")
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    env = child_env(OMP_NUM_THREADS=str(max(1, args.threads // nproc)), DEEPSPEED_TIMEOUT="2")
    proc = subprocess.run([*launcher, "-m", "memlm", "train", str(config), *pairs, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{nproc}-rank run failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out)
    return statistics.median(r["tokens_per_s"] for r in rows[args.warmup // args.log_every:])


def scaling(args, data: Path, work: Path) -> dict:
    result = {}
    for arch in args.archs:
        one = [launched_tokens_per_s(args, data, work, 1, arch) for _ in range(args.repeats)]
        two = [launched_tokens_per_s(args, data, work, 2, arch) for _ in range(args.repeats)]
        result[arch] = {"one_rank_zero2_tokens_per_s": statistics.median(one),
                        "two_ranks_zero2_tokens_per_s": statistics.median(two),
                        "two_over_one": statistics.median(two) / statistics.median(one)}
        print(f"{arch}: 1 rank {result[arch]['one_rank_zero2_tokens_per_s']:.0f} tokens/s, 2 ranks ZeRO-2 "
              f"{result[arch]['two_ranks_zero2_tokens_per_s']:.0f} tokens/s ({result[arch]['two_over_one']:.2f}x)",
              flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=["txl", "lamemo"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps (a multiple of --log-every)")
    parser.add_argument("--log-every", type=int, default=5, help="trainer metrics rows (each times its window)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating blocks (overhead) / runs (scaling)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "trainer_cpu.json"))
    args = parser.parse_args()

    import torch

    work = Path(tempfile.mkdtemp(prefix="bench_trainer-"))
    try:
        data = prepare_corpus(work)
        started = time.time()
        report = {
            "benchmark": "trainer", "torch": torch.__version__, "threads": args.threads, "nproc": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(), "loadavg_before": load_average(),
            "config": {"n_layer": 4, "d_model": 256, "n_head": 4, "d_head": 64, "d_inner": 1024, "vocab": 8192,
                       "batch": args.batch, "tgt_len": 64, "mem_len": 64, "steps": args.steps,
                       "warmup": args.warmup, "repeats": args.repeats, "corpus": "WikiText-2, spm-bpe 8k"},
            "overhead_target": 0.10,
            "overhead": overhead(args, data, work),
        }
        if not args.skip_scaling:
            report["scaling"] = scaling(args, data, work)
        report["loadavg_after"] = load_average()
        report["wall_s"] = time.time() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
