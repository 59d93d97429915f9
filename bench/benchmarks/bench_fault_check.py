"""Reliability figures: what the non-finite step check costs, and (with --tests) the kill matrix, numerical-fault,
weights-only and fuzz suites' outcomes with the fuzz example counts.

    .venv/bin/python bench/benchmarks/bench_fault_check.py            # -> bench/results/fault_check_cpu.json
    .venv/bin/python bench/benchmarks/bench_fault_check.py --tests    # also runs the four test files (minutes)

1. Overhead. The check (trainer/loop/train.py, train_step): an isfinite of the loss after every backward and, at
   ZeRO-0, one pass over the gradients for their global norm and its isfinite before the optimizer step (ZeRO 1-3
   compute the norm inside DeepSpeed's step anyway). At ZeRO-0 that norm is also the gradient norm the metrics
   rows report. The trainer has no switch to leave the check out, so the bench does it a second time instead: a
   Trainer (open_trainer, build, train_step; real DeepSpeed engine, one process, one thread) steps as shipped, and
   with the same check repeated by wrappers around the engine's backward and step (CheckAgain), alternating step by
   step after warm-up. With r the median of the per-pair ratios (twice / as shipped), the check's share is r - 1
   of a shipped step and the overhead against a step without it is (r - 1) / (2 - r); the step without the check
   is estimated as 2 x shipped - twice (medians). This assumes the repeated pass costs what the first does. Also
   timed alone: the norm and isfinite on random gradients of the model's shapes. Two models: the tests' tiny one
   and bench_models.py's shape (4 layers, d_model 256, N = M = 64, B 8).
2. --tests: pytest over tests/trainer/checkpoint/test_kill_matrix.py, tests/trainer/loop/test_numerical_faults.py,
   tests/trainer/checkpoint/test_safe_load.py and tests/data_pipeline/test_fuzz.py in this process; records each
   test's outcome and duration, kill points survived and resumed bit-exact, fuzz examples per surface.
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
# The checkout on sys.path here: this script imports the test suite's helpers, tests.support, which no install
# provides (bench/common.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from memlm.bench.common import RESULTS, ROOT, load_average, paired_ratio, write_result
from memlm.bench.interrupt import stop_in_one_line

# What --tests runs, under tests/: test_fuzz counts its examples per surface in FUZZ_COUNTS.
RELIABILITY_TESTS = ("trainer/checkpoint/test_kill_matrix.py", "trainer/loop/test_numerical_faults.py",
                     "trainer/checkpoint/test_safe_load.py", "data_pipeline/test_fuzz.py")
SHAPES = {
    "tiny": {},  # the tiny preset: 2 layers, d_model 32, N = M = 8, B 2
    "bench_models": {"model.n_layer": 4, "model.n_head": 4, "model.d_head": 64, "model.d_model": 256,
                     "model.d_inner": 1024, "model.tgt_len": 64, "model.mem_len": 64, "data.batch_size": 8},
}


def build_trainer(data: Path, out: Path, zero: int, shape: dict):
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.train import open_trainer
    from tests.support.training import overrides, preset

    extra = {k.replace(".", "__"): v for k, v in shape.items()}
    cfg = load_config(preset("txl"), overrides(data, deepspeed__zero_stage=zero, train__steps=10**6,
                                               train__warmup_steps=0, train__grad_accum=2, **extra))
    trainer = open_trainer(cfg, out)
    trainer.build()
    return trainer


class CheckAgain:
    """The trainer's non-finite check done once more inside its own step, while `on`: wrappers around the engine's
    backward (the loss's isfinite, kept on the device as the trainer keeps its flag) and step (on the accumulation
    boundary, before the optimizer runs: at ZeRO-0 the gradients' global norm and its isfinite, then one host read
    of the flags, as the trainer's StepFigures makes). Each wrapper is an instance attribute that shadows the
    engine's method; the trainer itself is not touched."""

    def __init__(self, trainer):
        self.engine, self.on = trainer.engine, False
        self.norm_too = trainer.cfg.deepspeed.zero_stage == 0
        self.backward, self.step = self.engine.backward, self.engine.step
        self.engine.backward, self.engine.step = self.checked_backward, self.checked_step
        self.bad_loss = self.no_flag()

    def no_flag(self):
        import torch

        return torch.zeros((), dtype=torch.bool, device=self.engine.device)

    def checked_backward(self, loss, *args, **kwargs):
        import torch

        result = self.backward(loss, *args, **kwargs)
        if self.on:
            self.bad_loss = self.bad_loss | ~torch.isfinite(loss.detach())
        return result

    def checked_step(self, *args, **kwargs):
        import torch

        if self.on and self.engine.is_gradient_accumulation_boundary():
            flags = [self.bad_loss]
            if self.norm_too:
                grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads)
                flags.append(~torch.isfinite(norm))
                float(norm)  # the trainer reads it too: it is the gradient norm of the step's metrics row
            torch.stack(flags).tolist()
            self.bad_loss = self.no_flag()
        return self.step(*args, **kwargs)


def time_step(trainer) -> float:
    start = time.perf_counter()
    trainer.train_step()
    return time.perf_counter() - start


def overhead_of(ratio: float) -> float:
    """The check's cost over a step without it, from ratio = (step, check twice) / (step, check once): with S the
    step without the check and C the check, once = S + C and twice = S + 2C, so C / S = (ratio - 1) / (2 - ratio)."""
    return (ratio - 1.0) / (2.0 - ratio)


def overhead(data: Path, work: Path, zero: int, name: str, steps: int, warmup: int) -> dict:
    import torch

    trainer = build_trainer(data, work / f"{name}-z{zero}", zero, SHAPES[name])
    again = CheckAgain(trainer)
    for _ in range(warmup):
        time_step(trainer)
    once, twice = [], []
    for i in range(steps):
        for check_twice in ((False, True) if i % 2 == 0 else (True, False)):  # alternate which goes first
            again.on = check_twice
            (twice if check_twice else once).append(time_step(trainer))
    again.on = False
    ratios = [b / a for a, b in zip(once, twice)]
    # The check alone, on random gradients of this model's shapes.
    grads = [torch.randn_like(p) for p in trainer.engine.module.parameters()]
    alone = []
    for _ in range(50):
        start = time.perf_counter()
        bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))
        alone.append(time.perf_counter() - start)
    params = sum(p.numel() for p in trainer.engine.module.parameters())
    with_check, with_check_twice = statistics.median(once), statistics.median(twice)
    return {"shape": name, "zero_stage": zero, "parameters": params, "steps_each": steps,
            "method": "the check done twice against once per step, alternating; without = 2 x once - twice",
            "step_s_with_check_median": with_check, "step_s_with_check_twice_median": with_check_twice,
            "step_s_without_check_median": 2 * with_check - with_check_twice,
            "overhead_median": overhead_of(paired_ratio(twice, once)),
            "overhead_quartiles": [overhead_of(q) for q in statistics.quantiles(ratios, n=4)],
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
    files = [str(ROOT / "tests" / path) for path in RELIABILITY_TESTS]
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
