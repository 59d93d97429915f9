"""The one error type of the MLflow tools (compare, ui): a user-facing problem the CLI prints as one line (exit 2)."""


class TrackingError(RuntimeError):
    """A missing or unreachable MLflow store, an unknown or empty experiment, a port already in use, ..."""
