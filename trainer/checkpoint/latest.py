"""Which checkpoint of a run folder is the latest: the `latest` file and the meta.json a complete checkpoint ends with.

Torch-free and below store.py, so disk_full.py (which store.py uses) can name the last good checkpoint in its line.
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = "checkpoints"  # in the run folder
LATEST = "latest"
META = "meta.json"


def read_latest(ckpt_dir: Path) -> str | None:
    """The tag the `latest` file names (None without the file); the one place that reads it."""
    path = Path(ckpt_dir) / LATEST
    return path.read_text().strip() if path.is_file() else None


def latest_tag(ckpt_dir: Path) -> str | None:
    """The newest complete checkpoint: the tag `latest` names, if its folder is complete (meta.json is written
    last); None otherwise."""
    tag = read_latest(ckpt_dir)
    return tag if tag and (Path(ckpt_dir) / tag / META).is_file() else None
