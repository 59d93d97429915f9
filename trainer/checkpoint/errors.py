"""The errors of reading and writing checkpoints: each message names the file and what to do; the CLI prints it
as one line (exit 2)."""

from memlm.errors import MemlmError


class ResumeError(MemlmError, ValueError):
    """A checkpoint that cannot continue this run (world size, arch, tokenizer changed); the message says how."""


class CheckpointWriteError(ResumeError):
    """A checkpoint that could not be written (a full disk); the previous one is intact and `latest` names it."""


class UnsafeCheckpointError(ResumeError):
    """A checkpoint file that a weights-only load refuses (it would import code) or cannot read; nothing ran."""
