"""The one error type of the cluster commands: a user-facing problem that the CLI prints as one line (exit 2)."""

from memlm.errors import MemlmError


class ClusterError(MemlmError, RuntimeError):
    """A bad sweep file, an unreachable Ray cluster or MLflow store, a run folder without a checkpoint, ..."""
