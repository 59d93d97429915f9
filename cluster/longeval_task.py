"""The work of one `memlm longeval` Ray task: one run folder at one length, in the worker: a generated task's every
depth window (trainer/inference/longeval.py) or one length of BABILong's files (longeval_babilong.py), as the driver's
spec (cluster/longeval_plan.py: Source.spec) says.

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

from memlm.trainer.inference.evaluate import write_json
from memlm.trainer.inference.longeval import evaluate_length
from memlm.trainer.inference.longeval_babilong import evaluate_babilong
from memlm.trainer.runtime.process import prepare_process

from .ray_runtime import clear_launch_env


def longeval_task(run_dir: str, spec: dict, json_path: str, threads: float) -> dict[str, Any]:
    """The spec's evaluation as one process with `threads` torch threads; writes json_path. Returns {"result",
    "seconds", "host", "pid"}."""
    clear_launch_env()  # one process by design: a stale WORLD_SIZE from the driver must not make it wait for ranks

    prepare_process(cpus=max(1, math.ceil(threads)), who="longeval task")

    start = time.perf_counter()
    if spec["source"] == "babilong":
        result = evaluate_babilong(run_dir, spec["folder"], spec["task"], spec["length"], spec["samples"])
    else:
        result = evaluate_length(run_dir, spec["task"], spec["options"], spec["length"], spec["depths"],
                                 spec["samples"], seed=spec["seed"], split=spec["split"], lanes=spec["lanes"])
    write_json(result, Path(json_path))
    return {"result": result, "seconds": time.perf_counter() - start, "host": socket.gethostname(),
            "pid": os.getpid()}
