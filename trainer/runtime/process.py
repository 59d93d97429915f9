"""What every memlm process sets up before torch does any work: torch threads that fit the cores it owns, and a
DeepSpeed op cache keyed by its environment (and glibc malloc settings, trainer/runtime/allocator.py).

Threads. torch starts one OpenMP thread per core of the machine by default. Two such processes on the same cores
(the ranks of one job, a Ray trial beside another, an evaluation beside a training run) spin for cores that are
busy: on a 2-core machine a Transformer-XL step took 7.3 s instead of 0.15 s (docs/design.md §4). So each process takes

    the Ray task's or trial's CPUs          inside Ray (its num_cpus: what the scheduler reserved for it);
    OMP_NUM_THREADS                         when set (the user's choice, or torchrun's for several ranks);
    affinity cores // local ranks           otherwise: the cores this process may run on (taskset, cgroups,
                                            a scheduler's pinning) shared by the ranks of this node
                                            (LOCAL_WORLD_SIZE from torchrun / Ray Train, LOCAL_SIZE from the
                                            deepspeed launcher);

at least 1, and says which once per process on stderr.

Following the load. A count chosen at start cannot know what starts beside it later. OpenMP's threads (libgomp
in torch's wheels) spin ~10 ms (300,000 iterations) at each barrier before they sleep, so one busy single-threaded
process beside a 2-thread `memlm eval` on 2 cores made it 3-4x slower on an otherwise idle machine and 20-100x
slower on one busy with other work as well: the thread that shares its core spins through its time slices while
its partner waits for it. Sleeping at once (OMP_WAIT_POLICY=PASSIVE, read once, when torch loads) avoids that
but pays a wake-up per parallel region: the README's eval ran at 0.54x on an idle 2-core VM
(bench/benchmarks/bench_threads_shared.py). So a count memlm chose itself (the affinity rule, one rank on the node)
follows the load instead: `refit_threads()`, for the loops that run torch work to call once per step (a clock
read unless a measurement is due), measures how much of this process's cores other processes used since the
last measurement (the cores' busy time in /proc/stat minus this process's own CPU time; the first 0.25 s after
the choice, then every second) and at once takes one thread less per core they keep busy, at least 1; threads
come back after RAISE_AFTER measurements in a row find the cores free. On an idle machine nothing changes. A
change is said in one line (at most one a minute).
A count the user or a scheduler chose (OMP_NUM_THREADS, a Ray reservation, several ranks per node, which would
count each other) is kept as it is. A count that changes mid-run changes the order of float sums: for
bit-identical runs on a busy machine, set OMP_NUM_THREADS.

Op cache. DeepSpeed JIT-builds C++ ops into TORCH_EXTENSIONS_DIR; unless the user sets it, each environment gets
a folder of its own under ~/.cache/memlm/torch_extensions/ (op_cache.py says why and how it is keyed).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import heartbeat
from .allocator import tune_allocator

# The op cache's names, used here and imported from here by older callers.
from .op_cache import (  # noqa: F401
    STALE_LOCK_SECONDS,
    cpu_model,
    environment_versions,
    extension_cache_dir,
    use_own_extension_cache,
    warn_stale_build_locks,
)

LOCAL_RANKS_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")  # torchrun and Ray Train; the deepspeed launcher
STAT = Path("/proc/stat")  # per-core CPU time, what following the load measures (Linux)


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str
    follows_load: bool = False  # memlm's own count for the only rank on the node: fewer while others need cores


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
    threads = max(1, cores // ranks)
    return ThreadChoice(threads, f"{cores} cores in the affinity mask / {ranks} local rank(s)",
                        follows_load=ranks == 1 and threads > 1 and STAT.is_file())


def fit_threads(cpus: float | None = None, who: str = "") -> ThreadChoice:
    """Set torch's thread count for this process and say so once. An explicit `cpus` (a Ray task's reservation)
    always applies; a later call without it keeps that choice (the trainer calls this again inside a trial).
    A count memlm chose itself follows the load from here on (refit_threads)."""
    global _applied, _explicit, _follower
    if cpus is None and _explicit and _applied is not None:
        return _applied
    choice = choose_threads(cpus)
    import torch

    torch.set_num_threads(choice.threads)
    label = f"memlm{' ' + who if who else ''}"
    if choice != _applied:
        rank = os.environ.get("RANK")
        where = f" rank {rank}" if rank is not None and local_ranks() > 1 else ""
        follows = "; fewer while other processes keep its cores busy" if choice.follows_load else ""
        say_threads(f"{label}:{where}", choice.threads, choice.reason + follows)
    _follower = LoadFollower(choice.threads, label) if choice.follows_load else None
    _applied, _explicit = choice, _explicit or cpus is not None
    return choice


def say_threads(label: str, threads: int, reason: str) -> None:
    print(f"{label} {threads} torch thread{'s' if threads != 1 else ''} ({reason})", file=sys.stderr, flush=True)
    heartbeat.said()  # the console just heard from this process: the start watch's silence starts over


# ---------------------------------------------------------------------------------------------------------------
# Following the load (module docstring)

OTHERS_TOLERANCE = 0.25  # cores other processes may keep busy before one counts as taken (the kernel, a shell)
POLL_SECONDS = 1.0  # how often refit_threads measures; calls in between only read the clock
FIRST_POLL_SECONDS = 0.25  # the first measurement, over the process's start: before its first steps, mostly
RAISE_AFTER = 5  # measurements in a row that must find the cores free before threads are added back
SAY_EVERY_SECONDS = 60.0  # a count that changes more often is applied silently in between

_follower: LoadFollower | None = None


def threads_for(base: int, cores: int, others: float) -> int:
    """Threads for a process whose own choice is `base` on `cores` cores when other processes keep `others` cores
    busy: one less per core they use (a core counts once they use more than OTHERS_TOLERANCE of it), at least 1."""
    taken = max(0, math.ceil(others - OTHERS_TOLERANCE))
    return max(1, min(base, cores - taken))


def busy_seconds(cores: frozenset[int], stat: str | None = None) -> float:
    """CPU seconds that `cores` have spent running anything since boot (/proc/stat: user, nice, system, irq and
    softirq; not idle, iowait, or time the hypervisor took)."""
    stat = STAT.read_text() if stat is None else stat
    ticks = 0
    for line in stat.splitlines():
        name, _, fields = line.partition(" ")
        if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in cores:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields.split()[:7])
            ticks += user + nice + system + irq + softirq
    return ticks / os.sysconf("SC_CLK_TCK")


class LoadFollower:
    """Keeps this process's torch threads to the cores other processes leave free (module docstring). poll()
    must run in the thread that runs the torch work: OpenMP's thread count belongs to the thread that sets it."""

    def __init__(self, base: int, label: str, cores: frozenset[int] | None = None, clock=time.monotonic,
                 own_cpu=time.process_time, busy=busy_seconds, set_threads=None):
        self.base = self.threads = base
        self.label = label
        self.cores = cores if cores is not None else frozenset(os.sched_getaffinity(0))
        self.clock, self.own_cpu, self.busy = clock, own_cpu, busy
        self.set_threads = set_threads or _set_torch_threads
        self.others = 0.0  # cores other processes kept busy over the last measurement
        self._raise_votes = 0
        self._said, self._said_at = base, -math.inf  # what the last line said (fit_threads said the base), and when
        self._last = self._measure()
        self._due = self._last[0] + FIRST_POLL_SECONDS

    def _measure(self) -> tuple[float, float, float]:
        return self.clock(), self.busy(self.cores), self.own_cpu()

    def poll(self) -> int:
        if self.clock() < self._due:
            return self.threads
        now = self._measure()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last, self._due = now, t1 + POLL_SECONDS
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9)
        wanted = threads_for(self.base, len(self.cores), self.others)
        self._raise_votes = self._raise_votes + 1 if wanted > self.threads else 0
        if wanted < self.threads or self._raise_votes >= RAISE_AFTER:
            self.set_threads(wanted)
            self.threads, self._raise_votes = wanted, 0
        if self.threads != self._said and t1 - self._said_at >= SAY_EVERY_SECONDS:
            self._said, self._said_at = self.threads, t1
            why = (f"other processes keep {self.others:.1f} of its {len(self.cores)} cores busy"
                   if self.threads < self.base else "its cores are free again")
            say_threads(f"{self.label}:", self.threads, why)
        return self.threads


def _set_torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def refit_threads() -> int | None:
    """Once per step, from the thread that runs the torch work: follow the load when memlm chose the count
    (see the module docstring); returns the thread count now in use, None when it does not follow the load."""
    return _follower.poll() if _follower is not None else None


def before_torch() -> None:
    """Environment settings that must be in place before torch (and its OpenMP runtime) is imported; the
    `memlm` command calls this first thing, in every process it starts (ranks, Ray workers run it through
    their own entry points)."""


def prepare_process(cpus: float | None = None, who: str = "") -> ThreadChoice:
    """Both of the above: what train, eval and the Ray tasks call first (and a word on a stale op build lock);
    also keeps malloc from returning each step's memory to the kernel (trainer/runtime/allocator.py)."""
    tune_allocator()
    warn_stale_build_locks(use_own_extension_cache())
    return fit_threads(cpus, who)
