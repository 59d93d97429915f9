"""How a user types `memlm` from where they are: for hints a command prints (the demo's closing lines).

    memlm_command()    # "memlm" when the PATH finds this installation (an activated .venv), else ".venv/bin/memlm"
                       # (relative to the working folder when inside it, else absolute)

`bash scripts/demo.sh` runs memlm from ./.venv without activating it, so the shell the user types the hint into
usually has no `memlm` on its PATH: a bare "memlm ui" would answer "command not found".
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def memlm_command() -> str:
    script = Path(sys.executable).with_name("memlm")  # the console script beside this environment's python
    found = shutil.which("memlm")
    if found and script.exists() and Path(found).resolve() == script.resolve():
        return "memlm"
    if not script.exists():  # run as `python -m memlm` from a checkout without the console script
        return f"{sys.executable} -m memlm"
    cwd = Path.cwd()
    if str(script).startswith(str(cwd) + os.sep):
        return os.path.relpath(script, cwd)
    return str(script)


def activation_hint() -> str:
    """"" when `memlm` already works as typed; else the one line that makes it work for the rest of the shell."""
    command = memlm_command()
    if command == "memlm":
        return ""
    activate = Path(command).parent / "activate"
    return f"(`source {activate}` once per shell and plain `memlm ...` works, as in the README)"
