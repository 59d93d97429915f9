"""`memlm curriculum CONFIG --task qa1 --segments 1,2,4,8`: training with a curriculum over sample lengths, the
BABILong / ARMT recipe (Kuratov et al., 2024; Rodkin et al., 2024): stage k trains on samples of segments[k]
segments (segments[k] x model.tgt_len tokens) and starts from the weights stage k - 1 ended with
(`train.init_from`; optimizer, schedule and data start fresh, as each of the papers' stages starts from the last
checkpoint).

Folders under --out: data/<task>-<S>seg (the stage's corpus, prepared once) and stage<k>-<S>seg (a run folder like
any other: `memlm eval`, `memlm longeval`, `memlm compare` read it). Rerunning the command skips finished stages
and resumes an interrupted one, so a crash costs at most the steps since its last checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memlm.models.config import ConfigError


def parse_segments(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--segments {text!r}: give increasing segment counts such as 1,2,4,8") from None
    if not counts or counts[0] < 1 or any(b <= a for a, b in zip(counts, counts[1:])):
        raise ConfigError(f"--segments {text!r}: give increasing segment counts >= 1 such as 1,2,4,8")
    return counts


def stage_folders(out: Path, task: str, segments: list[int]) -> list[tuple[int, Path, Path]]:
    """(segments, data folder, run folder) per stage."""
    return [(s, out / "data" / f"{task}-{s}seg", out / f"stage{k}-{s}seg") for k, s in enumerate(segments)]


def finished(run_dir: Path, steps: int) -> bool:
    from memlm.trainer.checkpoint.store import read_latest, step_of

    tag = read_latest(run_dir / "checkpoints")
    return tag is not None and step_of(tag) == steps


def run_curriculum(config: str, overrides: list[str], *, out: Path, task: str, task_options: dict[str, Any],
                   segments: list[int], steps: int, docs: str, seed: int = 0) -> list[Path]:
    """Prepare and train every stage in turn (single process); returns the stages' run folders."""
    from memlm.data_pipeline.prepare import prepare
    from memlm.data_pipeline.shards import load_manifest
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.train import run

    base = load_config(config, overrides)
    N = base.model.tgt_len
    runs, previous = [], None
    for k, (count, data, run_dir) in enumerate(stage_folders(out, task, segments)):
        # The sample's bytes, answer included: `count` segments of N predictions ([boundary] + doc[:-1]).
        options = {**task_options, "length": count * N, "docs": docs, "seed": seed}
        if not (data / "manifest.json").is_file():
            prepare("task", None, data, task=task, task_options=options, workers=1, progress=False)
        else:
            load_manifest(data)  # a broken corpus is one line here, not a failed stage
        stage = [*overrides, f"data.path={data}", f"train.steps={steps}"]
        if previous is not None:
            stage.append(f"train.init_from={previous}")
        cfg = load_config(config, stage)
        if finished(run_dir, steps):
            print(f"curriculum: stage {k} ({count} segment(s) of {N}) finished earlier: {run_dir}", flush=True)
        else:
            resume = (run_dir / "checkpoints").is_dir()
            print(f"curriculum: stage {k}: {count} segment(s) of {N} tokens per sample, {steps} steps"
                  f"{', from ' + str(previous) if previous else ''}{' (resuming)' if resume else ''} -> {run_dir}",
                  flush=True)
            run(cfg, run_dir, resume=resume)
        runs.append(run_dir)
        previous = run_dir
    return runs
