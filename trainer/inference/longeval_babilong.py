"""A run's accuracy on BABILong's own files at one length, with BABILong's scoring: what `memlm longeval --babilong`
runs per (run, length).

Each record (data_pipeline/babilong.py) becomes memlm's task prompt, `<context> Q: <question>` then SEP, in the run's
tokenizer, read segment by segment at the run's target length with the memory carried over every segment and emptied
at the sample's start, as training reads a document. Then the model writes its answer greedily: at most as many tokens
as the task's longest label (memlm's task runs were never trained to stop after the answer, so the cap keeps what
follows an answer from naming a second label), stopping early at the tokenizer's boundary id. BABILong's rule
(babilong.right) judges the text. One sample at a time: every sample ends its prompt at its own place in a segment.

Generation runs the model's own forward: each new token reruns the current segment from the memory it started with,
whole (N ids: the ids so far, then padding that no earlier output can see, as training pads a document's last
segment), so the answer is exactly what the model's segment forward predicts (no second implementation of the memory
rule; LaMemo's look-ahead, for one, reads min(M, ids) positions in a shorter forward, not the trained min(M, N)), at
the cost of one segment per answer token.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memlm.data_pipeline import babilong
from memlm.data_pipeline.tasks import SEP
from memlm.models.output import map_memory

from .longeval import load_for_eval
from .longeval_baselines import baselines


def greedy_answer(model: torch.nn.Module, ids: Sequence[int], *, max_new: int, stop_id: int,
                  device: str | torch.device = "cpu") -> list[int]:
    """The ids the model writes greedily after `ids` (a document's inputs: the boundary id, the prompt, SEP)."""
    N = model.cfg.tgt_len
    memory = model.init_memory(1, device=device)
    first = True

    def forward(tokens: list[int]):
        """The model's forward over one whole segment: `tokens`, then stop_id up to N (padding after the last real
        id, which no output at or before it can see, as a document's last segment is read in training)."""
        reset = torch.tensor([first], dtype=torch.bool, device=device)
        padded = torch.tensor([tokens + [stop_id] * (N - len(tokens))], dtype=torch.long, device=device)
        return model(padded, memory, reset=reset, return_logits=True)

    ids = [int(i) for i in ids]
    start = 0
    while len(ids) - start > N:  # whole segments before the one that holds the prompt's last id
        memory = map_memory(torch.Tensor.detach, forward(ids[start:start + N]).memory)
        start, first = start + N, False
    segment, written = ids[start:], []
    for _ in range(max_new):
        result = forward(segment)
        token = int(result.logits[0, len(segment) - 1].argmax())
        if token == stop_id:
            break
        written.append(token)
        if len(segment) == N:  # the segment is full: its memory carries on, the new token starts the next one
            memory = map_memory(torch.Tensor.detach, result.memory)
            segment, first = [token], False
        else:
            segment = segment + [token]
    return written


def encode(tokenizer, text: str) -> list[int]:
    """The tokenizer's ids of `text` without the boundary id some tokenizers add at the end of a line."""
    ids = [int(i) for i in tokenizer.encode(text)]
    if ids and ids[-1] == tokenizer.boundary_id and not text.endswith("\n"):
        ids.pop()
    return ids


def answers(model: torch.nn.Module, tokenizer, prompts: Sequence[str], labels: Sequence[str], *,
            device: str | torch.device = "cpu") -> list[str]:
    """The text the model writes after each prompt + SEP."""
    max_new = max(len(encode(tokenizer, label)) for label in labels)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return [tokenizer.decode(greedy_answer(model, [tokenizer.boundary_id] + encode(tokenizer, prompt + SEP),
                                                   max_new=max_new, stop_id=tokenizer.boundary_id, device=device))
                    for prompt in prompts]
    finally:
        model.train(was_training)


def evaluate_babilong(run_dir: str | os.PathLike, folder: str | os.PathLike, task: str, length: str,
                      samples: int | None = None) -> dict[str, Any]:
    """The run's latest checkpoint on the first `samples` records (all when None) of BABILong's `task` at `length`
    (a label: 0k, 1k, ...) in `folder`, with the baselines of a reader that does not learn, all by BABILong's rule."""
    records = babilong.records(folder, task, length, samples)
    model, tokenizer, _, step, device = load_for_eval(run_dir)
    labels = babilong.TASK_LABELS[task]
    prompts = [babilong.prompt_of(r) for r in records]
    written = answers(model, tokenizer, prompts, labels, device=device)
    right = [babilong.right(r.target, text, r.question, labels) for r, text in zip(records, written)]

    def judge(answer: str, guess: str | None, question: str) -> bool:
        return babilong.right(answer, guess or "", question, labels)

    pairs = [(prompt, r.target) for prompt, r in zip(prompts, records)]
    floor = baselines(task, pairs, labels, 1.0 / len(labels), judge)
    accuracy = sum(right) / len(right)
    mcfg = model.cfg
    return {"source": "babilong", "babilong": str(Path(folder).resolve()), "task": task, "length":
            babilong.length_tokens(length), "length_label": length, "split": "babilong", "tgt_len": mcfg.tgt_len,
            "mem_len": mcfg.mem_len, "arch": mcfg.arch, "step": step, "limit": samples, "samples": len(right),
            "accuracy": accuracy,
            "by_depth": [{"depth_min": 0.0, "depth_max": 1.0, "samples": len(right), "accuracy": accuracy,
                          "baselines": floor}],
            "baselines": floor, "scoring": "babilong"}
