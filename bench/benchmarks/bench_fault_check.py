"""Reliability figures: what the non-finite step check costs, and (with --tests) the kill matrix, numerical-fault,
weights-only and fuzz suites' outcomes with the fuzz example counts.

    .venv/bin/python bench/benchmarks/bench_fault_check.py                 # -> bench/results/fault_check_cpu.json
    .venv/bin/python bench/benchmarks/bench_fault_check.py --tests         # also runs the four test files (minutes)

1. Overhead. A Trainer (real DeepSpeed engine, one process, one thread) steps with the check as shipped, and with
   `_agree` replaced by the same all-reduce of the step's figures without the check (no gradient norm, no flags),
   alternating step by step after warm-up; overhead = median of the per-pair time ratios - 1. At ZeRO-0 the check
   is one pass over the gradients per step (their norm) plus an isfinite per micro-batch; at ZeRO 1-3 only the
   isfinite (DeepSpeed computes the norm in its step anyway). Also timed alone: the check on the model's gradients.
   Two models: the tests' tiny one and bench_models.py's shape (4 layers, d_model 256, N = M = 64, B 8).
2. --tests: pytest over test_kill_matrix, test_numerical_faults, test_safe_load and test_fuzz in this process;
   records each test's outcome and duration, kill points survived and resumed bit-exact, fuzz examples per surface.
Never part of the test suite; nothing here asserts a timing. Records the load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its OpenMP runtime
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: bench.*, memlm, tests.support

from bench.common import RESULTS, ROOT, load_average, write_result  # noqa: E402
from bench.interrupt import stop_in_one_line  # noqa: E402

SHAPES = {
    "tiny": {},  # the tiny preset: 2 layers, d_model 32, N = M = 8, B 2
    "bench_models": {"model.n_layer": 4, "model.n_head": 4, "model.d_head": 64, "model.d_model": 256,
                     "model.d_inner": 1024, "model.tgt_len": 64, "model.mem_len": 64, "data.batch_size": 8},
}


def build_trainer(data: Path, out: Path, zero: int, shape: dict):
    from memlm.data_pipeline.shards import load_manifest
    from memlm.trainer.runtime import distributed
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.train import Trainer
    from tests.support.training import overrides, preset

    extra = {k.replace(".", "__"): v for k, v in shape.items()}
    cfg = load_config(preset("txl"), overrides(data, deepspeed__zero_stage=zero, train__steps=10**6,
                                               train__warmup_steps=0, train__grad_accum=2, **extra))
    trainer = Trainer(cfg, out, distributed.setup_env(), {}, load_manifest(data))
    trainer.build()
    return trainer


def unchecked_agree(trainer):
    """_agree as the step was before the check: the figures' all-reduce only (one process: none at all)."""
    import torch

    def agree(nll, count, inputs, bad_loss):  # noqa: ARG001 - same signature
        summed = torch.stack([nll.double(), torch.tensor(float(count), dtype=torch.float64),
                              torch.tensor(float(inputs), dtype=torch.float64),
                              torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)])
        return summed.tolist(), None
    return agree


def time_step(trainer) -> float:
    start = time.perf_counter()
    trainer.train_step()
    return time.perf_counter() - start


def overhead(data: Path, work: Path, zero: int, name: str, steps: int, warmup: int) -> dict:
    import torch

    trainer = build_trainer(data, work / f"{name}-z{zero}", zero, SHAPES[name])
    checked, unchecked = trainer._agree, unchecked_agree(trainer)
    for _ in range(warmup):
        time_step(trainer)
    ratios, on, off = [], [], []
    for i in range(steps):
        order = (True, False) if i % 2 == 0 else (False, True)  # alternate which goes first
        pair = {}
        for with_check in order:
            trainer._agree = checked if with_check else unchecked
            pair[with_check] = time_step(trainer)
        on.append(pair[True])
        off.append(pair[False])
        ratios.append(pair[True] / pair[False])
    trainer._agree = checked
    # The check alone on this model's gradients (those of the last step's backward, recomputed once).
    grads = [torch.randn_like(p) for p in trainer.engine.module.parameters()]
    alone = []
    for _ in range(50):
        start = time.perf_counter()
        bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))
        alone.append(time.perf_counter() - start)
    params = sum(p.numel() for p in trainer.engine.module.parameters())
    return {"shape": name, "zero_stage": zero, "parameters": params, "steps_each": steps,
            "step_s_with_check_median": statistics.median(on), "step_s_without_check_median": statistics.median(off),
            "overhead_median": statistics.median(ratios) - 1.0,
            "overhead_quartiles": [q - 1.0 for q in statistics.quantiles(ratios, n=4)],
            "grad_norm_check_alone_s_median": statistics.median(alone)}


class Outcomes:
    """A pytest plugin recording each test's outcome and duration."""

    def __init__(self):
        self.rows = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.rows.append({"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 2)})


def run_tests() -> dict:
    import pytest

    plugin = Outcomes()
    files = [str(ROOT / "tests" / f) for f in ("test_kill_matrix.py", "test_numerical_faults.py", "test_safe_load.py",
                                               "test_fuzz.py")]
    start = time.perf_counter()
    code = pytest.main(["-q", "-p", "no:cacheprovider", *files], plugins=[plugin])
    fuzz = sys.modules.get("test_fuzz")
    kills = [r for r in plugin.rows if "test_killed_and_resumed" in r["test"]]
    return {"exit_code": int(code), "seconds": round(time.perf_counter() - start, 1), "tests": plugin.rows,
            "kill_points": len(kills), "kill_points_resumed_bit_exact": sum(r["outcome"] == "passed" for r in kills),
            "fuzz_examples": dict(fuzz.FUZZ_COUNTS) if fuzz else {}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (alternating)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tests", action="store_true", help="also run the reliability test files (minutes)")
    parser.add_argument("--out", default=str(RESULTS / "fault_check_cpu.json"))
    args = parser.parse_args()

    import torch

    from tests.support.training import make_data

    torch.set_num_threads(1)
    load_before = load_average()
    results = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": 1,
               "load_average_before": load_before, "overhead": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(Path(tmp))
        for name in SHAPES:
            for zero in (0, 2):
                row = overhead(data, Path(tmp), zero, name, args.steps, args.warmup)
                print(json.dumps(row), flush=True)
                results["overhead"].append(row)
    results["load_average_after_overhead"] = load_average()
    if args.tests:
        results["tests"] = run_tests()
        results["load_average_after_tests"] = load_average()
    write_result(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
