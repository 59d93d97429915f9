"""Process-group setup for the three ways `memlm train` starts: plain python, torchrun, the deepspeed launcher.

torchrun and the deepspeed launcher set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (the
deepspeed launcher also passes --local_rank, which we do not need: LOCAL_RANK is in the environment). A plain
process has none of them, and DeepSpeed then falls back to MPI discovery and fails on mpi4py (DESIGN §9), so we
set the single-process values with a free loopback port. Without CUDA, DeepSpeed must use its CPU accelerator
(DS_ACCELERATOR=cpu) and gloo; both are decided here, before deepspeed is imported anywhere.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

# Minutes a collective waits before DeepSpeed gives up; its default of 10 hides deadlocks too long in tests.
DEFAULT_TIMEOUT_MIN = "10"


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str  # "gloo" on CPU, "nccl" on GPUs
    device: str  # "cpu" or "cuda:<local_rank>"


def free_port() -> int:
    """A TCP port free on the loopback interface right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_env() -> DistInfo:
    """Fill in the launcher variables for a plain process and choose accelerator and backend. Idempotent."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("DEEPSPEED_TIMEOUT", DEFAULT_TIMEOUT_MIN)
    import torch  # after the environment: nothing above needs torch

    if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu":
        backend, device = "nccl", f"cuda:{int(os.environ['LOCAL_RANK'])}"
    else:
        os.environ["DS_ACCELERATOR"] = "cpu"
        backend, device = "gloo", "cpu"
    return DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]),
                    backend, device)


def init(info: DistInfo, log_dir: str | os.PathLike | None = None) -> None:
    """Create the default process group through DeepSpeed (it reads DEEPSPEED_TIMEOUT).

    log_dir: a run folder; DeepSpeed's output while it sets up (every rank prints "... built successfully" for
    its CPU op, also when the op comes from the cache; a first build's compiler output) goes to its library.log
    instead of the console, and rank 0 says once when a first build is coming."""
    import atexit

    import deepspeed

    if info.device == "cpu":
        atexit.register(remove_shm_buffer, info.rank)  # also after a failed run; not after SIGKILL
    if info.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(info.local_rank)
    if log_dir is None:
        deepspeed.init_distributed(dist_backend=info.backend, auto_mpi_discovery=False)
        return
    from .quiet import into_library_log

    if info.device == "cpu" and info.rank == 0 and not cpu_op_built():
        print(f"memlm: building DeepSpeed's CPU communication op once for this environment (30-60 s; cached in "
              f"{os.environ.get('TORCH_EXTENSIONS_DIR', '~/.cache/torch_extensions')})", file=sys.stderr, flush=True)
    with into_library_log(log_dir):
        deepspeed.init_distributed(dist_backend=info.backend, auto_mpi_discovery=False)


def shm_buffer_path(rank: int, env=os.environ) -> Path:
    """The shared-memory file DeepSpeed's CPU all-reduce op creates for this rank when every rank is local (the
    deepspeed launcher sets LOCAL_SIZE): /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>
    (deepspeed/ops/csrc/cpu/comm/shm.cpp)."""
    return Path("/dev/shm") / (f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
                               f"{env.get('MASTER_PORT', '')}_{rank}")


def remove_shm_buffer(rank: int) -> None:
    """DeepSpeed never unlinks its 66 MB all-reduce buffer: every 2-rank run under the deepspeed launcher left two
    in /dev/shm, which is RAM (4.4 GB after a day of tests on a 24 GB machine). Each rank removes its own at exit;
    the other ranks mapped it at start-up and keep their mapping, only the name goes."""
    try:
        shm_buffer_path(rank).unlink()
    except (FileNotFoundError, PermissionError):
        pass


def cpu_op_built() -> bool:
    """Whether DeepSpeed's CPU shared-memory op is already in the op cache (TORCH_EXTENSIONS_DIR)."""
    cache = os.environ.get("TORCH_EXTENSIONS_DIR")
    return bool(cache) and any(Path(cache).glob("deepspeed_shm_comm*/*.so"))


def shutdown() -> None:
    """End a multi-process run's default process group before the interpreter exits. Left to finalisation, gloo's
    worker threads can still hold tensors while Python tears down, and a rank dies with SIGABRT ("terminate called
    without an active exception") after a finished run (seen once in CI at the end of a 2-rank ZeRO-3 run). Only
    for world size > 1: a single process keeps its group for further in-process runs (tests, sweeps)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.destroy_process_group()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
