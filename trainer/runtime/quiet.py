"""Library noise goes to a log file in the run folder; the console gets memlm's own one-line messages.

    with into_library_log(run_dir):          # fd-level: prints and subprocess output of a library call
        deepspeed.init_distributed(...)      # ("DeepSpeed ... built successfully" from every rank, ninja builds)
    route_library_loggers(run_dir)           # mlflow / alembic / DeepSpeed / Ray loggers: INFO to the file,
                                             # only WARNING and above still reach the console
    import_deepspeed(run_dir)                # what DeepSpeed prints while it is imported, into the file

What counts as noise: lines a library prints on every start whatever happened (DeepSpeed's op "built successfully"
even when it was loaded from the cache, its "Setting accelerator to CPU" at import on a machine without a GPU,
MLflow's "Creating initial MLflow database tables", its alembic migrations, its "View run ... at: URL" when a run
ends on a tracking server). They stay in RUN_DIR/library.log (appended by every rank and every resume), so nothing
is lost when something goes wrong; warnings and errors still reach the console.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
from pathlib import Path

from .lean_import import import_deepspeed as lean_import

LIBRARY_LOG = "library.log"  # in the run folder
# Loggers of the libraries memlm drives (names as the libraries create them).
LIBRARY_LOGGERS = ("mlflow", "alembic", "DeepSpeed")

_file_handlers: dict[str, logging.Handler] = {}


def library_log(run_dir: str | os.PathLike) -> Path:
    path = Path(run_dir) / LIBRARY_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def into_library_log(run_dir: str | os.PathLike):
    """Send this process's stdout and stderr (file descriptors 1 and 2, so child processes' output too) to
    RUN_DIR/library.log for the duration of the block. An exception still propagates (and is printed after the
    block, on the real console); the lines written before it are in the log."""
    path = library_log(run_dir)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                yield path
            except OSError as exc:
                # A print that failed here wrote into this log (a full disk): name it, as the writer could not.
                if exc.filename is None and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    exc.filename = str(path)
                raise
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except (OSError, ValueError):
                        pass
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


@contextlib.contextmanager
def prints_into_library_log(run_dir: str | os.PathLike):
    """Python-level `sys.stdout` into RUN_DIR/library.log for the block: for a library call that prints with
    sys.stdout.write (MLflow's "View run ... at: URL"), whatever sys.stdout is at the moment (a test's capture,
    a notebook's stream). Not for an import: a logger created inside would keep the swapped-in stream."""
    with open(library_log(run_dir), "a", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        yield


class _LibraryLogHandler(logging.FileHandler):
    """library.log's handler: a record it cannot write (a full disk) is dropped without logging's own traceback on
    the console; memlm's own next write into the run folder meets the same disk and says so in one line."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return
        super().handleError(record)


def route_library_loggers(run_dir: str | os.PathLike, names: tuple[str, ...] = LIBRARY_LOGGERS) -> Path:
    """INFO and above of each library logger into RUN_DIR/library.log; its console handlers keep WARNING and
    above. Call it after the library is imported (MLflow replaces its loggers' handlers at import). Idempotent."""
    path = library_log(run_dir)
    key = str(path.resolve())
    handler = _file_handlers.get(key)
    if handler is None:
        # One run's file at a time: a process that trains several runs one after another (tests, a Ray worker
        # reused for trials) moves on to the next file and closes the last.
        for old in _file_handlers.values():
            for logger in map(logging.getLogger, LIBRARY_LOGGERS):
                if old in logger.handlers:
                    logger.removeHandler(old)
            old.close()
        _file_handlers.clear()
        handler = _LibraryLogHandler(path, encoding="utf-8")
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        _file_handlers[key] = handler
    for name in names:
        logger = logging.getLogger(name)
        for existing in logger.handlers:
            if isinstance(existing, logging.StreamHandler) and not isinstance(existing, logging.FileHandler):
                existing.setLevel(max(existing.level, logging.WARNING))
        if handler not in logger.handlers:
            logger.addHandler(handler)
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
    return path


def import_deepspeed(run_dir: str | os.PathLike) -> None:
    """Import DeepSpeed with what it prints meanwhile going to RUN_DIR/library.log: on a machine without a GPU its
    accelerator detection warns "Setting accelerator to CPU" on every import (eval, generate and analyze import it
    to read checkpoints; training imports it after choosing the accelerator itself). A run folder this process may
    not write to (someone else's runs) keeps the plain import."""
    if "deepspeed" in sys.modules:
        return
    if not os.access(run_dir, os.W_OK):
        lean_import()
        return
    with into_library_log(run_dir):
        lean_import()
