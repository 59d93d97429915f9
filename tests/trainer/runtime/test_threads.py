"""Threads that fit the cores (trainer/runtime/process.py): every memlm process sets torch's thread count to the cores
it
owns, so processes that share a machine never oversubscribe it, and a count memlm chose itself follows the load
(one thread less per core other processes keep busy); and the DeepSpeed op cache is keyed by the environment.
The side-by-side tests read the thread counts the processes chose (their stderr lines), never a timing (speed
is bench/benchmarks/bench_threads_shared.py). They start real processes without OMP_NUM_THREADS (child_env sets it;
these
tests remove it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from memlm.trainer.runtime import process as runtime
from support.training import DEEPSPEED, REPO, child_env, make_data, overrides, preset

# `-m 'not slow'` leaves these out: trainings and launchers that measure threads, 80 s in all on 2 busy cores
pytestmark = pytest.mark.slow

CHOICE = re.compile(r"memlm (\w+):(?: rank (\d+))? (\d+) torch threads? \((.+)\)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("threads_data"))


def env_without_threads(**extra) -> dict:
    env = child_env(extra)
    env.pop("OMP_NUM_THREADS", None)
    return env


def choices(stderr: str) -> list[tuple[str, int, str]]:
    return [(m.group(2) or "0", int(m.group(3)), m.group(4)) for m in CHOICE.finditer(stderr)]


def test_choice_rules():
    cores = runtime.affinity_cores()
    assert runtime.choose_threads(env={}).threads == cores
    assert runtime.choose_threads(env={"LOCAL_WORLD_SIZE": "2"}).threads == max(1, cores // 2)  # torchrun, Ray Train
    assert runtime.choose_threads(env={"LOCAL_SIZE": str(4 * cores)}).threads == 1  # deepspeed launcher; >= 1
    assert runtime.choose_threads(env={"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "2"}) == \
        runtime.ThreadChoice(3, "OMP_NUM_THREADS")
    ray = runtime.choose_threads(cpus=2, env={"OMP_NUM_THREADS": "1"})  # a Ray task's reservation wins
    assert ray.threads == 2 and "Ray" in ray.reason


def test_only_memlms_own_count_for_a_lone_rank_follows_the_load():
    assert runtime.choose_threads(env={}).follows_load == (runtime.affinity_cores() > 1)
    for chosen_elsewhere in ({"OMP_NUM_THREADS": "2"}, {"LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "2"}):
        assert not runtime.choose_threads(env=chosen_elsewhere).follows_load  # the user's count is kept
    assert not runtime.choose_threads(cpus=2, env={}).follows_load  # a Ray reservation is kept
    assert not runtime.choose_threads(env={"LOCAL_WORLD_SIZE": "2"}).follows_load  # each rank would see the other
    runtime.fit_threads(who="test")  # conftest sets OMP_NUM_THREADS=1: nothing to follow
    assert runtime.refit_threads() is None


def test_one_thread_less_per_core_other_processes_keep_busy():
    assert runtime.threads_for(2, 2, others=0.0) == 2
    assert runtime.threads_for(2, 2, others=0.2) == 2  # a shell, the kernel's own work
    assert runtime.threads_for(2, 2, others=0.3) == 1
    assert runtime.threads_for(2, 2, others=1.0) == 1
    assert runtime.threads_for(2, 2, others=7.0) == 1  # never below one
    assert runtime.threads_for(16, 16, others=3.0) == 13
    assert runtime.threads_for(16, 16, others=3.3) == 12
    assert runtime.threads_for(8, 16, others=8.0) == 8  # the other half of the machine is not ours anyway


def test_busy_seconds_reads_the_cores_it_is_asked_about():
    stat = ("cpu  900 0 900 9000 0 0 0 0 0 0\n"
            "cpu0 100 10 200 5000 70 3 4 50 0 0\n"  # user nice system idle iowait irq softirq steal guest guest_nice
            "cpu1 400 0 600 4000 0 0 0 0 0 0\n"
            "intr 123 4 5\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert runtime.busy_seconds(frozenset({0}), stat) == pytest.approx(317 / tick)  # not idle, iowait, steal
    assert runtime.busy_seconds(frozenset({0, 1}), stat) == pytest.approx(1317 / tick)
    assert runtime.busy_seconds(frozenset({5}), stat) == 0
    cores = frozenset(os.sched_getaffinity(0))
    assert 0 < runtime.busy_seconds(cores) <= runtime.busy_seconds(cores)  # the real counters only grow


class Readings:
    """Scripted clock, core and own-CPU readings for a LoadFollower, and the thread counts it sets."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0
        self.set: list[int] = []

    def advance(self, seconds: float, others: float, own: float) -> None:
        """`seconds` pass in which other processes use `others` cores and this process `own` cores."""
        self.now += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own

    def follower(self) -> runtime.LoadFollower:
        return runtime.LoadFollower(2, "memlm test", frozenset({0, 1}), clock=lambda: self.now,
                                    own_cpu=lambda: self.own, busy=lambda cores: self.busy,
                                    set_threads=self.set.append)


