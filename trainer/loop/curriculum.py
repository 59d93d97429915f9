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


def parse_docs(text: str) -> dict[str, int]:
    """--docs: N (train N, valid and test N // 10) or TRAIN,VALID,TEST, every split at least one sample."""
    from memlm.data_pipeline.format import SPLITS

    try:
        counts = [int(part) for part in str(text).split(",")]
    except ValueError:
        counts = []
    if len(counts) == 1:
        counts = [counts[0], max(1, counts[0] // 10), max(1, counts[0] // 10)]
    if len(counts) != len(SPLITS) or min(counts) < 1:
        raise ConfigError(f"--docs {text!r}: give N (train N, valid and test N/10) or TRAIN,VALID,TEST, each >= 1")
    return dict(zip(SPLITS, counts))


def check_arguments(task: str, task_options: dict[str, Any], segments: list[int], steps: int, tgt_len: int) -> None:
    """What a stage's data would refuse, refused before anything is prepared or trained, in this command's own
    options (--segments, --background, model.tgt_len; issue 32: the task's own message named --task-length, which
    curriculum does not have, and the refusal came after OUT/data/ was made)."""
    from memlm.data_pipeline.format import SPLITS
    from memlm.data_pipeline.longctx import MIN_LENGTH

    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    shortest = segments[0] * tgt_len
    if shortest < MIN_LENGTH:
        raise ConfigError(
            f"--task {task} needs samples of at least {MIN_LENGTH} tokens (bytes), but the first stage, --segments "
            f"{segments[0]} x model.tgt_len {tgt_len}, is {shortest}: start --segments at "
            f"{-(-MIN_LENGTH // tgt_len)} or more, or give a longer model.tgt_len (model.tgt_len="
            f"{-(-MIN_LENGTH // segments[0])} makes {segments[0]} segment(s) {MIN_LENGTH} bytes)")
    background = task_options.get("background")
    if task == "passkey" and background:
        raise ConfigError("--task passkey hides its key in filler text and takes no --background")
    if task != "passkey":
        if not background:
            raise ConfigError(f"--task {task} needs --background WIKITEXT_DIR: a WikiText folder with "
                              "wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens")
        missing = [f"wiki.{split}.tokens" for split in SPLITS
                   if not (Path(background) / f"wiki.{split}.tokens").is_file()]
        if missing:
            raise ConfigError(f"--background {background}: no {', '.join(missing)} there; give a WikiText folder "
                              "with wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens")


def run_curriculum(config: str, overrides: list[str], *, out: Path, task: str, task_options: dict[str, Any],
                   segments: list[int], steps: int, docs: str, seed: int = 0) -> list[Path]:
    """Prepare and train every stage in turn (single process); returns the stages' run folders.

    Every stage's options and config are checked before the first one starts: a refused command leaves nothing."""
    from memlm.data_pipeline.format import DataError
    from memlm.data_pipeline.prepare import prepare
    from memlm.data_pipeline.shards import load_manifest
    from memlm.data_pipeline.tasks import resolve_options
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.train import run
    from memlm.trainer.runtime import heartbeat

    base = load_config(config, overrides)
    N = base.model.tgt_len
    check_arguments(task, task_options, segments, steps, N)
    stages = []
    for k, (count, data, run_dir) in enumerate(stage_folders(out, task, segments)):
        # The sample's bytes, answer included: `count` segments of N predictions ([boundary] + doc[:-1]).
        try:
            options = resolve_options(task, {**task_options, "length": count * N, "docs": parse_docs(docs),
                                             "seed": seed})
        except DataError as exc:  # what check_arguments cannot foresee, still before anything is made
            raise ConfigError(f"curriculum stage {k} ({count} segment(s) of {N}): {exc}") from None
        stage = [*overrides, f"data.path={data}", f"train.steps={steps}"]
        if k:
            stage.append(f"train.init_from={stages[-1][2]}")
        stages.append((count, data, run_dir, options, load_config(config, stage)))

    runs = []
    for k, (count, data, run_dir, options, cfg) in enumerate(stages):
        previous = runs[-1] if runs else None
        if finished(run_dir, steps):
            print(f"curriculum: stage {k} ({count} segment(s) of {N}) finished earlier: {run_dir}", flush=True)
            runs.append(run_dir)
            continue
        resume = (run_dir / "checkpoints").is_dir()
        print(f"curriculum: stage {k}: {count} segment(s) of {N} tokens per sample, {steps} steps"
              f"{', from ' + str(previous) if previous else ''}{' (resuming)' if resume else ''} -> {run_dir}",
              flush=True)
        heartbeat.said()
        if not (data / "manifest.json").is_file():
            heartbeat.phase(f"preparing stage {k}'s data ({options['docs']['train']:,} {task} samples of "
                            f"{count * N} bytes) in {data}")
            prepare("task", None, data, task=task, task_options=options, workers=1, progress=False)
            heartbeat.phase(None)
        else:
            load_manifest(data)  # a broken corpus is one line here, not a failed stage
        run(cfg, run_dir, resume=resume)
        runs.append(run_dir)
    return runs
