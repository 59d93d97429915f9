"""`python -m memlm.trainer.checkpoint.convert RUN_DIR`: rewrite the rank files of checkpoints written by an older memlm
(pickled memory dataclasses and numpy RNG arrays) as tensors and plain values, so they load weights-only.

Loading an old file needs the full unpickler, which runs whatever code the file holds: run this only on a run folder
you trust (your own). Files already in the new format are left as they are; each file is written aside and renamed,
so an interrupted conversion leaves every file either old or new. DeepSpeed's own files need no conversion
(trainer/checkpoint/store.py verifies them when they are read).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import torch

from .errors import ResumeError, UnsafeCheckpointError
from .recurrent_state import plain_state
from .safe_load import safe_load

# Older memlm installed its folders as top-level packages, so its files name classes as `models.txl.TXLMemory` or
# `trainer.recurrence.Segment`; they now live under memlm.* (memlm/__init__.py), some in other modules.
LEGACY_MODULES = {"trainer.recurrence": "memlm.trainer.loop.recurrence"}
LEGACY_PACKAGES = ("models", "trainer", "data_pipeline", "cluster")


class _RenamingUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.split(".")[0] in LEGACY_PACKAGES:
            module = LEGACY_MODULES.get(module, f"memlm.{module}")
        return super().find_class(module, name)


# What torch.load needs of a pickle module: an Unpickler (zip checkpoints) and load (the legacy format).
_legacy_pickle = types.ModuleType("memlm_legacy_pickle")
_legacy_pickle.Unpickler = _RenamingUnpickler
_legacy_pickle.load = lambda file, **kw: _RenamingUnpickler(file, **kw).load()


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
        raise ResumeError(f"{ckpt_dir} does not exist: name a run folder written by `memlm train`")
    done = []
    for path in sorted(ckpt_dir.glob("global_step*/rank*.pt")):
        try:
            safe_load(path)
            continue  # already weights-only loadable
        except UnsafeCheckpointError:
            pass
        # Trusted by the user who ran this: the full unpickler, with the old module names mapped to the new ones.
        state = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_legacy_pickle)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save(convert_state(state), tmp)
        os.replace(tmp, path)
        safe_load(path)  # the result must now load weights-only
        done.append(path)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.trainer.checkpoint.convert",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR")
    args = parser.parse_args(argv)
    try:
        done = convert_run(Path(args.run_dir))
    except ResumeError as exc:
        print(f"memlm: error: {exc}", file=sys.stderr)
        return 2
    for path in done:
        print(f"converted {path}")
    print(f"{len(done)} file(s) converted; the run folder now loads weights-only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
