"""A full disk, wherever a run meets it (its first log line, a metrics row, a checkpoint), is one line naming what
could not be written and the last good checkpoint; nothing written before is touched.

How a full disk shows up: Python's own writes raise OSError with errno ENOSPC (EDQUOT over a quota, EFBIG over a
file size limit), often without a file name (a buffered write that fails at flush: a print into library.log, a
metrics row). torch.save, which writes checkpoints (DeepSpeed's files and the rank files), raises a RuntimeError
that never names the cause: `[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534` or
`basic_ios::clear: iostream error` (issue 32: a 51-line traceback). Such a RuntimeError counts as a full disk only
when the filesystem it wrote to has (almost) no space left, measured right after the failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from .errors import CheckpointWriteError
from .latest import CHECKPOINTS, latest_tag

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
NEARLY_FULL_BYTES = 1 << 20  # free space under which a failed torch.save is put down to a full disk


class DiskFullError(CheckpointWriteError):
    """A file of the run could not be written for lack of space; the message names it and the last checkpoint."""


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on PATH's filesystem (the nearest existing folder's)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def reason(exc: BaseException, where: Path) -> str | None:
    """How to say that `exc`, raised while writing under WHERE, is a full disk; None when it is not one."""
    if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
        return exc.strerror or os.strerror(exc.errno)
    if isinstance(exc, RuntimeError) and not isinstance(exc, NotImplementedError):
        free = free_bytes(where)
        if free is not None and free < NEARLY_FULL_BYTES:
            return f"{os.strerror(errno.ENOSPC)}: {free // 1024} KiB free"
    return None


def last_checkpoint_words(run_dir: Path) -> str:
    """What the last good checkpoint is and how to go on, for the end of a full-disk line."""
    ckpt_dir = Path(run_dir) / CHECKPOINTS
    tag = latest_tag(ckpt_dir)
    if tag:
        return (f"the last good checkpoint {ckpt_dir / tag} is intact and `latest` names it: free space, then rerun "
                "with --resume")
    return "no checkpoint was written yet: free space, then run the command again"


@contextlib.contextmanager
def full_disk_is_one_line(run_dir: Path):
    """Turn a full disk met anywhere inside the block into a DiskFullError naming the file (or the run folder).
    A checkpoint's own write failure is a CheckpointWriteError already (store.save), and passes as it is."""
    try:
        yield
    except OSError as exc:  # not RuntimeError: outside a checkpoint write it is a bug, whatever the free space
        why = reason(exc, Path(run_dir))
        if why is None:
            raise
        path = getattr(exc, "filename", None) or run_dir
        raise DiskFullError(f"cannot write {path} ({why}); {last_checkpoint_words(Path(run_dir))}") from None
