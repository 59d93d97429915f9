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
    def __init__(self, run_dir: Path, file):
        self.run_dir, self.file = run_dir, file

    def release(self) -> None:
        """Empty the file (so nobody takes this for a dead run's lock) and unlock it."""
        if self.file is None:
            return
        try:
            self.file.seek(0)
            self.file.truncate()
        except OSError:  # a full disk cannot stop the unlock
            pass
        self.file.close()  # closing the descriptor releases the flock
        self.file = None
        _held.pop(_key(self.run_dir), None)


def acquire(run_dir: Path, who: str = "memlm train") -> RunLock:
    """Hold RUN_DIR's lock for this process (creating the folder); RunFolderBusy if another process holds it.
    A lock this process already holds is returned as it is."""
    run_dir = Path(run_dir)
    held = _held.get(_key(run_dir))
    if held is not None and held.file is not None:
        return held
    run_dir.mkdir(parents=True, exist_ok=True)
    file = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _read(file) or "another process"
        file.close()
        raise RunFolderBusy(f"{run_dir} is being trained into by {holder}: wait for that run to end or stop it, or "
                            "pass --out NEW_DIR to start a separate run") from None
    left = _read(file)
    if left:
        print(f"memlm train: {run_dir / LOCK_FILE} named {left}, which ended without releasing it (killed?); "
              "this run takes the folder over", file=sys.stderr, flush=True)
    file.seek(0)
    file.truncate()
    file.write(f"{who} pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    file.flush()
    lock = RunLock(run_dir, file)
    _held[_key(run_dir)] = lock
    return lock


def release(run_dir: Path) -> None:
    """Release this process's lock on RUN_DIR, if it holds one."""
    held = _held.get(_key(Path(run_dir)))
    if held is not None:
        held.release()


def _read(file) -> str:
    file.seek(0)
    return file.read().strip()


def _key(run_dir: Path) -> str:
    return str(run_dir.resolve())
