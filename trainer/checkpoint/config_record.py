"""The run folder's record of its configuration: `config.yaml` says what trains now, `ds_config.json` the DeepSpeed
JSON derived from it, and `config_changes.jsonl` what a resume changed and from which step (resume_policy.py).

config_changes.jsonl holds one object per resume that changed something, in the order they happened:
    {"step": 10, "checkpoint": "global_step10", "time": "2026-11-27 03:10:00", "changed": {"train.lr": [0.001, 0.0005]}}
so config.yaml and the history together say what trained at every step. A resume that goes back to an earlier
checkpoint keeps the later entries: they happened. Both config files are written aside and renamed: a full disk
leaves the previous ones whole rather than an empty config.yaml.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from memlm.trainer.config.run_config import config_to_yaml

from .resume_policy import Change

CONFIG = "config.yaml"
DS_CONFIG = "ds_config.json"
HISTORY = "config_changes.jsonl"


def write_run_config(run_dir: Path, cfg, ds_conf: dict, found: list[Change], step: int, tag: str | None) -> None:
    """config.yaml and ds_config.json for this start, and (when it changed anything) one history entry."""
    run_dir = Path(run_dir)
    if found:
        entry = {"step": step, "checkpoint": tag, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "changed": {c.key: [c.was, c.now] for c in found}}
        if _last_entry(run_dir / HISTORY, drop=("time",)) != {k: v for k, v in entry.items() if k != "time"}:
            with (run_dir / HISTORY).open("a", encoding="utf-8") as f:  # a resume that failed and is rerun: once
                f.write(json.dumps(entry) + "\n")
    _write_aside(run_dir / CONFIG, config_to_yaml(cfg))
    _write_aside(run_dir / DS_CONFIG, json.dumps(ds_conf, indent=2) + "\n")


def history(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / HISTORY
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _last_entry(path: Path, drop: tuple[str, ...]) -> dict | None:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        last = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    return {k: v for k, v in last.items() if k not in drop} if isinstance(last, dict) else None


def _write_aside(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
