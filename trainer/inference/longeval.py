"""Long-context accuracy of one run at one sample length: what `memlm longeval` runs per (run, length).

A sample (data_pipeline/longctx.py: BABILong-style QA or passkey) is read as training reads a document: inputs
[boundary] + doc[:-1], targets doc, segment by segment at the run's target length, the memory carried over every
segment of the sample and emptied at its start. The answer counts as right when at every answer token the most
likely next token is the answer's: exactly what greedy decoding after the prompt would write. Lanes hold one
sample each; a sample shorter than its lane-mates is padded after its end (inputs the boundary id, targets
ignored), which no answer token can see.

A run whose data was prepared with a Hugging Face backbone's tokenizer.json (`memlm prepare --tokenizer-from FOLDER`,
or `memlm curriculum` on a model.backbone folder that has one) is scored on samples in that tokenizer's tokens, its
lengths counted in them (cell_docs); every other run on bytes, as it was trained.

Depth: the facts of a cell's samples lie in one window [i / K, (i + 1) / K] of the background (depth 0: the start
of the context, far from the question).

Beside the accuracy, each cell carries the baselines of a reader that does not learn, measured on the cell's own
samples from their prompt text (longeval_baselines.py: chance, the last or most frequent place mentioned, ...).
BABILong's own files are longeval_babilong.py's.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from memlm.data_pipeline import tasks
from memlm.data_pipeline.hf_tokenizer import KIND as HF_KIND
from memlm.data_pipeline.longctx_tokens import token_samples
from memlm.models.output import map_memory
from memlm.trainer.checkpoint.run_loader import load_run

from .longeval_baselines import baselines, mean_by_samples, task_labels_and_chance

IGNORE = -100


def answer_correct(model: torch.nn.Module, docs: list[tuple[np.ndarray, int]], *, lanes: int, boundary_id: int,
                   device: str | torch.device = "cpu") -> list[bool]:
    """docs: (byte ids of prompt + SEP + answer, answer length) -> whether the model gets each answer right."""
    N = model.cfg.tgt_len
    out: list[bool] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for first in range(0, len(docs), lanes):
                group = docs[first:first + lanes]
                B = len(group)
                n_seg = max(math.ceil(len(tokens) / N) for tokens, _ in group)
                inputs = torch.full((B, n_seg * N), boundary_id, dtype=torch.long)
                targets = torch.full((B, n_seg * N), IGNORE, dtype=torch.long)
                for lane, (tokens, answer_len) in enumerate(group):
                    doc = torch.as_tensor(tokens, dtype=torch.long)
                    inputs[lane, 1:len(doc)] = doc[:-1]
                    targets[lane, len(doc) - answer_len:len(doc)] = doc[len(doc) - answer_len:]
                memory = model.init_memory(B, device=device)
                wrong = torch.zeros(B, dtype=torch.bool)
                for k in range(n_seg):
                    seg = slice(k * N, (k + 1) * N)
                    reset = torch.full((B,), k == 0, dtype=torch.bool, device=device)
                    result = model(inputs[:, seg].to(device), memory, reset=reset, targets=targets[:, seg].to(device),
                                   return_logits=True)
                    memory = map_memory(torch.Tensor.detach, result.memory)
                    scored = targets[:, seg] != IGNORE
                    if scored.any():
                        guess = result.logits.argmax(-1).cpu()
                        wrong |= (scored & (guess != targets[:, seg])).any(-1)
                out += (~wrong).tolist()
    finally:
        model.train(was_training)
    return out


def depth_windows(count: int) -> list[tuple[float, float]]:
    return [(i / count, (i + 1) / count) for i in range(count)]


def cell_samples(task: str, options: dict, length: int, window: tuple[float, float], count: int, seed: int,
                 split: str) -> list:
    """`count` samples (tasks.Sample: prompt, answer) of `length` bytes with their facts in `window`."""
    return list(tasks.generate(task, split, cell_options(task, options, length, window, count, seed)))


def cell_options(task: str, options: dict, length: int, window: tuple[float, float], count: int, seed: int,
                 in_tokens: bool = False) -> dict:
    """The resolved task options of one (length, window) cell: its own seed, its depth window, `count` samples."""
    # A seed per (length, window) cell: cells never share samples, and any cell can be rerun alone.
    cell_seed = int(np.random.SeedSequence([seed, length, int(window[0] * 1e6)]).generate_state(1)[0] % 2**31)
    return tasks.resolve_options(task, {**options, "length": length, "depth_min": window[0], "depth_max": window[1],
                                        "seed": cell_seed, "docs": {"train": 1, "valid": count, "test": count}},
                                 in_tokens=in_tokens)


def cell_docs(task: str, options: dict, length: int, window: tuple[float, float], count: int, seed: int, split: str,
              tokenizer) -> tuple[list[tuple[np.ndarray, int]], list[tuple[str, str]]]:
    """(docs as the scorer reads them, (prompt, answer) texts) of one cell. In a backbone's tokens (a tokenizer of
    kind hf: the run's data was prepared with its model folder's tokenizer.json) `length` counts those tokens and a
    doc is encode(prompt) + encode(SEP) + encode(answer), as the run trained on (data_pipeline/longctx_tokens.py);
    otherwise bytes, the samples of cell_samples."""
    if tokenizer.kind != HF_KIND:
        cell = cell_samples(task, options, length, window, count, seed, split)
        return [as_doc(s) for s in cell], [(s.prompt, s.answer) for s in cell]
    resolved = cell_options(task, options, length, window, count, seed, in_tokens=True)
    docs, pairs = [], []
    for prompt, answer, prompt_ids, sep_ids, answer_ids in token_samples(task, split, resolved, tokenizer):
        docs.append((np.concatenate([prompt_ids, sep_ids, answer_ids]).astype(np.int64), len(answer_ids)))
        pairs.append((prompt, answer))
    return docs, pairs


def task_samples(task: str, options: dict, length: int, window: tuple[float, float], count: int, seed: int,
                 split: str) -> list[tuple[np.ndarray, int]]:
    """cell_samples' samples as the scorer reads them: (byte ids of prompt + SEP + answer, answer length)."""
    return [as_doc(s) for s in cell_samples(task, options, length, window, count, seed, split)]