def test_the_follower_steps_down_at_once_and_back_up_after_a_quiet_while(capsys):
    r = Readings()
    follower = r.follower()
    r.advance(runtime.FIRST_POLL_SECONDS / 2, others=1.0, own=2.0)
    assert follower.poll() == 2 and r.set == []  # not due yet: a clock read only
    r.advance(runtime.FIRST_POLL_SECONDS / 2, others=1.0, own=0.0)
    assert follower.poll() == 1 and r.set == [1]  # a busy process beside it: down at the first measurement
    assert follower.others == pytest.approx(1.0)
    r.advance(runtime.POLL_SECONDS / 2, others=0.0, own=1.0)
    follower.poll()  # the next measurements come a second apart
    assert follower.others == pytest.approx(1.0)
    for _ in range(runtime.RAISE_AFTER - 1):
        r.advance(1.0, others=0.0, own=1.0)
        assert follower.poll() == 1  # free again, not yet for long enough
    r.advance(1.0, others=0.0, own=1.0)
    assert follower.poll() == 2 and r.set == [1, 2]
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["memlm test: 1 torch thread (other processes keep 1.0 of its 2 cores busy)"]  # one a minute
    r.advance(runtime.SAY_EVERY_SECONDS, others=0.0, own=2.0)
    assert follower.poll() == 2  # the change not said yet is said once a minute has passed
    assert capsys.readouterr().err.splitlines() == ["memlm test: 2 torch threads (its cores are free again)"]
    r.advance(1.0, others=0.0, own=2.0)
    assert follower.poll() == 2 and capsys.readouterr().err == ""


def test_the_followers_own_work_is_not_anyone_elses():
    r = Readings()
    follower = r.follower()
    for _ in range(3):
        r.advance(1.0, others=0.1, own=2.0)  # its own two threads keep both cores busy
        assert follower.poll() == 2
    assert r.set == [] and follower.others == pytest.approx(0.1)


def test_cores_must_stay_free_in_a_row_before_threads_come_back():
    r = Readings()
    follower = r.follower()
    r.advance(1.0, others=1.0, own=1.0)
    assert follower.poll() == 1
    for _ in range(runtime.RAISE_AFTER - 1):
        r.advance(1.0, others=0.0, own=1.0)
        follower.poll()
    r.advance(1.0, others=0.5, own=1.0)  # busy again just before the last one: start counting over
    assert follower.poll() == 1
    for _ in range(runtime.RAISE_AFTER - 1):
        r.advance(1.0, others=0.0, own=1.0)
        assert follower.poll() == 1
    r.advance(1.0, others=0.0, own=1.0)
    assert follower.poll() == 2 and r.set == [1, 2]


BESIDE_A_BUSY_PROCESS = """
import time, torch
from memlm.trainer.runtime.process import prepare_process, refit_threads
prepare_process(who="test")
x = torch.randn(256, 256)
end = time.monotonic() + 2.5
while time.monotonic() < end:  # steps of torch work, each after the loops' call
    refit_threads()
    x = torch.tanh(x @ x) * 0.1
print(torch.get_num_threads())
"""


def test_a_real_busy_process_beside_it_takes_a_thread_away():
    """A `while True` process pinned to one of this process's cores: the real measurement (/proc/stat against
    the process's own CPU time) sees it, and torch's threads go down to the cores left, said in one line."""
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "this test needs 2 cores (CI has 2)"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {cores[-1]}))
    try:
        proc = subprocess.run([sys.executable, "-c", BESIDE_A_BUSY_PROCESS], cwd=REPO, env=env_without_threads(),
                              capture_output=True, text=True, timeout=120)
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [n for _, n, _ in choices(proc.stderr)]
    assert got[0] == len(cores) and got[-1] < len(cores), proc.stderr
    assert int(proc.stdout) == got[-1]
    assert "other processes keep" in proc.stderr and "fewer while other processes" in proc.stderr


def test_memlm_train_gives_a_busy_process_its_core(data, tmp_path):
    """The call site: a real `memlm train` (memlm's own count, one rank) beside a `while True` process pinned to
    one of its cores drops to the cores left during training and says so in one line."""
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "this test needs 2 cores (CI has 2)"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {cores[-1]}))
    try:
        cmd = [sys.executable, "-m", "memlm", "train", preset("txl"), *overrides(data, train__steps=60),
               "--out", str(tmp_path / "run")]
        proc = subprocess.run(cmd, cwd=REPO, env=env_without_threads(), capture_output=True, text=True, timeout=300)
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"memlm train: {len(cores) - 1} torch thread" in proc.stderr and "other processes keep" in proc.stderr, \
        proc.stderr[-3000:]


