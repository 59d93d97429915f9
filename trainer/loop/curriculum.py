"""`memlm curriculum CONFIG --task passkey --segments 1,2,4,8`: a long-context task learned first where every model
can learn it, then at growing distances where only a memory can help (the BABILong / ARMT recipe: Kuratov et al.,
2024; Rodkin et al., 2024).

Stage k trains on samples of exactly segments[k] x model.tgt_len bytes and starts from the weights stage k - 1 ended
with (`train.init_from`; optimizer, schedule and data start fresh, as each of the papers' stages starts from the
last checkpoint). Stage 0 of the default 1,2,4,8 holds the facts and the question in one segment, so every model,
the no-memory one included, can learn the task there; from 2 segments on the story starts in the first segment and
the question ends the last (trainer/loop/curriculum_samples.py), and the stage's data is read back from its shards
to say so: the achieved lengths and how many segments lie between fact and answer, on the console and in the stage's
record.

Each optimizer step takes data.batch_size whole samples at every stage: archs that read one segment per micro-batch
accumulate over the sample's S segments (train.grad_accum=S); RMT and ARMT read the sample as one chunk and
backpropagate through all its S segments (model.bptt_mode=chunk, bptt_depth=S - 1), as their authors train. The
rate is constant after warmup (train.schedule=constant): a stage ends on its own criterion, not where a decaying
rate would have stopped learning (the no-memory model's one-segment passkey jumps from 0 to 100% late, and a
schedule decaying over 1,500 steps stalled it at 2%). Overrides the user gives (train.grad_accum, model.bptt_*,
train.schedule, ...) win over these.

A stage ends when its held-out answers are learned, on a plateau, or at the cap (trainer/loop/curriculum_stop.py);
the reason and the step are printed and kept in RUN_DIR/curriculum_stage.json, the checks in
RUN_DIR/curriculum_checks.jsonl, and every stage's record in OUT/curriculum.json.

On a pretrained backbone whose model.backbone folder has its own tokenizer.json, the stages' samples are made in its
tokens (`memlm prepare --tokenizer-from FOLDER`, data_pipeline/longctx_tokens.py): "bytes" above reads "tokens",
model.vocab_size is the tokenizer's unless given (backbone_tokens), and a first stage too short for the story is
refused from its first sample (the byte floor says nothing of tokens). Any other model keeps bytes.

Folders under --out: data/<task>-<S>seg (the stage's corpus, prepared once) and stage<k>-<S>seg (a run folder like
any other: `memlm eval`, `memlm longeval`, `memlm compare` read it). Rerunning the command skips finished stages
and resumes an interrupted one, so a crash costs at most the steps since its last check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memlm.data_pipeline import longctx
from memlm.data_pipeline.format import SPLITS, DataError
from memlm.data_pipeline.longctx_tokens import token_samples
from memlm.data_pipeline.prepare import prepare
from memlm.data_pipeline.shards import load_manifest
from memlm.data_pipeline.tasks import resolve_options
from memlm.data_pipeline.tokenizers import load_tokenizer
from memlm.models.config import ConfigError, ModelConfig
from memlm.models.pretrained.shape import tokenizer_vocab
from memlm.models.registry import arch_spec
from memlm.trainer.checkpoint.store import read_latest, step_of
from memlm.trainer.config import data_vocab, presets, schema
from memlm.trainer.config.run_config import apply_overrides, load_config
from memlm.trainer.runtime import heartbeat

from .curriculum_samples import describe, read_split, sample_tokenizer, stage_options, summary_line
from .curriculum_stop import StageCheck, StopRule, stage_record
from .preemption import Preempted
from .train import run

STAGE_FILE = "curriculum_stage.json"  # in a stage's run folder: how it ended
SUMMARY_FILE = "curriculum.json"  # in --out: every stage's record


def parse_segments(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--segments {text!r}: give increasing segment counts such as 1,2,4,8") from None
    if not counts or counts[0] < 1 or any(b <= a for a, b in zip(counts, counts[1:])):
        raise ConfigError(f"--segments {text!r}: give increasing segment counts >= 1 such as 1,2,4,8")
    return counts


def per_stage(flag: str, text: str, stages: int) -> list[int]:
    """--steps, --min-steps: one value for every stage, or one per stage."""
    try:
        values = [int(part) for part in str(text).split(",")]
    except ValueError:
        values = []
    if len(values) == 1:
        values = values * stages
    if len(values) != stages:
        raise ConfigError(f"{flag} {text!r}: give one number for every stage or one per stage ({stages} for "
                          "--segments)")
    return values


def stage_folders(out: Path, task: str, segments: list[int]) -> list[tuple[int, Path, Path]]:
    """(segments, data folder, run folder) per stage."""
    return [(s, out / "data" / f"{task}-{s}seg", out / f"stage{k}-{s}seg") for k, s in enumerate(segments)]


def parse_docs(text: str) -> dict[str, int]:
    """--docs: N (train N, valid and test N // 10) or TRAIN,VALID,TEST, every split at least one sample."""
    try:
        counts = [int(part) for part in str(text).split(",")]
    except ValueError:
        counts = []
    if len(counts) == 1:
        counts = [counts[0], max(1, counts[0] // 10), max(1, counts[0] // 10)]
    if len(counts) != len(SPLITS) or min(counts) < 1:
        raise ConfigError(f"--docs {text!r}: give N (train N, valid and test N/10) or TRAIN,VALID,TEST, each >= 1")
    return dict(zip(SPLITS, counts))


def backbone_tokens(config: str, overrides: list[str]) -> tuple[list[str], str | None, str | None]:
    """(overrides, the tokenizer folder, a note) for a curriculum whose model.backbone folder has its own
    tokenizer.json: the stages' data is prepared with it (`memlm prepare --tokenizer-from FOLDER`), every length
    counted in its tokens, and model.vocab_size is its vocabulary unless the user gave one (as `memlm train` takes
    the data's: trainer/config/data_vocab.py; a preset's 256 for bytes would be refused by the folder's check).
    (overrides, None, None) otherwise: bytes, as always."""
    tree = apply_overrides(schema.load_tree(presets.find(config), find_parent=presets.find), overrides)
    folder = str((tree.get("model") or {}).get("backbone") or "")
    vocab = tokenizer_vocab(folder) if folder else 0  # 0: no tokenizer.json, or not Hugging Face's
    if not vocab:
        return overrides, None, None
    written = (tree.get("model") or {}).get("vocab_size", ModelConfig().vocab_size)
    if vocab == written or data_vocab.given(config, overrides):
        return overrides, folder, None
    note = (f"model.vocab_size {vocab:,} from {folder}'s tokenizer.json ({presets.name_of(presets.find(config))} "
            f"says {written:,})")
    return [*overrides, f"model.vocab_size={vocab}"], folder, note


def check_arguments(task: str, task_options: dict[str, Any], segments: list[int], tgt_len: int,
                    in_tokens: bool = False) -> None:
    """What a stage's data would refuse, refused before anything is prepared or trained, in this command's own
    options (--segments, --background, --task-option, model.tgt_len; issue 32: the task's own message named
    --task-length, which curriculum does not have, and the refusal came after OUT/data/ was made)."""
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
    try:  # every option checked at a length any story fits; then the floor these options set
        resolved = resolve_options(task, {**task_options, "length": 1 << 30})
    except DataError as exc:
        raise ConfigError(f"curriculum: {exc}") from None
    if in_tokens:  # the floor is in bytes: a backbone's tokens are checked on stage 0's first sample (first_sample)
        return
    shortest = longctx.min_length(task, resolved)
    first = segments[0] * tgt_len
    if first < shortest:
        what = "its key and the question" if task == "passkey" else f"{resolved['facts']} facts and the question"
        fewer = "digits" if task == "passkey" else "facts"
        raise ConfigError(
            f"--task {task} needs samples of at least {shortest} bytes ({what}), but the first stage, --segments "
            f"{segments[0]} x model.tgt_len {tgt_len}, is {first}: give model.tgt_len="
            f"{-(-shortest // segments[0])} or more (one segment then holds the whole sample), start --segments at "
            f"{-(-shortest // tgt_len)}, or give fewer {fewer} (--task-option {fewer}=N)")


def first_sample(task: str, options: dict, tokenizer, count: int, tgt_len: int) -> None:
    """Stage 0's first sample drawn in the backbone's tokens, before anything is made: a length too short for the
    story is one line in this command's terms (the generator's own names --task-length)."""
    try:
        next(token_samples(task, "valid", {**options, "docs": {**options["docs"], "valid": 1}}, tokenizer))
    except DataError as exc:
        raise ConfigError(f"curriculum stage 0 ({count} segment(s) of {tgt_len} tokens): {exc} (here the length is "
                          "--segments x model.tgt_len: give a larger model.tgt_len)") from None


def stage_overrides(arch: str, count: int) -> list[str]:
    """What makes one optimizer step take data.batch_size whole samples of `count` segments (module docstring),
    plus the constant rate; the user's own overrides come after these and win."""
    whole = (["model.bptt_mode=chunk", f"model.bptt_depth={count - 1}", "train.grad_accum=1"]
             if arch_spec(arch).recurrence == "memory_bptt" else [f"train.grad_accum={count}"])
    return ["train.schedule=constant", *whole]


def whole_samples_validated(eval_batches: int, count: int) -> list[str]:
    """The trainer's validation pass (the answer loss the stop rule reads) must reach each lane's first answer: a
    task scores its answer bytes only, in a sample's last segment, so fewer batches than the sample's segments score
    nothing (tiny presets read 4: an 8-segment stage failed). 0 (the whole split) already does."""
    return [f"train.eval_batches={count}"] if 0 < eval_batches < count else []


def describe_step(cfg, count: int) -> str:
    """How a stage's step reads its samples, in words."""
    if cfg.model.bptt_mode == "chunk" and cfg.model.bptt_depth + 1 == count and cfg.train.grad_accum == 1:
        how = f"BPTT through all {count} segment(s) of each (model.bptt_mode=chunk, bptt_depth={count - 1})"
    elif cfg.train.grad_accum == count:
        how = f"train.grad_accum={count} segment(s) of each"
    else:
        how = f"train.grad_accum={cfg.train.grad_accum}"
    return f"{cfg.data.batch_size} whole samples per step, {how}; {cfg.train.schedule} rate after warmup"


def finished(run_dir: Path, rule: StopRule) -> dict | None:
    """The stage's record when it has ended (its checkpoint is the one its record names), else None."""
    tag = read_latest(run_dir / "checkpoints")
    if tag is None:
        return None
    path = run_dir / STAGE_FILE
    if path.is_file():
        record = json.loads(path.read_text())
        if record.get("step") == step_of(tag):
            return record
    return None


def run_curriculum(config: str, overrides: list[str], *, out: Path, task: str, task_options: dict[str, Any],
                   segments: list[int], rules: list[StopRule], docs: str, seed: int = 0) -> list[Path]:
    """Prepare and train every stage in turn (single process); returns the stages' run folders. rules: how each
    stage ends (one per stage: the caps may differ).

    Every stage's options and config are checked before the first one starts: a refused command leaves nothing."""
    for rule in rules:
        rule.validate()
    overrides, tokenizer_from, note = backbone_tokens(config, overrides)
    if note:
        print(f"curriculum: {note}", flush=True)
    base = load_config(config, overrides)
    N = base.model.tgt_len
    in_tokens = tokenizer_from is not None
    check_arguments(task, task_options, segments, N, in_tokens)
    split_docs = parse_docs(docs)
    if split_docs["valid"] < rules[0].samples:
        print(f"curriculum: {split_docs['valid']} valid samples per stage, fewer than --check-samples "
              f"{rules[0].samples}: the checks use all {split_docs['valid']}", flush=True)
    stages = []
    for k, ((count, data, run_dir), rule) in enumerate(zip(stage_folders(out, task, segments), rules)):
        try:
            options = stage_options(task, {**task_options, "docs": split_docs, "seed": seed}, count, N, in_tokens)
        except DataError as exc:  # what check_arguments cannot foresee, still before anything is made
            raise ConfigError(f"curriculum stage {k} ({count} segment(s) of {N}): {exc}") from None
        if in_tokens and k == 0:
            first_sample(task, options, load_tokenizer(Path(tokenizer_from)), count, N)
        stage = [*stage_overrides(base.model.arch, count), *whole_samples_validated(base.train.eval_batches, count),
                 *overrides, f"data.path={data}",
                 f"train.steps={rule.steps}", f"train.eval_every={rule.check_every}",
                 f"train.save_every={rule.check_every}"]
        if k:
            stage.append(f"train.init_from={stages[-1][2]}")
        stages.append((count, data, run_dir, options, load_config(config, stage), rule))

    runs, records = [], []
    for k, (count, data, run_dir, options, cfg, rule) in enumerate(stages):
        record = run_stage(k, count, data, run_dir, options, cfg, task=task, rule=rule,
                           previous=runs[-1] if runs else None, tokenizer_from=tokenizer_from)
        runs.append(run_dir)
        records.append({"stage": k, "segments": count, "run_dir": str(run_dir), **record})
        out.mkdir(parents=True, exist_ok=True)
        (out / SUMMARY_FILE).write_text(json.dumps({"task": task, "tgt_len": N, "segments": segments,
                                                    "stages": records}, indent=1) + "\n")
    return runs


def run_stage(k: int, count: int, data: Path, run_dir: Path, options: dict, cfg, *, task: str, rule: StopRule,
              previous: Path | None, tokenizer_from: str | None = None) -> dict:
    """One stage: its data (prepared once, read back and described), its training to the stop, its record.
    tokenizer_from: the backbone folder whose tokenizer.json the data is prepared with (None: bytes)."""
    N, label = cfg.model.tgt_len, f"stage {k} ({count} segment(s) of {cfg.model.tgt_len})"
    unit = "tokens" if tokenizer_from else "bytes"
    done = finished(run_dir, rule)
    if done is not None:
        print(f"curriculum: {label} finished earlier at step {done['step']:,} ({done['stop']}): {run_dir}",
              flush=True)
        return done
    resume = (run_dir / "checkpoints").is_dir()
    print(f"curriculum: {label}: samples of {options['length']:,} {unit}, {describe_step(cfg, count)}; ends when "
          f"learned (held-out accuracy >= {100 * rule.target:g}%)"
          f"{f', on a plateau from step {rule.min_steps:,}' if rule.min_steps < rule.steps and not rule.fixed else ''}"
          f" or at {rule.steps:,} steps"
          f"{', from ' + str(previous) if previous else ''}{' (resuming)' if resume else ''} -> {run_dir}",
          flush=True)
    heartbeat.said()
    if not (data / "manifest.json").is_file():
        heartbeat.phase(f"preparing stage {k}'s data ({options['docs']['train']:,} {task} samples of "
                        f"{options['length']:,} {unit}) in {data}")
        prepare("task", None, data, task=task, task_options=options, workers=1, progress=False,
                tokenizer_from=tokenizer_from)
        heartbeat.phase(None)
    manifest = load_manifest(data)  # a broken corpus is one line here, not a failed stage
    made_with = manifest.get("corpus", {}).get("options")
    if made_with is not None and made_with != json.loads(json.dumps(options)):
        changed = sorted(key for key in set(made_with) | set(options) if made_with.get(key) != options.get(key))
        raise ConfigError(f"{data} was prepared with other task options ({', '.join(changed)}): remove it, or give "
                          "another --out")
    summary = describe(task, read_split(data, "train"), N, sample_tokenizer(data))
    print(f"curriculum: {label} data: {summary_line(summary, count, unit)}", flush=True)
    check = StageCheck(rule, run_dir, read_split(data, "valid"), boundary_id=int(manifest["tokenizer"]["boundary_id"]),
                       label=label)
    tag = read_latest(run_dir / "checkpoints")
    if tag is None or (step_of(tag) < rule.steps and stage_record(rule, run_dir, step_of(tag))["stop"] == "budget"):
        try:  # else it ended at its checkpoint before it was recorded
            run(cfg, run_dir, resume=resume, stop_when=check)
        except Preempted:  # its message says `--resume`, which this command does without being asked
            last = read_latest(run_dir / "checkpoints")
            where = f"; its last checkpoint is {run_dir / 'checkpoints' / last}" if last else ""
            raise Preempted(f"curriculum {label} stopped by SIGTERM{where}: rerun the same command to continue "
                            "from there") from None
    step = step_of(read_latest(run_dir / "checkpoints"))
    record = {"task": task, "segments": count, "tgt_len": N, "length": options["length"],
              **stage_record(rule, run_dir, step), "data": summary}
    (run_dir / STAGE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    print(f"curriculum: {label} ended at step {step:,} ({record['stop']}): {record['reason']}", flush=True)
    return record
