"""`memlm CMD ...` in a subprocess with the start watch's quiet time cut short (memlm/start_watch.py).

The watch prints `memlm CMD: still PHASE (N s)` after QUIET_S (8 s) of silence: a test cannot wait for a machine
slow enough to need it, so the child runs with QUIET_S = `quiet_s` (set before the `memlm` command starts its
watch) and everything else as a user runs it.
"""

from __future__ import annotations

import subprocess
import sys

from .training import REPO, child_env

SCRIPT = ("import sys\n"
          "from memlm.trainer.runtime import heartbeat\n"
          "heartbeat.QUIET_S = float(sys.argv[1])\n"
          "from memlm.cli import main\n"
          "sys.exit(main(sys.argv[2:]))\n")


def start(argv: list[str], quiet_s: float = 0.05, cwd=REPO) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(quiet_s), *argv], cwd=cwd, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def still_lines(stderr: str, command: str) -> list[str]:
    """The watch's lines in `stderr`, in order."""
    return [line for line in stderr.splitlines() if line.startswith(f"memlm {command}: still ")]
