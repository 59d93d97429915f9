"""The work of one extrapolation Ray task: evaluate one run folder at one memory length, in the worker process.

Kept in its own module, importing nothing heavy at the top, so Ray pickles `evaluate_task` by reference
(cluster.extrapolate_task.evaluate_task) and a worker imports torch/trainer only when it runs a task.
The function itself knows nothing of Ray: it is equally callable in-process (the benchmark's sequential path).
"""

from __future__ import annotations

import math
import os
import socket
import time
from typing import Any

from memlm.trainer.inference.evaluate import evaluate_run
from memlm.trainer.runtime import faults
from memlm.trainer.runtime.process import prepare_process

from .ray_runtime import clear_launch_env, placement


def evaluate_task(run_dir: str, split: str, tgt_len: int, mem_len: int, lanes: int | None, json_path: str | None,
                  threads: float) -> dict[str, Any]:
    """evaluate_run(run_dir, split, tgt_len, mem_len) as a single process with `threads` torch threads.

    Returns {"result": the §8 eval object, "seconds": evaluation wall time, "host": ..., "pid": ..., and in a Ray
    task "node_id" and "attempt" (ray_runtime.placement: 1 or more for a retry)}.
    """
    # An extrapolation task is one process by design: a stale WORLD_SIZE > 1 inherited from a driver would make
    # evaluate_run wait for ranks that never come.
    clear_launch_env()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # A reused worker that once joined a multi-process group would turn this into a collective nobody else
        # calls (a hang until the timeout); refuse loudly instead.
        raise RuntimeError("this Ray worker holds a process group of world size "
                           f"{dist.get_world_size()}; an extrapolation task must run alone")
    # Ray reserves CPUs per task but does not pin threads; torch would otherwise start one thread per core of the
    # node, and two tasks on a 2-core node would fight over 4 threads.

    prepare_process(cpus=max(1, math.ceil(threads)), who="extrapolate task")

    faults.at("extrapolate", mem_len=mem_len)  # the tests' MEMLM_TEST_HOLD: lose a node while this task runs there
    start = time.perf_counter()
    # track=False: the driver logs every result to MLflow in one batch per run; parallel tasks writing to the
    # training runs' (often SQLite) store would only contend for its lock.
    result = evaluate_run(run_dir, split=split, tgt_len=tgt_len, mem_len=mem_len, lanes=lanes, json_path=json_path,
                          track=False, progress=False)  # the driver shows the tasks' progress
    return {"result": result, "seconds": time.perf_counter() - start, "host": socket.gethostname(),
            "pid": os.getpid(), **placement()}
