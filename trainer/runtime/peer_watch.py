"""Every rank of a multi-process run watches its peers, so that a fault on one rank or node ends the whole job in
bounded time with one line naming the rank and the cause, instead of leaving the others in a collective until
DeepSpeed's timeout (30 minutes by default; a full disk on one rank left the other waiting in the checkpoint barrier).

    watch = PeerWatch.start(rank, world_size, timeout_s=60, last_checkpoint=describe)  # None for one process
    try: ... train ...
    except Exception as exc: raise watch.failed(exc)   # a peer's fault as one line, or this rank's posted
    finally: watch.stop()                               # a clean leave: peers stop watching this rank

How. A daemon thread holds its own client of the rendezvous store (the TCPStore at MASTER_ADDR:MASTER_PORT that
torchrun's agent or the deepspeed launcher's rank 0 serves; its own connection, so it never waits behind the
process group) and once per `interval_s`:
- adds 1 to this rank's heartbeat counter;
- reads the job's fault counter: a rank that fails posts its cause first (`failed`), then waits a moment for the
  others to read it before it exits; a rank that sees a posted fault says so (the lowest surviving rank, one
  line) and ends its process: it may be blocked in a collective that would otherwise wait for the dead peer;
- watches one neighbour's heartbeat (rank + 1, so the work on the store grows with the world size, not its
  square): silent for `timeout_s` (SIGKILLed, its node gone, frozen) means the watcher posts that as the
  neighbour's fault, which ends everyone as above;
- a store that stops answering for `timeout_s` means its host (rank 0's process, or the node of torchrun's
  agent that serves it) is gone: this rank ends with that line.
Counters rather than clocks: the nodes' clocks need not agree. A rank leaving normally posts `done`, so peers
that are still finishing (rank 0 closing its MLflow run) never mistake it for a dead one.

When a peer's death surfaces first in the main thread (gloo raises "Connection closed by peer" at once on one
machine), `failed` waits briefly for the posted cause, or finds whose heartbeat stopped, and returns the same one
line as a PeerFailure. Ending from the thread is os._exit after the registered `on_abort` callbacks (the MLflow
run marked FAILED), bounded by ABORT_CALLBACK_S: the main thread cannot be interrupted inside a C++ collective.
Checkpoints are never touched: one written aside is only published after every rank's barrier, so the last
complete one stays the one `latest` names.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from memlm.errors import MemlmError

INTERVAL_S = 1.0  # heartbeat and check period
ACK_WAIT_S = 5.0  # how long a failing rank waits for its peers to read its cause before it exits
ABORT_CALLBACK_S = 10.0  # the most the on_abort callbacks may take before the process ends regardless
EXIT_PEER_FAILED = 3  # the exit status of a rank ended because another rank failed
CAUSE_CHARS = 400  # a posted cause is cut to this length (one line)


class PeerFailure(MemlmError, RuntimeError):
    """Another rank or node of this job failed; the message names it, the cause and the last checkpoint. `quiet`:
    another rank prints the same line, so the command line prints nothing for this one."""

    exit_status = EXIT_PEER_FAILED

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message for memlm's own errors, else `Type: message`."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if type(exc).__module__.split(".")[0] != "memlm":
        text = f"{type(exc).__name__}: {text}"
    return text[:CAUSE_CHARS]


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective or the store losing a peer (what a dead peer looks like from here)."""
    import torch.distributed as dist

    if isinstance(exc, (dist.DistNetworkError, dist.DistBackendError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                  "Socket Timeout", "Timed out waiting", "gloo"))


