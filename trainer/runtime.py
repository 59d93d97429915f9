"""What every memlm process sets up before torch does any work: torch threads that fit the cores it owns, and a
DeepSpeed op cache keyed by its environment (and glibc malloc settings, trainer/allocator.py).

Threads. torch starts one OpenMP thread per core of the machine by default. Two such processes on the same cores
(the ranks of one job, a Ray trial beside another, an evaluation beside a training run) spin for cores that are
busy: on a 2-core machine a Transformer-XL step took 7.3 s instead of 0.15 s (DESIGN §4). So each process takes

    the Ray task's or trial's CPUs          inside Ray (its num_cpus: what the scheduler reserved for it);
    OMP_NUM_THREADS                         when set (the user's choice, or torchrun's for several ranks);
    affinity cores // local ranks           otherwise: the cores this process may run on (taskset, cgroups,
                                            a scheduler's pinning) shared by the ranks of this node
                                            (LOCAL_WORLD_SIZE from torchrun / Ray Train, LOCAL_SIZE from the
                                            deepspeed launcher);

at least 1, and says which once per process on stderr. Two independent jobs started on the same cores still
each see them all: give each its cores (taskset -c, a scheduler) or OMP_NUM_THREADS.

Op cache. DeepSpeed JIT-builds C++ ops into TORCH_EXTENSIONS_DIR, by default one folder per Python version
shared by every environment on the machine, so two virtualenvs with different torch or DeepSpeed builds rebuild
each other's ops (minutes each). Unless the user sets it, the cache is keyed by what the build depends on: Python,
torch and DeepSpeed versions and the CPU model (ops are built with -march=native), under
~/.cache/memlm/torch_extensions/. Environments with the same versions on the same CPU share their builds.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

LOCAL_RANKS_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")  # torchrun and Ray Train; the deepspeed launcher


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str


_applied: ThreadChoice | None = None
_explicit = False


def affinity_cores() -> int:
    """Cores this process may run on (its affinity mask; the machine's count where there is no mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def local_ranks(env=os.environ) -> int:
    for name in LOCAL_RANKS_VARS:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def choose_threads(cpus: float | None = None, env=os.environ) -> ThreadChoice:
    """The thread count for this process, by the rules in the module docstring (no side effects)."""
    if cpus is not None:
        return ThreadChoice(max(1, int(cpus)), f"the Ray task's {cpus:g} CPUs")
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        if omp.isdigit() and int(omp) > 0:
            return ThreadChoice(int(omp), "OMP_NUM_THREADS")
        print(f"memlm: warning: ignoring OMP_NUM_THREADS={omp!r} (not a positive integer)", file=sys.stderr)
    cores, ranks = affinity_cores(), local_ranks(env)
    return ThreadChoice(max(1, cores // ranks), f"{cores} cores in the affinity mask / {ranks} local rank(s)")


def fit_threads(cpus: float | None = None, who: str = "") -> ThreadChoice:
    """Set torch's thread count for this process and say so once. An explicit `cpus` (a Ray task's reservation)
    always applies; a later call without it keeps that choice (the trainer calls this again inside a trial)."""
    global _applied, _explicit
    if cpus is None and _explicit and _applied is not None:
        return _applied
    choice = choose_threads(cpus)
    import torch

    torch.set_num_threads(choice.threads)
    if choice != _applied:
        label = f"memlm{' ' + who if who else ''}"
        rank = os.environ.get("RANK")
        where = f" rank {rank}" if rank is not None and local_ranks() > 1 else ""
        print(f"{label}:{where} {choice.threads} torch thread{'s' if choice.threads != 1 else ''} "
              f"({choice.reason})", file=sys.stderr, flush=True)
    _applied, _explicit = choice, _explicit or cpus is not None
    return choice


def extension_cache_dir(versions: dict[str, str] | None = None) -> Path:
    """The op cache for this environment: ~/.cache/memlm/torch_extensions/<python-torch-deepspeed-cpu key>."""
    versions = versions or environment_versions()
    key = "-".join(f"{name}{versions[name]}" for name in sorted(versions))
    digest = hashlib.sha256(f"{key}|{cpu_model()}".encode()).hexdigest()[:12]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "memlm" / "torch_extensions" / f"{platform.machine()}-{digest}"


def environment_versions() -> dict[str, str]:
    """What a JIT-built op depends on, read without importing the packages."""
    from importlib import metadata

    versions = {"py": platform.python_version()}
    for name in ("torch", "deepspeed"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "none"
    return versions


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def use_own_extension_cache() -> str:
    """Point TORCH_EXTENSIONS_DIR at this environment's cache unless the user chose one; returns the folder.
    Also exported to child processes (DeepSpeed's launcher ranks, Ray workers through ray_runtime.worker_env).
    Must run before deepspeed builds or loads an op."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(extension_cache_dir())
    return os.environ["TORCH_EXTENSIONS_DIR"]


STALE_LOCK_SECONDS = 300  # an op build takes ~30-60 s; a lock this old was left by a process killed mid-build


def warn_stale_build_locks(folder: str | os.PathLike, now: float | None = None) -> list[Path]:
    """Op build locks in FOLDER older than STALE_LOCK_SECONDS, each named in one warning line.

    torch's extension builder holds a plain `lock` file while it compiles and every other process waits, forever,
    for it to disappear; a builder killed mid-build (Ctrl-C, SIGKILL, a preempted node) leaves it behind, and every
    later run then hangs silently right after its thread line. Deleting it is safe once no build is running, which
    only the user can know, so this says what to delete instead of deleting it."""
    import time

    now = time.time() if now is None else now
    stale = []
    for lock in sorted(Path(folder).glob("*/lock")):
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # removed by its builder meanwhile
            continue
        if age > STALE_LOCK_SECONDS:
            stale.append(lock)
            print(f"memlm: warning: {lock} is {age / 60:.0f} min old: DeepSpeed will wait for it forever; if no other "
                  "process is building that op, delete it", file=sys.stderr, flush=True)
    return stale


def before_torch() -> None:
    """Environment settings that must be in place before torch (and its OpenMP runtime) is imported; the
    `memlm` command calls this first thing, in every process it starts (ranks, Ray workers run it through
    their own entry points)."""


def prepare_process(cpus: float | None = None, who: str = "") -> ThreadChoice:
    """Both of the above: what train, eval and the Ray tasks call first (and a word on a stale op build lock);
    also keeps malloc from returning each step's memory to the kernel (trainer/allocator.py)."""
    from trainer.allocator import tune_allocator

    tune_allocator()
    warn_stale_build_locks(use_own_extension_cache())
    return fit_threads(cpus, who)
