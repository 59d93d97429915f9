"""When a curriculum stage ends: a plateau criterion on held-out answers, with a cap.

Every `check_every` steps (the trainer's validation pass, train.eval_every) the stage's model answers `samples`
samples of the stage's valid split, greedily, exactly as `memlm longeval` scores (an answer counts when every answer
byte is the most likely next byte); the same pass gives the answer loss (the valid NLL: a task corpus scores the
answer bytes only). The stage ends

    learned   when the held-out exact-match accuracy reaches `target`;
    plateau   from `min_steps` on and before the cap, after `patience` checks in a row with no gain: neither the
              accuracy `min_gain` above nor the answer loss a fraction `min_gain` below their values at the last gain;
    budget    at `steps`, the cap (the trainer's train.steps), unless its check says learned.

Why both signals: before a task is learned the accuracy sits near 0 for a long while and then jumps (one-segment
passkey at a constant rate: 0% until steps 2,000-4,500, then 99% within 1,000-2,500 more,
bench/reproduce/longctx.py), while the answer loss keeps falling until the jump; a stage that stopped on accuracy
alone would stop before it. `min_steps` guards the same late jump. A task no model can learn at this length (the
no-memory model once the fact is segments back) ends on the plateau instead of spending the cap.

`fixed` (memlm curriculum --fixed-steps) keeps the checks for the record and stops on the cap only.

Each check is a line on the console and a row of RUN_DIR/curriculum_checks.jsonl; a resumed stage reads the rows
before its step back, so its patience continues where it was.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memlm.models.config import ConfigError
from memlm.trainer.inference.longeval import answer_correct

CHECKS = "curriculum_checks.jsonl"


@dataclass(frozen=True)
class StopRule:
    steps: int = 3000  # the cap on a stage's optimizer steps
    check_every: int = 250  # steps between held-out checks
    samples: int = 200  # held-out samples per check (the stage's valid split, at most)
    target: float = 0.99  # held-out exact-match accuracy that ends a stage as learned
    patience: int = 4  # checks in a row without a gain that end a stage as plateaued
    min_steps: int = 1000  # no plateau before this step
    min_gain: float = 0.02  # a gain: accuracy up by this much, or answer loss down by this fraction
    fixed: bool = False  # stop on the cap only

    def validate(self) -> "StopRule":
        """One line naming the flag for a rule that cannot work."""
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if not 1 <= self.check_every <= self.steps or self.steps % self.check_every:
            raise ConfigError(f"--check-every {self.check_every} must divide --steps {self.steps} (the last check "
                              f"comes at the cap), e.g. --check-every {_divisor(self.steps, self.check_every)}")
        if self.samples < 1:
            raise ConfigError(f"--check-samples must be >= 1, got {self.samples}")
        if not 0.0 <= self.target <= 1.0:
            raise ConfigError(f"--target is a held-out accuracy in [0, 1], got {self.target}")
        if self.patience < 1:
            raise ConfigError(f"--patience must be >= 1 check, got {self.patience} (--fixed-steps stops on the "
                              "cap only)")
        if self.min_steps < 0 or not 0.0 <= self.min_gain < 1.0:
            raise ConfigError(f"--min-steps must be >= 0 and --min-gain in [0, 1), got {self.min_steps} and "
                              f"{self.min_gain}")
        return self


def _divisor(steps: int, near: int) -> int:
    """The divisor of `steps` nearest to `near` (a suggestion for --check-every)."""
    return min((d for d in range(1, steps + 1) if steps % d == 0), key=lambda d: (abs(d - near), d))


def decide(rule: StopRule, checks: list[dict]) -> tuple[str, str] | None:
    """(kind, reason) when the checks so far end the stage, else None. checks: rows with step, accuracy and
    answer_nll (None when not measured), oldest first."""
    if not checks or rule.fixed:
        return None
    last = checks[-1]
    if last["accuracy"] >= rule.target:
        return "learned", (f"held-out accuracy {100 * last['accuracy']:.1f}% reached --target "
                           f"{100 * rule.target:g}%")
    # A gain is measured from the values of the last gain, so a slow, steady fall of the loss (the run-up to a
    # late jump) counts every few checks instead of never.
    ref_acc, ref_nll, since = -math.inf, math.inf, 0
    best_acc, best_step, best_nll = -1.0, 0, math.inf
    for row in checks:
        nll = row.get("answer_nll")
        if row["accuracy"] >= ref_acc + rule.min_gain or (nll is not None and nll <= ref_nll * (1 - rule.min_gain)):
            ref_acc, ref_nll, since = row["accuracy"], nll if nll is not None else ref_nll, 0
        else:
            since += 1
        if row["accuracy"] > best_acc:
            best_acc, best_step = row["accuracy"], row["step"]
        if nll is not None:
            best_nll = min(best_nll, nll)
    if rule.min_steps <= last["step"] < rule.steps and since >= rule.patience:  # at the cap, the cap ended it
        return "plateau", (f"no gain in {since} checks ({since * rule.check_every:,} steps): best held-out "
                           f"accuracy {100 * best_acc:.1f}% at step {best_step:,}, answer loss {best_nll:.3f}")
    return None


class StageCheck:
    """The trainer's stop_when for one stage (trainer/loop/train.py): measures, records, decides."""

    def __init__(self, rule: StopRule, run_dir: Path, held_out: list, *, boundary_id: int, label: str):
        self.rule, self.run_dir, self.held_out = rule, Path(run_dir), held_out[:rule.samples]
        self.boundary_id, self.label = boundary_id, label
        self.stopped: tuple[str, str] | None = None

    def history(self, before: int) -> list[dict]:
        """The rows recorded before step `before` (a resumed stage's checks up to its checkpoint)."""
        path = self.run_dir / CHECKS
        if not path.is_file():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [row for row in rows if row["step"] < before]

    def __call__(self, trainer: Any, valid: dict) -> str | None:
        step = int(valid["step"])
        model = trainer.engine.module
        right = answer_correct(model, self.held_out, lanes=trainer.cfg.data.eval_lanes, boundary_id=self.boundary_id,
                               device=trainer.device)
        row = {"step": step, "accuracy": sum(right) / len(right), "samples": len(right),
               "answer_nll": valid.get("valid_nll")}
        checks = [*self.history(step), row]
        decision = decide(self.rule, checks)
        row["stop"] = decision[0] if decision else None
        checks[-1] = row
        if trainer.rank == 0:
            (self.run_dir / CHECKS).write_text("".join(json.dumps(r) + "\n" for r in checks))
            nll = f", answer loss {row['answer_nll']:.3f}" if row["answer_nll"] is not None else ""
            print(f"curriculum: {self.label} step {step:,}: held-out accuracy {100 * row['accuracy']:.1f}% "
                  f"({sum(right)}/{len(right)}){nll}", flush=True)
        self.stopped = decision
        return decision[1] if decision else None


def stage_record(rule: StopRule, run_dir: Path, step: int) -> dict:
    """How the stage ended, from its checks: kind (learned, plateau, budget), reason, step, last and best check."""
    path = Path(run_dir) / CHECKS
    checks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    checks = [row for row in checks if row["step"] <= step]
    last = checks[-1] if checks else None
    decision = decide(rule, checks) if last is not None and last.get("stop") else None
    kind, reason = decision or ("budget", f"the cap, --steps {rule.steps:,}")
    best = max(checks, key=lambda row: row["accuracy"]) if checks else None
    return {"stop": kind, "reason": reason, "step": step, "accuracy": last["accuracy"] if last else None,
            "answer_nll": last["answer_nll"] if last else None, "best": best, "checks": len(checks),
            "rule": asdict(rule)}
