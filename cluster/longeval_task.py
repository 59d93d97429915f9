"""The work of one `memlm longeval` Ray task: one run folder at one sample length, every depth window, in the worker.

Importing nothing heavy at the top, so Ray pickles `longeval_task` by reference and a worker imports torch only
when it runs one; equally callable in-process.
"""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from .ray_runtime import clear_launch_env


def longeval_task(run_dir: str, task: str, options: dict, length: int, depths: int, samples: int, seed: int,
                  split: str, lanes: int | None, json_path: str, threads: float) -> dict[str, Any]:
    """evaluate_length(...) as one process with `threads` torch threads; writes json_path. Returns {"result",
    "seconds", "host", "pid"}."""
    clear_launch_env()  # one process by design: a stale WORLD_SIZE from the driver must not make it wait for ranks
    from memlm.trainer.runtime.process import prepare_process

    prepare_process(cpus=max(1, math.ceil(threads)), who="longeval task")
    from memlm.trainer.inference.evaluate import write_json
    from memlm.trainer.inference.longeval import evaluate_length

    start = time.perf_counter()
    result = evaluate_length(run_dir, task, options, length, depths, samples, seed=seed, split=split, lanes=lanes)
    write_json(result, Path(json_path))
    return {"result": result, "seconds": time.perf_counter() - start, "host": socket.gethostname(),
            "pid": os.getpid()}
