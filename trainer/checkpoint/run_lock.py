"""One writer per run folder: `memlm train` holds RUN_DIR/.memlm-train.lock while it trains into RUN_DIR.

Two `memlm train` started at once into the same new folder both found it empty and both trained: every metrics row
twice, the same checkpoints written by both (issue 32). So rank 0 takes an flock on the lock file before it looks at
the folder (run_folder.claim) and keeps it until the run ends; a second start finds it held and is refused in one
line naming the holder's pid, host and start time, which the holder wrote into the file.

A killed run cannot leave a stale lock: the kernel releases an flock when its holder's process dies (SIGKILL, OOM,
a lost terminal). The holder empties the file when it releases the lock normally, so a file that still names a pid
when the lock is free was left by a run that died: the next start takes it over and says so in one line.

Which process holds it. Only rank 0 (plain `memlm train`, or rank 0 under torchrun or the deepspeed launcher):
the other ranks of the same job never write the folder's files before rank 0 has claimed it, and a second job's
rank 0 being refused ends that job (the launchers stop every rank when one fails). The lock file is never deleted
(not even by --overwrite): a process could otherwise lock a deleted file while another locks its replacement.
An flock is local to one machine on most network filesystems: run a job's rank 0 on one node, as every launcher does.
`memlm track` keeps its own lock (tracking/tracker.py LOCK_FILE) with the run's tracker, which this does not replace.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from .errors import ResumeError

LOCK_FILE = ".memlm-train.lock"  # in the run folder


class RunFolderBusy(ResumeError):
    """Another process is training into this run folder now; the message names it."""


_held: dict[str, "RunLock"] = {}  # by resolved folder: this process's locks (a run trained again in-process reuses)


class RunLock:
    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self.fd = run_dir, fd

    def release(self) -> None:
        """Empty the file (so nobody takes this for a dead run's lock) and unlock it."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)  # closing the descriptor releases the flock
        self.fd = None
        _held.pop(_key(self.run_dir), None)


def acquire(run_dir: Path, who: str = "memlm train") -> RunLock:
    """Hold RUN_DIR's lock for this process (creating the folder); RunFolderBusy if another process holds it.
    A lock this process already holds is returned as it is."""
    run_dir = Path(run_dir)
    held = _held.get(_key(run_dir))
    if held is not None and held.fd is not None:
        return held
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _read(fd) or "another process"
        os.close(fd)
        raise RunFolderBusy(f"{run_dir} is being trained into by {holder}: wait for that run to end or stop it, or "
                            "pass --out NEW_DIR to start a separate run") from None
    left = _read(fd)
    if left:
        print(f"memlm train: {run_dir / LOCK_FILE} named {left}, which ended without releasing it (killed?); "
              "this run takes the folder over", file=sys.stderr, flush=True)
    holder = f"{who} pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
    except OSError:  # a full disk: the flock alone guards the folder, and the run's next write says what is wrong
        pass
    lock = RunLock(run_dir, fd)
    _held[_key(run_dir)] = lock
    return lock


def release(run_dir: Path) -> None:
    """Release this process's lock on RUN_DIR, if it holds one."""
    held = _held.get(_key(Path(run_dir)))
    if held is not None:
        held.release()


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip()


def _key(run_dir: Path) -> str:
    return str(run_dir.resolve())
