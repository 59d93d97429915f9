"""The one error type of the cluster commands: a user-facing problem that the CLI prints as one line (exit 2)."""


class ClusterError(RuntimeError):
    """A bad sweep file, an unreachable Ray cluster or MLflow store, a run folder without a checkpoint, ..."""
