"""trainer/runtime/allocator.py: the malloc settings every memlm process applies, checked by what the kernel sees.

The behavioural tests run a fresh interpreter (the settings are per process and cannot be undone) that repeats a
"step" of allocating, touching and freeing 256 MB of tensors, and count the page faults of the last repetition.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlm.trainer.runtime.allocator import choose_allocator

ROOT = Path(__file__).resolve().parents[3]

STEP_SCRIPT = r"""
import json, resource, sys
import torch
if sys.argv[1] == "prepare":
    from memlm.trainer.runtime.process import prepare_process
    prepare_process(who="test")
from memlm.trainer.runtime import allocator

def step():
    # 16 x 16 MiB, below the mmap threshold memlm sets, like a step's activations
    tensors = [torch.ones(4 * 2**20) for _ in range(16)]
    del tensors

for _ in range(2):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"faults": faults, "tuned": allocator._applied.tuned if allocator._applied else None}))
"""


def run_steps(how: str, **env_overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "MEMLM_MALLOC"}
    env.update(env_overrides, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", STEP_SCRIPT, how], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


PAGES_PER_STEP = 256 * 2**20 // 4096  # 65,536 pages of 4 KiB


@pytest.mark.slow
def test_memlm_processes_keep_step_memory_mapped():
    """After prepare_process, a repeated step reuses its pages: almost no page faults. The counter is shown to see
    faults where they happen: with every tensor given its own mapping (glibc's behaviour for large blocks, forced
    here with MALLOC_MMAP_THRESHOLD_, which also makes memlm leave malloc alone) the step faults on every page."""
    tuned = run_steps("prepare")
    assert tuned["tuned"] is True
    assert tuned["faults"] < PAGES_PER_STEP // 8, tuned  # at most a tensor or two of fresh pages
    mapped = run_steps("prepare", MALLOC_MMAP_THRESHOLD_="131072")
    assert mapped["tuned"] is False
    assert mapped["faults"] > PAGES_PER_STEP // 2, mapped


@pytest.mark.slow
def test_opting_out_and_not_preparing_leave_malloc_alone():
    """MEMLM_MALLOC=system keeps glibc's defaults; importing memlm without prepare_process changes nothing.
    (glibc's own dynamic thresholds then decide, and whether they trim between steps depends on the heap's
    layout, so only the decision is checked here; bench/benchmarks/bench_allocator.py measures the effect.)"""
    assert run_steps("prepare", MEMLM_MALLOC="system")["tuned"] is False
    assert run_steps("import-only")["tuned"] is None


@pytest.mark.parametrize("env,tuned,reason", [
    ({}, True, "glibc trim threshold"),
    ({"MEMLM_MALLOC": "tuned"}, True, "glibc trim threshold"),
    ({"MEMLM_MALLOC": "system"}, False, "MEMLM_MALLOC=system"),
    ({"MEMLM_MALLOC": "fast"}, False, "neither 'tuned' nor 'system'"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, False, "jemalloc is preloaded"),
    ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, False, "tcmalloc is preloaded"),
    ({"MALLOC_TRIM_THRESHOLD_": "1000000"}, False, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, False, "GLIBC_TUNABLES is set"),
])
def test_choice_rules(env, tuned, reason):
    choice = choose_allocator(env)
    assert choice.tuned is tuned
    assert reason in choice.reason


def test_a_bad_setting_is_named_once_and_ignored():
    script = "from memlm.trainer.runtime.process import prepare_process; prepare_process(who='test')"
    env = {**os.environ, "MEMLM_MALLOC": "fast", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    warnings = [line for line in out.stderr.splitlines() if "MEMLM_MALLOC" in line]
    assert warnings == \
        ["memlm: warning: ignoring MEMLM_MALLOC='fast' is neither 'tuned' nor 'system'; kept the defaults"]
