"""Process-group setup for the three ways `memlm train` starts: plain python, torchrun, the deepspeed launcher.

torchrun and the deepspeed launcher set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (the
deepspeed launcher also passes --local_rank, which we do not need: LOCAL_RANK is in the environment). A plain
process has none of them, and DeepSpeed then falls back to MPI discovery and fails on mpi4py (docs/design.md §9), so we
set the single-process values with a free loopback port. Without CUDA, DeepSpeed must use its CPU accelerator
(DS_ACCELERATOR=cpu) and gloo; both are decided here, before deepspeed is imported anywhere.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from . import heartbeat
from .lean_import import import_deepspeed
from .op_cache import load_cpu_op
from .quiet import into_library_log

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
        loopback_single_process()
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


LOCAL_HOST = "127.0.0.1"
_rendezvous: dict[str, object] = {}  # this process's loopback socket and torch store (kept open for its life)


def loopback_single_process() -> None:
    """The launcher variables of a single process (rank 0 of 1) whose rendezvous listens on 127.0.0.1 only.

    torch's TCPStore binds every interface whatever MASTER_ADDR says (a plain `memlm train` listened on `*`); a
    store created with multi_tenant=True on a socket bound to 127.0.0.1 is the one the process group then uses
    (torch reuses a multi-tenant store's server for the same host and port within a process, so later runs in
    the same process, tests and Ray trials, share it). A single process has no peer elsewhere, so gloo and NCCL
    are kept on loopback too (unless the user chose their interfaces)."""
    if not _rendezvous:
        from torch.distributed import TCPStore

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((LOCAL_HOST, 0))
        sock.listen()
        _rendezvous["socket"] = sock
        _rendezvous["store"] = TCPStore(LOCAL_HOST, sock.getsockname()[1], 1, True, wait_for_workers=False,
                                        multi_tenant=True, master_listen_fd=sock.fileno())
    port = _rendezvous["socket"].getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=LOCAL_HOST, MASTER_PORT=str(port))
    for key, value in loopback_comm_env().items():
        os.environ.setdefault(key, value)


def loopback_comm_env() -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming the loopback interface: without them gloo listens on the
    address the host name resolves to and NCCL on the first non-loopback interface. {} when none is found."""
    import ipaddress

    import psutil  # a DeepSpeed and Ray dependency

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and ipaddress.ip_address(a.address).is_loopback for a in addresses):
            return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}
    return {}


def init(info: DistInfo, log_dir: str | os.PathLike | None = None) -> None:
    """Create the default process group through DeepSpeed (it reads DEEPSPEED_TIMEOUT).

    log_dir: a run folder; DeepSpeed's output while it sets up (every rank prints "... built successfully" for
    its CPU op, also when the op comes from the cache; a build's compiler output) goes to its library.log
    instead of the console, and rank 0 says when a build is coming (op_cache.load_cpu_op)."""
    import atexit

    deepspeed = import_deepspeed()
    if info.device == "cpu":
        atexit.register(remove_shm_buffer, info.rank)  # also after a failed run; not after SIGKILL
    if info.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(info.local_rank)
    if log_dir is None:
        deepspeed.init_distributed(dist_backend=info.backend, auto_mpi_discovery=False)
        return
    if info.device == "cpu":
        load_cpu_op(log_dir, speak=info.rank == 0)  # says when it builds; never behind a dead process's lock
    heartbeat.phase(f"starting the process group ({info.backend}, {info.world_size} rank(s))")
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


def shutdown() -> None:
    """End a multi-process run's default process group before the interpreter exits. Left to finalisation, gloo's
    worker threads can still hold tensors while Python tears down, and a rank dies with SIGABRT ("terminate called
    without an active exception") after a finished run (seen twice in CI at the end of a 2-rank ZeRO-3 run, the
    second time with this teardown but no barrier before it: rank 1 tore its group down while rank 0 was still
    finishing its save). A barrier first, as evaluation_group does, so no rank closes gloo while another still talks
    to it. Only for world size > 1: a single process keeps its group for further in-process runs (tests, sweeps)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()


def world_size() -> int:
    """The default process group's size; 1 without one."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def evaluation_group() -> Iterator[tuple[int, int, object]]:
    """(rank, world_size, device) for a command that runs collectively without an engine (`memlm eval` under
    torchrun or the deepspeed launcher): an initialised group is reused; one is created when RANK and WORLD_SIZE say
    there are several processes; else a single process without a group. A group created here is torn down on the
    way out, after a barrier, so no rank closes gloo while another still talks to it (a SIGABRT at exit)."""
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if dist.is_available() and dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size(), device
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
        yield 0, 1, device
        return
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    try:
        yield dist.get_rank(), dist.get_world_size(), device
    finally:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
