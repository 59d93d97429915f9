"""A census of the operations that make the host wait for the device: what a training step would stall a GPU on.

On a GPU the host runs ahead of the device, queueing kernels; an operation that needs a device value on the host
(`.item()`, `float(t)`, `int(t)`, `bool(t)`, `.tolist()`), one whose output size depends on device data
(`nonzero`, boolean-mask indexing, `masked_select`, `unique`), and a copy between host and device from or to
pageable memory all wait until every kernel queued before them has run, and the device idles while the host
catches up. On a CPU machine none of that stalls anything, but the same calls run through the same dispatcher, so
recording them there finds the sites a GPU run would stall at, in any test.

`SyncCensus` is both a TorchDispatchMode (aten operations: the scalar reads, the data-dependent shapes, copies whose
source and destination devices differ, with their non_blocking flag and whether the host side is pinned) and a
TorchFunctionMode (`Tensor.tolist`, whose read of a CPU tensor never reaches the dispatcher). Each event keeps the
Python frames outside torch that led to it, innermost first, so a test can tell the trainer's syncs from the
model's or DeepSpeed's by the file that issued them.

Host data is read with `.numpy()` (or numpy itself): that refuses a device tensor, so it can never be a sync, and
the census does not count it. Reading host data with `.item()`, `int()` or `.tolist()` is counted: on a CPU run
the census cannot tell a host tensor from a device one.
"""

from __future__ import annotations

import sys
import sysconfig
import traceback
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
TORCH_DIR = str(Path(torch.__file__).resolve().parent)
STDLIB_DIR = str(Path(sysconfig.get_paths()["stdlib"]).resolve())  # contextlib, functools: wrappers, not askers
HERE = str(Path(__file__).resolve())

# Reads of a device value on the host (every Python scalar conversion of a tensor ends in _local_scalar_dense).
READS = {aten._local_scalar_dense.default: "read", aten.is_nonzero.default: "read", aten.equal.default: "read"}
# Outputs whose size depends on the data: the host must learn it before it can allocate them.
DATA_SHAPED = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
               aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
# Indexing with a boolean mask runs nonzero inside the kernel, below the dispatcher: the index call is the site.
MASK_INDEXED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
COPIES = {aten._to_copy.default, aten.copy_.default}


@dataclass
class SyncEvent:
    op: str  # "read", "tolist", "nonzero", "masked index", "copy cpu->cuda", ...
    device: str  # the device of the tensor read (for a copy: the source's)
    frames: tuple[str, ...]  # "path:line function" outside torch, innermost first
    non_blocking: bool | None = None  # copies only
    pinned: bool | None = None  # copies only: the host side is page-locked

    @property
    def origin(self) -> str:
        """The innermost frame outside torch: the code that asked for this operation."""
        return self.frames[0] if self.frames else "<no Python frame>"

    def issued_under(self, folder: str | Path) -> bool:
        """The operation was asked for by a file under `folder` (its origin is there)."""
        return bool(self.frames) and self.frames[0].startswith(str(Path(folder).resolve()) + "/")

    def __str__(self) -> str:
        extra = "" if self.non_blocking is None else f" non_blocking={self.non_blocking} pinned={self.pinned}"
        return f"{self.op} [{self.device}]{extra} at {self.origin}"


@lru_cache(maxsize=None)
def _asker(filename: str) -> str | None:
    """The resolved path of a frame's file if code there can be said to ask for an operation, else None: torch's
    own frames, the standard library's wrappers (contextlib, functools) and this census are passed through."""
    if filename.startswith("<"):  # <frozen ...>, <string>: no file to blame
        return None
    path = str(Path(filename).resolve())
    stdlib = path.startswith(STDLIB_DIR + "/") and "-packages/" not in path
    return None if path.startswith(TORCH_DIR + "/") or stdlib or path == HERE else path


def _frames() -> tuple[str, ...]:
    out = []
    for frame, line in traceback.walk_stack(sys._getframe(1)):
        path = _asker(frame.f_code.co_filename)
        if path is not None:
            out.append(f"{path}:{line} {frame.f_code.co_name}")
    return tuple(out)


def _device_of(value) -> torch.device | None:
    return value.device if isinstance(value, torch.Tensor) else None


def _pinned(tensor: torch.Tensor) -> bool:
    try:
        return tensor.is_pinned()
    except RuntimeError:  # a torch without an accelerator cannot say; nothing is pinned then
        return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, census: "SyncCensus"):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.census.inside:
            self._look(func, args, kwargs)
        return func(*args, **kwargs)

    def _look(self, func, args, kwargs) -> None:
        record = self.census.record
        if func in READS:
            record(READS[func], args[0])
        elif func in DATA_SHAPED:
            record(func.__name__.split(".")[0], args[0])
        elif func in MASK_INDEXED:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                record("masked index", args[0])
        elif func is aten._to_copy.default:
            source, target = args[0].device, kwargs.get("device")
            if target is not None and torch.device(target) != source:
                self._copy(args[0], source, torch.device(target), bool(kwargs.get("non_blocking", False)))
        elif func is aten.copy_.default:
            target, source = args[0], args[1]
            if isinstance(source, torch.Tensor) and source.device != target.device:
                non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
                self._copy(source if source.device.type == "cpu" else target, source.device, target.device,
                           non_blocking)

    def _copy(self, host_side: torch.Tensor, source: torch.device, target: torch.device, non_blocking: bool) -> None:
        pinned = _pinned(host_side) if host_side.device.type == "cpu" else None
        self.census.events.append(SyncEvent(f"copy {source.type}->{target.type}", str(source), _frames(),
                                            non_blocking=non_blocking, pinned=pinned))


class _Function(TorchFunctionMode):
    """Tensor.tolist: a CPU tensor's is read without any aten call, a CUDA tensor's through a copy (recorded once,
    here: the dispatch side stays quiet while it runs)."""

    def __init__(self, census: "SyncCensus"):
        super().__init__()
        self.census = census

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.tolist or self.census.inside:
            return func(*args, **kwargs)
        self.census.record("tolist", args[0])
        self.census.inside = True
        try:
            return func(*args, **kwargs)
        finally:
            self.census.inside = False


@dataclass
class SyncCensus:
    """`with SyncCensus() as census: ...` records every sync-prone operation run inside, in order (census.events)."""

    events: list[SyncEvent] = field(default_factory=list)
    inside: bool = False  # within a recorded Tensor.tolist: its own aten calls are part of it

    def record(self, op: str, tensor) -> None:
        self.events.append(SyncEvent(op, str(_device_of(tensor)), _frames()))

    def __enter__(self) -> "SyncCensus":
        self._modes = (_Function(self), _Dispatch(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def issued_under(self, folder: str | Path) -> list[SyncEvent]:
        return [e for e in self.events if e.issued_under(folder)]

    def report(self) -> str:
        """One line per distinct event, with how often it happened, in order of first appearance."""
        counts = Counter(str(e) for e in self.events)
        return "\n".join(f"{n} x {line}" for line, n in counts.items()) or "(none)"
