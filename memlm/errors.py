"""The one base of memlm's errors that a user can fix or must know of: the command line catches it, and only it,
prints `memlm: error: MESSAGE` as one line (no traceback) and exits with the error's `exit_status`.

Each package raises its own kind (ConfigError in models/config.py, DataError in data_pipeline/format.py,
ResumeError and its kinds in trainer/checkpoint/errors.py, TrackingError in trainer/tracking/errors.py, ClusterError
in cluster/errors.py, PeerFailure in trainer/runtime/peer_watch.py); each also keeps the built-in base it had
(ValueError, RuntimeError), which callers still catch. Imports nothing: every package may build on it
(docs/design.md §1), and `memlm --help` stays free of torch.
"""


class MemlmError(Exception):
    """A problem the message explains in one line, naming the thing at fault and the fix."""

    exit_status = 2  # argparse's own exit status for bad usage: a user's mistake either way
    quiet = False  # True: another process of the same job prints the same line, so this one prints nothing