def test_bad_omp_num_threads_is_named_and_ignored(capsys):
    choice = runtime.choose_threads(env={"OMP_NUM_THREADS": "lots"})
    assert choice.threads == runtime.affinity_cores()
    assert "ignoring OMP_NUM_THREADS='lots'" in capsys.readouterr().err


def test_two_ranks_under_the_deepspeed_launcher_share_the_cores(data, tmp_path):
    """The deepspeed launcher sets no OMP_NUM_THREADS: each of its 2 ranks must take half the cores."""
    from memlm.trainer.runtime.distributed import free_port, shm_buffer_path

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    port = str(free_port())
    cmd = [str(DEEPSPEED), "--hostfile", str(hostfile), "--num_gpus", "2", "--no_ssh_check", "--master_addr",
           "127.0.0.1", "--master_port", port, "--module", "memlm", "train", preset("txl"),
           *overrides(data, train__steps=2, train__save_every=0), "--out", str(tmp_path / "ds")]
    proc = subprocess.run(cmd, cwd=REPO, env=env_without_threads(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # DeepSpeed's 66 MB shared-memory all-reduce buffers (one per rank, in RAM) are gone once the run is
    buffers = [shm_buffer_path(rank, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for rank in (0, 1)]
    assert not any(b.exists() for b in buffers), buffers
    got = choices(proc.stderr + proc.stdout)
    cores = len(os.sched_getaffinity(0))
    assert sorted(rank for rank, _, _ in got) == ["0", "1"], got
    assert all(n == max(1, cores // 2) and "/ 2 local rank" in why for _, n, why in got), got
    assert sum(n for _, n, _ in got) <= max(cores, 2)


def test_two_trainers_side_by_side_on_their_own_cores(data, tmp_path):
    """Two plain `memlm train` processes at once, each started on its own core (as a scheduler or taskset would
    place them): each takes the one core it owns instead of one thread per core of the machine."""
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "this test needs 2 cores (CI has 2)"
    procs = []
    for i, core in enumerate(cores[:2]):
        cmd = [sys.executable, "-m", "memlm", "train", preset("txl"),
               *overrides(data, train__steps=3, train__save_every=0), "--out", str(tmp_path / f"run{i}")]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env_without_threads(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      preexec_fn=lambda c=core: os.sched_setaffinity(0, {c})))
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    got = [choices(err) for _, err in outputs]
    assert [[n for _, n, _ in g] for g in got] == [[1], [1]], got
    assert all("1 cores in the affinity mask / 1 local rank" in g[0][2] for g in got), got


def test_a_plain_trainer_takes_every_core_it_owns(data, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "memlm", "train", preset("txl"),
                           *overrides(data, train__steps=2, train__save_every=0), "--out", str(tmp_path / "one")],
                          cwd=REPO, env=env_without_threads(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The first choice; a busy machine (the other test worker) may then take threads away (following the load).
    assert choices(proc.stderr)[0][1] == len(os.sched_getaffinity(0))


def test_op_cache_is_keyed_by_the_environment(monkeypatch):
    base = {"py": "3.11.7", "torch": "2.13.0", "deepspeed": "0.19.8"}
    same = runtime.extension_cache_dir(dict(base))
    assert same == runtime.extension_cache_dir(dict(base))  # the same versions share their builds
    assert runtime.extension_cache_dir({**base, "torch": "2.11.0"}) != same  # another environment: its own folder
    assert runtime.extension_cache_dir({**base, "deepspeed": "0.18.0"}) != same
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert runtime.use_own_extension_cache() == str(runtime.extension_cache_dir())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    assert runtime.use_own_extension_cache() == "/somewhere/else"  # the user's choice wins


def test_a_stale_op_build_lock_is_named_in_one_warning(tmp_path, capsys):
    """A builder killed mid-build leaves `lock` behind and DeepSpeed waits on it forever: memlm names it."""
    import os

    from memlm.trainer.runtime.process import STALE_LOCK_SECONDS, warn_stale_build_locks

    fresh, old = tmp_path / "op_a" / "lock", tmp_path / "op_b" / "lock"
    for lock in (fresh, old):
        lock.parent.mkdir()
        lock.touch()
    now = old.stat().st_mtime + STALE_LOCK_SECONDS + 60
    os.utime(fresh, (now - 10, now - 10))  # a build that is running right now
    assert warn_stale_build_locks(tmp_path, now=now) == [old]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(old) in lines[0] and "delete it" in lines[0]
    assert warn_stale_build_locks(tmp_path / "missing") == []