class PeerWatch:
    def __init__(self, store, rank: int, world_size: int, timeout_s: float, interval_s: float = INTERVAL_S,
                 last_checkpoint: Callable[[], str] = lambda: "", prefix: str = "memlm/peers"):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.last_checkpoint = last_checkpoint
        self.prefix = prefix
        self.on_abort: list[Callable[[], None]] = []
        self._stopped = threading.Event()
        self._claim = threading.Lock()  # the first of thread and main thread to explain a failure owns the ending
        self._ending = False
        self._thread = threading.Thread(target=self._run, name="memlm-peer-watch", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, rank: int, world_size: int, timeout_s: float, last_checkpoint: Callable[[], str] = lambda: "",
              interval_s: float = INTERVAL_S) -> "PeerWatch | None":
        """A running watch for this rank, or None for a single process (no peers) or timeout_s == 0 (off)."""
        if world_size <= 1 or timeout_s <= 0 or not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
            return None  # no peers, watch off, or a group set up without an env:// store to share
        from torch.distributed import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=max(interval_s * 5, 10.0)))
        # torchrun restarts (max_restarts) share one agent store: each attempt gets its own keys.
        attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        prefix = f"memlm/peers/{attempt}"
        watch = cls(store, rank, world_size, timeout_s, interval_s, last_checkpoint, prefix)
        watch.store.set(watch._key("host", rank), socket.gethostname())
        watch._thread.start()
        return watch

    def stop(self) -> None:
        """This rank leaves normally: say so (peers stop watching it) and end the thread."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self.store.set(self._key("done", self.rank), "1")
            self.store.add(self._key("done_n"), 1)
        except Exception:  # noqa: BLE001 - a gone store at exit changes nothing for this rank
            pass

    # -- keys --------------------------------------------------------------------------------------------------
    def _key(self, kind: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{kind}" + ("" if rank is None else f"/{rank}")

    def _count(self, kind: str, rank: int | None = None) -> int:
        return int(self.store.add(self._key(kind, rank), 0))

    def _has(self, kind: str, rank: int) -> bool:
        return bool(self.store.check([self._key(kind, rank)]))

    # -- the failing side --------------------------------------------------------------------------------------
    def post(self, rank: int, cause: str) -> None:
        """Record that `rank` failed with `cause` (first cause per rank wins) and bump the fault counter."""
        self.store.compare_set(self._key("fault", rank), "", cause)
        self.store.add(self._key("faults"), 1)

    def failed(self, exc: BaseException) -> BaseException:
        """What the main thread should raise after `exc` ended its training: a PeerFailure naming the peer when the
        exception is a dead peer seen through a collective; else `exc` itself, after posting it for the others."""
        if is_collective_failure(exc):
            cause = self._explain_peer_loss()
            if cause is not None:
                return PeerFailure(cause, quiet=getattr(self, "_speaker", self.rank) != self.rank)
            return exc
        self._stopped.set()  # this rank's own fault: the thread must not end the process meanwhile
        try:
            self.post(self.rank, one_line(exc))
            self._wait_for_acks()
        except Exception:  # noqa: BLE001 - the store gone too: the others find out by themselves
            pass
        return exc

    def _wait_for_acks(self) -> None:
        deadline = time.monotonic() + ACK_WAIT_S
        while time.monotonic() < deadline and self._count("acks") < self.world_size - 1 - self._count("done_n"):
            time.sleep(0.1)

    # -- the watching side -------------------------------------------------------------------------------------
    def _run(self) -> None:
        neighbour = (self.rank + 1) % self.world_size
        last_beat, last_change = -1, time.monotonic()
        store_ok = time.monotonic()
        while not self._stopped.wait(self.interval_s):
            try:
                self.store.add(self._key("beat", self.rank), 1)
                if self._count("faults") > 0:
                    self._end(self._describe_faults())
                    return
                beat = self._count("beat", neighbour)
                now = time.monotonic()
                store_ok = now
                if beat != last_beat:
                    last_beat, last_change = beat, now
                elif now - last_change > self.timeout_s and not self._has("done", neighbour):
                    self.post(neighbour, f"no sign of life for {self.timeout_s:g} s (killed, or its node was lost)")
            except Exception as exc:  # noqa: BLE001 - the store's host is gone, or unreachable for a while
                if self._stopped.is_set():
                    return
                if time.monotonic() - store_ok > min(self.timeout_s, 10 * self.interval_s):
                    self._end(self._store_lost(exc), claimed_by_store_loss=True)
                    return

    def _describe_faults(self) -> str:
        failed = {r: self.store.get(self._key("fault", r)).decode() for r in range(self.world_size)
                  if self._has("fault", r)}
        failed = {r: cause for r, cause in failed.items() if cause}
        causes = "; ".join(f"rank {r} ({self._host_of(r)}) failed: {cause}" for r, cause in sorted(failed.items()))
        self._speaker = min((r for r in range(self.world_size) if r not in failed), default=self.rank)
        if "--resume" in causes:  # the cause already says where to resume from (a failed save does)
            return f"{causes}; every rank of this job ends"
        return f"{causes}; every rank of this job ends ({self.last_checkpoint()})"

    def _host_of(self, rank: int) -> str:
        try:
            return self.store.get(self._key("host", rank)).decode() if self._has("host", rank) else "?"
        except Exception:  # noqa: BLE001
            return "?"

    def _store_lost(self, exc: BaseException) -> str:
        self._speaker = self.rank
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (f"rank {self.rank} lost the job's rendezvous store at {where} ({one_line(exc)[:120]}): the process "
                f"or node that serves it (rank 0, or the first node's launcher) is gone; every rank of this job "
                f"ends ({self.last_checkpoint()})")

    def _explain_peer_loss(self, wait_s: float | None = None) -> str | None:
        """After a collective failed in the main thread: the posted cause, or the rank whose heartbeat stopped,
        or the store's loss; None when nothing says a peer is gone (then the error is this rank's own)."""
        deadline = time.monotonic() + (wait_s if wait_s is not None else 3 * self.interval_s + 1.0)
        try:
            before = {r: self._count("beat", r) for r in range(self.world_size)}
            while time.monotonic() < deadline:
                if self._count("faults") > 0:
                    with self._claim:
                        self._ending = True
                    self.store.add(self._key("acks"), 1)
                    return self._describe_faults()
                time.sleep(0.1)
            silent = [r for r in range(self.world_size) if r != self.rank and not self._has("done", r)
                      and self._count("beat", r) == before[r]]
            if not silent:
                return None
            for r in silent:
                self.post(r, "stopped mid-collective (killed, or its node was lost)")
            return self._describe_faults()
        except Exception as exc:  # noqa: BLE001 - the store itself is gone with its host
            return self._store_lost(exc)

    def _end(self, message: str, claimed_by_store_loss: bool = False) -> None:
        """End this process from the watch thread: one line (from one rank), the abort callbacks, os._exit."""
        with self._claim:
            if self._ending or self._stopped.is_set():
                return  # the main thread is explaining (or this rank left normally)
            self._ending = True
        try:
            if not claimed_by_store_loss:
                self.store.add(self._key("acks"), 1)
        except Exception:  # noqa: BLE001
            pass
        if getattr(self, "_speaker", self.rank) == self.rank:
            print(f"memlm: error: {message}", file=sys.stderr, flush=True)
        timer = threading.Timer(ABORT_CALLBACK_S, os._exit, args=(EXIT_PEER_FAILED,))
        timer.daemon = True
        timer.start()
        for callback in self.on_abort:
            try:
                callback()
            except Exception:  # noqa: BLE001 - ending is what matters now
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PEER_FAILED)
