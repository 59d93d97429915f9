"""One printed line per trial event of a sweep, in place of Tune's progress tables (RunConfig verbose=0).

This module imports Ray at the top because Tune pickles its callbacks with the experiment (a resumed sweep
unpickles them), which needs a class importable by name; cluster/sweep.py imports this module only inside the
function that runs Tune, so `memlm --help` and training still never load Ray.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ray.tune import Callback


class Progress(Callback):
    def __init__(self, metric: str, steps: int, scheduled: bool = False):
        self.metric, self.steps = metric, steps  # steps: train.steps, unless a trial's own config searches it
        self.scheduled = scheduled  # an early-stopping scheduler (ASHA) may end trials before their last step

    def on_trial_start(self, iteration, trials, trial, **info):
        values = " ".join(f"{k}={v}" for k, v in trial.config.items())
        print(f"trial {trial.trial_id} started: {values}", flush=True)

    def on_trial_recover(self, iteration, trials, trial, **info):
        print(f"trial {trial.trial_id} failed{_reason(trial)}; retrying from its last checkpoint "
              f"(failure {trial.run_metadata.num_failures})", flush=True)

    def on_trial_error(self, iteration, trials, trial, **info):
        # error_file is the driver's staging copy under /tmp/ray; Tune copies it into the sweep folder
        where = f"{trial.storage.trial_fs_path}/{os.path.basename(trial.error_file)}" if trial.error_file else "its log"
        print(f"trial {trial.trial_id} failed for good after {trial.run_metadata.num_failures} failure(s)"
              f"{_reason(trial)}; traceback in {where}", flush=True)

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = trial.last_result or {}
        value = last.get(self.metric)
        shown = f"{self.metric}={value:.4g}" if isinstance(value, (int, float)) else f"no {self.metric}"
        step = last.get("step")
        planned = trial.config.get("train.steps", self.steps)
        # A Progress pickled by a sweep from before `scheduled` existed: only ASHA sweeps ever stopped trials.
        scheduled = getattr(self, "scheduled", False)
        if isinstance(step, int) and step < planned:
            reason = "stopped early by the scheduler" if scheduled else "ended before its last step"
            print(f"trial {trial.trial_id} {reason}: {shown} at step {step} of {planned}", flush=True)
        else:
            print(f"trial {trial.trial_id} finished: {shown} at step {step if step is not None else '?'}", flush=True)


# The last line of a Python traceback: "package.module.SomeError: message".
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)): (.+)$")


def _reason(trial) -> str:
    """" (DataError: ...)" from the error Tune just saved for the trial (the text traceback in the driver's copy of
    the trial folder, error_file), or "" when there is none to read. The text, not Tune's pickled copy of the
    exception: memlm unpickles nothing a folder holds (a sweep folder someone sent you must not run code)."""
    try:
        lines = Path(trial.error_file).read_text(errors="replace").splitlines()
    except (OSError, TypeError):  # no error file (yet): the line goes without a reason
        return ""
    # Tune appends "Failure # N (occurred at ...)" then the error's text: a traceback ending in "SomeError: message"
    # for an exception in the trial, or a bare message for a worker that died.
    starts = [i for i, line in enumerate(lines) if line.startswith("Failure # ")]
    last = lines[starts[-1] + 1:] if starts else lines
    for line in reversed(last):
        found = _EXCEPTION_LINE.match(line.strip())
        if found:
            return f" ({found.group(1).rsplit('.', 1)[-1]}: {found.group(2)[:300]})"
    first = next((line.strip() for line in last if line.strip()), "")
    return f" ({first[:300]})" if first else ""
