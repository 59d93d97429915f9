"""Keep glibc's malloc from handing a training step's memory back to the kernel between steps.

A CPU training step allocates hundreds of MB of activations and frees them at its end. With glibc's defaults, a
free region of more than ~64 MiB at the top of the heap is returned to the kernel (trimmed), and blocks above the
mmap threshold get their own mapping that is unmapped on free. The next step asks for the same memory again and
the kernel zero-fills it page by page: every 4 KiB page of every large tensor costs a page fault, each step. In
the benchmark step (bench/benchmarks/bench_allocator.py) removing them made a step 1.07-1.10x faster (11-23k faults per
step
gone), more under bf16, where matmuls are faster and the same faults weigh more.

So every memlm process (through trainer.runtime.process.prepare_process) raises glibc's trim threshold and fixes its
mmap threshold at the largest value glibc accepts: the pages a step used stay mapped for the next one. The
process's resident memory then stays at its peak instead of falling between steps; it never grows beyond it.

MEMLM_MALLOC=system keeps glibc's defaults. Nothing is changed where another allocator is preloaded
(jemalloc, tcmalloc, mimalloc), where the user tuned glibc through MALLOC_*_ environment variables or
GLIBC_TUNABLES, or where the C library has no mallopt (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: effectively "never trim"
TOP_PAD = 64 * 2**20  # grow the heap in steps of at least this much (fewer brk calls)
MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2); larger values are rejected

PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
USER_TUNING_VARS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


@dataclass(frozen=True)
class AllocatorChoice:
    tuned: bool
    reason: str
    bad_setting: bool = False  # MEMLM_MALLOC holds a value that means nothing: said once in a warning


_applied: AllocatorChoice | None = None


def choose_allocator(env=os.environ) -> AllocatorChoice:
    """Whether this process should tune glibc, and why (no side effects)."""
    setting = env.get("MEMLM_MALLOC", "").strip().lower()
    if setting not in ("", "tuned", "system"):
        return AllocatorChoice(False, f"MEMLM_MALLOC={setting!r} is neither 'tuned' nor 'system'; kept the defaults",
                               bad_setting=True)
    if setting == "system":
        return AllocatorChoice(False, "MEMLM_MALLOC=system")
    preload = env.get("LD_PRELOAD", "")
    for name in PRELOADED_ALLOCATORS:
        if name in preload:
            return AllocatorChoice(False, f"{name} is preloaded")
    for name in USER_TUNING_VARS:
        if env.get(name):
            return AllocatorChoice(False, f"{name} is set")
    return AllocatorChoice(True, "glibc trim threshold 2 GiB, mmap threshold 32 MiB")


def glibc_mallopt():
    """The C library's mallopt, or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def tune_allocator(env=os.environ) -> AllocatorChoice:
    """Apply choose_allocator's decision once per process; returns what was done."""
    global _applied
    if _applied is not None:
        return _applied
    choice = choose_allocator(env)
    if choice.bad_setting:  # a typo in MEMLM_MALLOC is said once, as a bad OMP_NUM_THREADS is
        print(f"memlm: warning: ignoring {choice.reason}", file=sys.stderr, flush=True)
    if choice.tuned:
        mallopt = glibc_mallopt()
        # mallopt returns 1 on success; musl's stub returns 0 and changes nothing.
        if mallopt is None or not all(mallopt(param, value) == 1 for param, value in (
                (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD), (M_MMAP_THRESHOLD, MMAP_THRESHOLD))):
            choice = AllocatorChoice(False, "this C library does not take glibc's mallopt settings")
    _applied = choice
    return choice
