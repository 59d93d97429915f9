"""The one error type of the MLflow tools (compare, ui): a user-facing problem the CLI prints as one line (exit 2)."""

from memlm.errors import MemlmError


class TrackingError(MemlmError, RuntimeError):
    """A missing or unreachable MLflow store, an unknown or empty experiment, a port already in use, ..."""
