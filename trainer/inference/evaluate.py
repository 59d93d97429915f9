"""Evaluation (`memlm eval`, docs/design.md §4 and §8): per-document memory, every token counted once across ranks.

    result = evaluate(model, data_dir, "valid", lanes=4, seg_len=model.cfg.tgt_len, rank=r, world_size=w)
    result = evaluate_run("runs/x", split="test", mem_mult=4)   # config + checkpoint -> JSON in runs/x/eval/

The stream (LaneStream, mode="eval") gives every document to exactly one rank and lane and the same number of
batches on every rank, so the loop below needs no end-of-data agreement: each rank sums its own NLL and token
count in float64 and one all-reduce adds them. Memory is emptied by the model wherever `reset` is true (a new
document), so a document's score does not depend on which lane, rank or neighbour it was read with.

The run is read by trainer/checkpoint/run_loader.py, the loader of every command that reads a trained run: weights
from a checkpoint at any world size and ZeRO stage, or from an export folder's safetensors (its data: config.yaml's
data.path, or data_dir / --data). Memory length is configuration only, so the same weights load strictly at any
--mem-len.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.progress import Meter
from memlm.data_pipeline.stream import LaneStream
from memlm.models import map_memory
from memlm.models.config import ConfigError
from memlm.trainer.checkpoint.run_loader import open_run
from memlm.trainer.runtime import heartbeat
from memlm.trainer.runtime.distributed import evaluation_group
from memlm.trainer.runtime.process import prepare_process, refit_threads
from memlm.trainer.tracking.tracker import log_eval_result

RESULT_KEYS = ("split", "documents", "tokens", "nll", "ppl", "bpc", "tgt_len", "mem_len", "arch", "step")


# ---------------------------------------------------------------------------------------------------------------
# The evaluation loop


@torch.no_grad()
def evaluate(model: torch.nn.Module, data_dir: str | os.PathLike, split: str, *, lanes: int, seg_len: int,
             rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu", max_batches: int = 0,
             continuous: bool = False, progress: bool = False, accuracy: bool = False) -> dict[str, Any]:
    """Mean NLL of `split` under `model`; identical (up to summation order) for any world size and lane count.

    Collective when world_size > 1: every rank must call it (torch.distributed already initialised).
    max_batches > 0 stops early (every rank reads the same number of batches, so it stays collective-safe).
    progress: rank 0 shows batches and scored tokens done with an ETA (a bar on a terminal, else a line every
    15 s and one at the end, on stderr).
    accuracy: also report `accuracy`, the fraction of scored targets that are the model's most likely token
    (the algorithmic tasks' per-token answer accuracy, RMT Figure 4); it asks the model for its log-probabilities.
    """
    cfg = model.cfg
    if cfg.tgt_len != seg_len:
        # A model built for N targets is not asked for another N: rebuild it with eval.tgt_len instead.
        raise ConfigError(f"evaluate: seg_len={seg_len} but the model was built with tgt_len={cfg.tgt_len}; "
                          "build the model with the evaluation's target length")
    stream = LaneStream(data_dir, split, rank=rank, world_size=world_size, lanes=lanes, seg_len=seg_len,
                        mode="eval", continuous=continuous)
    was_training = model.training
    model.eval()
    memory = model.init_memory(batch_size=lanes, device=device)
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    documents = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.float64, device=device)
    total = stream.num_batches if not max_batches else min(max_batches, stream.num_batches or max_batches)
    meter = Meter(f"eval {split}", total=total, unit="batch", enabled=progress and rank == 0,
                  tokens_label="scored tokens" if world_size == 1 else "rank-0 scored tokens")
    try:
        for step, batch in enumerate(stream):
            if max_batches and step >= max_batches:
                break
            refit_threads()  # fewer threads while other processes keep this one's cores busy (runtime/process.py)
            # Counted on the host copy: no device sync per batch for the display.
            meter.update(1, tokens=int((batch.targets != -100).sum()) if meter.enabled else 0)
            inputs, targets = batch.tokens.to(device), batch.targets.to(device)
            reset = batch.reset.to(device)
            out = model(inputs, memory, reset=reset, targets=targets, return_logits=accuracy)
            memory = map_memory(torch.Tensor.detach, out.memory)
            scored = targets != -100
            if accuracy:
                correct += ((out.logits.argmax(-1) == targets) & scored).sum()
            # nll is 0 at ignored targets already; masking again guards against a NaN from a padded position.
            nll_sum += torch.where(scored, out.nll, 0).double().sum()
            tokens += scored.sum()
            documents += (reset & batch.lane_active.to(device)).sum()
    finally:
        model.train(was_training)
        meter.close(summary=True)
    totals = torch.stack([nll_sum, tokens, documents, correct])
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    nll_total, n_tokens, n_docs, n_correct = (float(x) for x in totals.cpu())
    if n_tokens == 0:  # every rank holds the same totals, so every rank raises: collective-safe
        if max_batches:
            raise DataError(f"evaluating split {split!r}: {max_batches} batch(es) of {lanes} lanes x {seg_len} tokens "
                            "scored no target (tasks score their answer tokens only); raise train.eval_batches "
                            "(0 reads the whole split)")
        raise DataError(f"evaluating split {split!r} of {data_dir}: it holds no scored target token; prepare it "
                        "again or evaluate another split")
    result = summarize(split, nll_total, int(n_tokens), int(n_docs), cfg.tgt_len, cfg.mem_len, cfg.arch)
    if accuracy:
        result["accuracy"] = n_correct / n_tokens
    return result


def summarize(split: str, nll_total: float, tokens: int, documents: int, tgt_len: int, mem_len: int,
              arch: str) -> dict[str, Any]:
    """The §8 JSON object (without `step`) from summed NLL and counts."""
    nll = nll_total / tokens if tokens else float("nan")
    try:
        ppl = math.exp(nll)
    except OverflowError:  # an untrained or diverged model: report inf rather than fail
        ppl = float("inf")
    return {"split": split, "documents": documents, "tokens": tokens, "nll": nll, "ppl": ppl,
            "bpc": nll / math.log(2), "tgt_len": tgt_len, "mem_len": mem_len, "arch": arch}


# ---------------------------------------------------------------------------------------------------------------
# A run folder -> config, checkpoint, JSON


@contextlib.contextmanager
def _start_watch(wanted: bool):
    """`memlm eval: still loading the weights of ... (9 s)` while a slow start says nothing (runtime/heartbeat.py)."""
    if not wanted:
        yield
        return
    heartbeat.start("memlm eval")
    try:
        yield
    finally:
        heartbeat.stop()


def evaluate_run(run_dir: str | os.PathLike, split: str = "valid", tgt_len: int | None = None,
                 mem_len: int | None = None, mem_mult: float | None = None, clamp_len: int | None = None,
                 same_length: bool | None = None, lanes: int | None = None, json_path: str | os.PathLike | None = None,
                 tag: str | None = None, data_dir: str | os.PathLike | None = None,
                 track: bool = True, progress: bool = True) -> dict[str, Any]:
    """Evaluate RUN_DIR's checkpoint (`tag`, default the `latest` one) and write the JSON (rank 0).

    Every argument left None keeps the run's own setting. track: also log the result to the training run's MLflow
    run (off for callers that log themselves, such as `memlm extrapolate`'s parallel tasks). progress: rank 0 shows
    the pass's progress on stderr (off for `memlm extrapolate`'s tasks: its driver shows theirs). Runs collectively
    under torchrun / the deepspeed
    launcher (a process group is created here when none exists and RANK/WORLD_SIZE are set).
    User mistakes raise ConfigError / DataError with a one-line message, before any process group exists.
    """
    run_dir = Path(run_dir)
    if lanes is not None and lanes < 1:
        raise ConfigError(f"--lanes must be >= 1, got {lanes}")
    run = open_run(run_dir, tag=tag, split=split, tgt_len=tgt_len, mem_len=mem_len, mem_mult=mem_mult,
                   clamp_len=clamp_len, same_length=same_length)
    cfg, export = run.config, run.export
    data_dir, manifest = run.data(data_dir, split=split)

    prepare_process(who="eval")  # threads that fit this rank's cores (a Ray task has already set its own)
    with evaluation_group() as (rank, world_size, device), _start_watch(rank == 0 and progress):
        heartbeat.phase(f"loading the weights of {run.weights}")
        model = run.load_model(device)
        heartbeat.phase(None)  # the evaluation's own progress lines from here (its first within 8 s)
        result = evaluate(model, data_dir, split, lanes=lanes or cfg.data.eval_lanes, seg_len=model.cfg.tgt_len,
                          rank=rank, world_size=world_size, device=device, continuous=cfg.data.continuous,
                          progress=progress, accuracy=is_task(manifest))
    result["step"] = run.step
    if rank == 0 and export is not None:
        # An export folder is a finished artifact (maybe read-only, maybe shared): its results go where --json says.
        if json_path:
            write_json(result, Path(json_path))
    elif rank == 0:
        path = Path(json_path) if json_path else (
            run_dir / "eval" / f"{split}-step{result['step']}-tgt{result['tgt_len']}-mem{result['mem_len']}.json")
        write_json(result, path)
        if track:  # mlflow itself is imported only if the run is tracked (tracking/tracker.py)
            log_eval_result(cfg, run_dir, result, path)
    return result


def is_task(manifest: dict) -> bool:
    """A data folder of an algorithmic task (`memlm prepare --corpus task`, or BABILong's files prepared with
    `--corpus babilong`): its evaluations report accuracy."""
    return (manifest.get("corpus") or {}).get("kind") in ("task", "babilong")


def write_json(result: dict[str, Any], path: Path) -> Path:
    """Written aside and renamed, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    return path