def as_doc(sample) -> tuple[np.ndarray, int]:
    return np.frombuffer(sample.text.encode("ascii"), dtype=np.uint8).astype(np.int64), len(sample.answer)


def load_for_eval(run_dir: str | os.PathLike) -> tuple[torch.nn.Module, Any, Any, int | None, str]:
    """(model in eval mode on the device, the tokenizer, the resolved RunConfig, the weights' step, device) of the
    run's latest checkpoint (or of an export folder)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, run = load_run(run_dir, device=device)
    return model, tokenizer, run.config, run.step, device


def evaluate_length(run_dir: str | os.PathLike, task: str, options: dict, length: int, depths: int, samples: int,
                    seed: int = 0, split: str = "test", lanes: int | None = None) -> dict[str, Any]:
    """The run's latest checkpoint on `samples` samples of each of `depths` depth windows at `length` bytes (tokens
    of the run's backbone tokenizer when its data was prepared with one: cell_docs), with the baselines of a reader
    that does not learn on the same samples (longeval_baselines.py)."""
    model, tokenizer, cfg, step, device = load_for_eval(run_dir)
    labels, chance = task_labels_and_chance(task, options)
    rows = []
    for window in depth_windows(depths):
        docs, pairs = cell_docs(task, options, length, window, samples, seed, split, tokenizer)
        right = answer_correct(model, docs, lanes=lanes or cfg.data.eval_lanes, boundary_id=tokenizer.boundary_id,
                               device=device)
        rows.append({"depth_min": window[0], "depth_max": window[1], "samples": len(right),
                     "accuracy": sum(right) / len(right), "baselines": baselines(task, pairs, labels, chance)})
    total = sum(r["samples"] for r in rows)
    mcfg = model.cfg
    return {"task": task, "length": length, "split": split, "seed": seed, "tgt_len": mcfg.tgt_len,
            "mem_len": mcfg.mem_len, "arch": mcfg.arch, "step": step, "samples": total,
            "accuracy": sum(r["accuracy"] * r["samples"] for r in rows) / total, "by_depth": rows,
            "baselines": mean_by_samples(rows)}
