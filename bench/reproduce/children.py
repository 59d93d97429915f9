"""The `memlm` processes a reproduction script starts, and how they stop.

Each child runs in a session of its own (start_new_session), so a Ctrl-C at the terminal reaches the script alone
and the script decides. On Ctrl-C or SIGTERM it sends SIGINT to every child's process group, waits up to `grace`
seconds, then SIGKILLs whatever is left in the children's sessions (Ray's processes included: they move into
process groups of their own, never out of the session). A second Ctrl-C skips the wait.

SIGINT whichever signal the script got: an interrupted run starts over when the script runs again, so the
checkpoint `memlm train` writes on SIGTERM would be thrown away, and SIGINT unwinds every child at once, its
`finally` blocks included (DeepSpeed's op-build lock is released; `memlm extrapolate` stops Ray in seconds where
its SIGTERM took 30 s).

Once the script is stopping, no child starts and a child that ends raises Stopped, never a failure: an
interrupted command is neither a finished run nor a failed one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from memlm.bench.interrupt import Stopped


@dataclass
class Child:
    name: str  # the run ("txl-s1"), or what the step is about ("data")
    what: str  # the command: "train", "eval test", "extrapolate"
    proc: subprocess.Popen | None  # None until it has started
    run_dir: Path | None = None  # a training's folder: its metrics.jsonl says how far it is
    steps: int | None = None
    started: float = field(default_factory=time.time)
    first_row: tuple[float, int] | None = None  # (time written, step) of the first row seen: the rate for the ETA

    def position(self, eta: bool = True) -> str:
        """`txl-s1 train step 340/2000, ETA 6:10`, or `lamemo-s1 eval test for 0:40`."""
        step, written = last_step(self.run_dir / "metrics.jsonl") if self.run_dir else (None, None)
        if step is None or not self.steps:
            return f"{self.name} {self.what} for {clock(time.time() - self.started)}"
        if not eta:
            return f"{self.name} {self.what} step {step}/{self.steps}"
        if self.first_row is None or self.first_row[1] >= step:
            self.first_row = self.first_row or (written, step)
            since, done = self.started, step  # one row so far: the rate includes the start-up, a pessimistic ETA
        else:
            since, done = self.first_row[0], step - self.first_row[1]
        rate = done / max(written - since, 1e-6)
        left = f", ETA {clock((self.steps - step) / rate)}" if rate > 0 else ""
        return f"{self.name} {self.what} step {step}/{self.steps}{left}"


def last_step(metrics: Path) -> tuple[int | None, float | None]:
    """The step of the last row in a metrics.jsonl and when it was written (None, None before the first row)."""
    try:
        with metrics.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [line for line in f.read().splitlines() if line.strip()]
            written = os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None, None
    try:
        return int(json.loads(lines[-1])["step"]), written
    except (IndexError, ValueError, KeyError):  # no row yet, or the last one half written
        return None, None


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class Children:
    def __init__(self, grace: float = 30.0):
        self.grace = grace
        self.signum: int | None = None
        self._lock = threading.RLock()  # re-entrant: the signal handler may run while the main thread holds it
        self._live: dict[int, Child] = {}
        self._stopping: list[Child] = []  # the children running when the signal came (some may be gone by stop())
        self._sessions: set[int] = set()  # the children's sessions still holding a process: where leftovers are

    def run(self, cmd: list[str], *, stdout, cwd: Path, env: dict, name: str, what: str,
            run_dir: Path | None = None, steps: int | None = None) -> int:
        """Run CMD to its end and return its exit status; Stopped when the script is stopping."""
        child = Child(name, what, None, run_dir, steps)
        if threading.current_thread() is not threading.main_thread():
            return self._run(cmd, stdout, cwd, env, child)
        # The signal handler raises in the main thread wherever it is: between starting a child and recording it,
        # that would lose the child. A helper thread (where no handler runs) starts and waits on it instead.
        box: dict = {}

        def target() -> None:
            try:
                box["status"] = self._run(cmd, stdout, cwd, env, child)
            except BaseException as err:  # noqa: BLE001  (handed to the main thread)
                box["error"] = err

        helper = threading.Thread(target=target, daemon=True, name=f"memlm {what}")
        helper.start()
        helper.join()  # interruptible: Stopped lands here while the child is being stopped
        if "error" in box:
            raise box["error"]
        return box["status"]

    def _run(self, cmd, stdout, cwd, env, child: Child) -> int:
        with self._lock:  # forward() takes the lock too: it either ran before (signum is set) or sees this child
            if self.signum is not None:
                raise Stopped(self.signum)
            child.proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                          start_new_session=True)
            self._live[child.proc.pid] = child
            self._sessions.add(child.proc.pid)
        try:
            status = child.proc.wait()
        finally:
            with self._lock:
                self._live.pop(child.proc.pid, None)
                if not session_members({child.proc.pid}):  # an empty session's number may go to a stranger
                    self._sessions.discard(child.proc.pid)
        if self.signum is not None:
            raise Stopped(self.signum)
        return status

    def running(self) -> list[Child]:
        with self._lock:
            return list(self._live.values())

    def forward(self, signum: int) -> None:
        """The signal handler's first call: no new child from now on, and each running one is interrupted."""
        with self._lock:
            self.signum = signum
            self._stopping = list(self._live.values())
            for child in self._stopping:
                _signal_group(child.proc.pid, signal.SIGINT)

    def kill_now(self, signum: int) -> None:
        """A second Ctrl-C (or SIGTERM) while stopping: no more waiting."""
        self.grace = 0
        for child in self.running():
            _signal_group(child.proc.pid, signal.SIGKILL)

    def check(self) -> None:
        """For a job that waits on something else than a child: Stopped once the script is stopping."""
        if self.signum is not None:
            raise Stopped(self.signum)

    def stop(self) -> list[tuple[str, str, bool]]:
        """After forward(): wait up to `grace` for the children, then SIGKILL what is left of their sessions.
        Returns (name, what it was doing, whether it had to be killed) for each child that was running."""
        stopping = self._stopping
        doing = [child.position(eta=False).removeprefix(child.name + " ") for child in stopping]
        start = time.monotonic()
        while any(c.proc.returncode is None for c in stopping) and time.monotonic() - start < self.grace:
            time.sleep(0.1)  # the threads that started the children reap them (returncode); poll() would race them
        killed = [child.proc.returncode is None for child in stopping]
        for child, hung in zip(stopping, killed):
            if hung:  # not reaped yet, so its group's number is still its own
                _signal_group(child.proc.pid, signal.SIGKILL)
        for child in stopping:
            child.proc.wait()
        # What the children left behind, until it is gone: the script exits only when nothing of theirs runs.
        for _ in range(50):
            left = session_members(self._sessions)
            if not left:
                break
            for pid in left:
                _signal_pid(pid, signal.SIGKILL)
            time.sleep(0.1)
        return list(zip([child.name for child in stopping], doing, killed))


def session_members(sessions: set[int]) -> list[int]:
    """The live processes in these sessions (Linux /proc; elsewhere the process groups were all there is)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.getsid(int(entry)) in sessions and not _zombie(int(entry)):
                    members.append(int(entry))
            except OSError:  # gone meanwhile
                pass
    return members


def _zombie(pid: int) -> bool:
    """Dead, waiting for its parent to collect its status: nothing left to stop."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "Z"


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # the group has ended
        pass


def _signal_pid(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


CHILDREN = Children()
