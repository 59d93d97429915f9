"""Training's progress display: one line per logged step with an ETA (a tqdm bar on a terminal); other ranks stay
quiet. The generic meter (eval, extrapolate, prepare, generate) is data_pipeline.progress.Meter.

    Progress(rank, start_step, total_steps)
"""

from __future__ import annotations

import sys
import time

from memlm.data_pipeline.progress import format_duration, is_terminal, progress_wanted
from memlm.trainer.runtime import heartbeat


class Progress:
    def __init__(self, rank: int, start: int, total: int):
        self.rank, self.total = (rank if progress_wanted() else -1), total  # -1: quiet, as other ranks are
        self.start_step, self.start_time = start, time.monotonic()
        self.bar = None
        if self.rank == 0 and is_terminal(sys.stderr):
            from tqdm import tqdm

            heartbeat.stop()  # the bar is the progress from here on
            self.bar = tqdm(total=total, initial=start, file=sys.stderr, unit="step", dynamic_ncols=True)

    def update(self, row: dict) -> None:
        if self.rank != 0:
            return
        heartbeat.stop()  # the first line of progress ends the start's watch
        if self.bar is not None:
            self.bar.n = row["step"]
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=True)
        else:
            print(f"step {row['step']}/{self.total} loss {row['loss']:.4f} lr {row['lr']:.3g} "
                  f"grad_norm {row['grad_norm']:.3g} tokens/s {row['tokens_per_s']:.0f} "
                  f"eta {self.eta(row['step'])}", file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        """One line from rank 0 (a checkpoint saved), above the bar on a terminal."""
        if self.rank != 0:
            return
        heartbeat.stop()
        line = f"memlm train: {message}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def eta(self, step: int) -> str:
        """Remaining time at the mean step time since this process started, as H:MM:SS."""
        done = step - self.start_step
        if done <= 0:
            return "?"
        return format_duration((time.monotonic() - self.start_time) / done * max(self.total - step, 0))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
