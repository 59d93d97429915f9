"""One printed line per trial event of a sweep, in place of Tune's progress tables (RunConfig verbose=0).

This module imports Ray at the top because Tune pickles its callbacks with the experiment (a resumed sweep
unpickles them), which needs a class importable by name; cluster/sweep.py imports this module only inside the
function that runs Tune, so `memlm --help` and training still never load Ray.
"""

from __future__ import annotations

from ray.tune import Callback


class Progress(Callback):
    def __init__(self, metric: str, steps: int, scheduled: bool = False):
        self.metric, self.steps = metric, steps  # steps: train.steps, unless a trial's own config searches it
        self.scheduled = scheduled  # an early-stopping scheduler (ASHA) may end trials before their last step

    def on_trial_start(self, iteration, trials, trial, **info):
        values = " ".join(f"{k}={v}" for k, v in trial.config.items())
        print(f"trial {trial.trial_id} started: {values}", flush=True)

    def on_trial_recover(self, iteration, trials, trial, **info):
        print(f"trial {trial.trial_id} failed; retrying from its last checkpoint "
              f"(failure {trial.run_metadata.num_failures})", flush=True)

    def on_trial_error(self, iteration, trials, trial, **info):
        print(f"trial {trial.trial_id} failed for good after {trial.run_metadata.num_failures} failure(s); "
              f"see {trial.error_file or 'its log'}", flush=True)

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
