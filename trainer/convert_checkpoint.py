"""`python -m trainer.convert_checkpoint RUN_DIR`: rewrite the rank files of checkpoints written by an older memlm
(pickled memory dataclasses and numpy RNG arrays) as tensors and plain values, so they load weights-only.

Loading an old file needs the full unpickler, which runs whatever code the file holds: run this only on a run folder
you trust (your own). Files already in the new format are left as they are; each file is written aside and renamed,
so an interrupted conversion leaves every file either old or new. DeepSpeed's own files need no conversion
(trainer/checkpoint.py verifies them when they are read).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

from . import checkpoint
from .recurrence import plain_state


def convert_state(state: dict) -> dict:
    """An old rank state as the current format: recurrent state as plain dicts, numpy's RNG as a tensor."""
    out = dict(state)
    if "memory" in out and "recurrence" not in out:  # before the recurrence objects owned the memory
        out["recurrence"] = {"kind": "segment", "memory": out.pop("memory")}
    out["recurrence"] = {k: plain_state(v) for k, v in out["recurrence"].items()}
    rng = dict(out["rng"])
    if not isinstance(rng["numpy"], dict):
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        rng["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    out["rng"] = rng
    return out


def convert_run(run_dir: Path) -> list[Path]:
    """Convert every old rank file under RUN_DIR/checkpoints; returns the files rewritten."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        raise checkpoint.ResumeError(f"{ckpt_dir} does not exist: name a run folder written by `memlm train`")
    done = []
    for path in sorted(ckpt_dir.glob("global_step*/rank*.pt")):
        try:
            checkpoint.safe_load(path)
            continue  # already weights-only loadable
        except checkpoint.UnsafeCheckpointError:
            pass
        state = torch.load(path, map_location="cpu", weights_only=False)  # trusted by the user who ran this
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save(convert_state(state), tmp)
        os.replace(tmp, path)
        checkpoint.safe_load(path)  # the result must now load weights-only
        done.append(path)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.convert_checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR")
    args = parser.parse_args(argv)
    try:
        done = convert_run(Path(args.run_dir))
    except checkpoint.ResumeError as exc:
        print(f"memlm: error: {exc}", file=sys.stderr)
        return 2
    for path in done:
        print(f"converted {path}")
    print(f"{len(done)} file(s) converted; the run folder now loads weights-only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
