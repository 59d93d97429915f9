"""A curriculum stage's samples: the task options that make an S-segment stage, and what its prepared data holds,
read back from the shards training reads.

An S-segment stage's samples are S x model.tgt_len bytes less their answer's shortfall from the task's longest (0-4
bytes for a place; data_pipeline/longctx.py sizes every prompt for the longest answer, so the question's place gives
nothing away), so a sample is read as S segments. At S = 1 the whole sample, facts and question, is one segment: every
model, the no-memory one included, can learn the task there. From S = 2 on the story starts within the first quarter of
the first segment (the depth window [0, (tgt_len / 4) / background bytes]), so the fact and the question lie S - 1
segment boundaries apart and only a memory can carry the one to the other. A depth window the user gives (--task-option
depth_min=/depth_max=) is kept as given.

Where the fact is, measured from a sample's text alone (`fact_start`): passkey, the key's last mention; qa1, the
asked person's last mention (the start of their last move: the background never names the story's people). qa2 and
qa3 rest on several facts and are not measured. Positions are read as training reads a document: inputs
[boundary] + doc[:-1], so byte i is an input at position i + 1 and the answer's first byte is predicted at its own
index; position p is in segment p // tgt_len.

In a backbone's tokens (the curriculum's model.backbone folder has its tokenizer.json: data_pipeline/
longctx_tokens.py) every length above counts those tokens, not bytes, and a sample's ids are the encodings of its
prompt, SEP and answer end to end: read_sample decodes them and finds the fact's token from its text.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np

from memlm.data_pipeline import longctx
from memlm.data_pipeline.hf_tokenizer import KIND as HF_KIND
from memlm.data_pipeline.remote.tokenizer_files import tokenizer_folder
from memlm.data_pipeline.shard_source import ShardSource
from memlm.data_pipeline.shards import load_manifest
from memlm.data_pipeline.tasks import SEP as SEP_TEXT
from memlm.data_pipeline.tasks import resolve_options
from memlm.data_pipeline.tokenizers import load_tokenizer

SEP = ord(">")  # data_pipeline/tasks.py's start-to-generate token, as a byte
STORY_START = 4  # from S = 2 on, the story starts within the first 1 / STORY_START of the first segment


def stage_options(task: str, options: dict, segments: int, tgt_len: int, in_tokens: bool = False) -> dict:
    """The task options of an S-segment stage (resolved: every default filled in and checked; DataError when the
    generator refuses them). in_tokens: lengths count a backbone tokenizer's tokens (data_pipeline/
    longctx_tokens.py)."""
    length = segments * tgt_len
    staged = {**options, "length": length}
    if segments > 1 and "depth_min" not in options and "depth_max" not in options:
        if in_tokens:
            # The story's floor is in bytes, the length in tokens: the background is taken as the whole sample, so
            # the window is narrower than in bytes (the story starts earlier), never wider.
            background = length
        else:
            # The least background a sample of these options can have: the longest story leaves the least room.
            floor = longctx.min_length(task, resolve_options(task, {**options, "length": length}))
            background = max(length - floor + 2, 1)
        staged["depth_min"], staged["depth_max"] = 0.0, min(1.0, (tgt_len / STORY_START) / background)
    return resolve_options(task, staged, in_tokens=in_tokens)


def fact_start(task: str, prompt: str, answer: str) -> int | None:
    """The byte index in the sample where the fact the answer rests on starts; None for a task whose answer rests on
    several facts (qa2, qa3) or a prompt that does not hold it."""
    context = prompt.rpartition(" Q: ")[0]
    if task == "passkey":
        found = context.rfind(answer)
    elif task == "qa1":
        asked = re.search(r"Where is (\w+)\?\s*$", prompt)
        mentions = list(re.finditer(rf"\b{asked.group(1)}\b", context)) if asked else []
        found = mentions[-1].start() if mentions else -1  # a whole word: "Bill" in a background "Billboard" is not
    else:
        return None
    return found if found >= 0 else None


def segments_apart(fact: int, answer_first: int, tgt_len: int) -> int:
    """Segments from the one that reads the fact's first byte to the one that predicts the answer's first byte, both
    counted: 1 when they share a segment."""
    return answer_first // tgt_len - (fact + 1) // tgt_len + 1


def read_split(data_dir: str | Path, split: str) -> list[tuple[np.ndarray, int]]:
    """The split's samples as the shards hold them: (byte ids of prompt + SEP + answer, answer length)."""
    source = ShardSource(data_dir, split)
    out = []
    for shard_id in range(len(source.shards)):
        docs = source.load(shard_id)
        for index in sorted(docs):
            doc = docs[index]
            answer_len = int(doc.mask.sum()) if doc.mask is not None else 0
            out.append((np.asarray(doc.tokens, dtype=np.int64), answer_len))
    return out


def sample_tokenizer(data_dir: str | Path):
    """The tokenizer a task corpus was prepared with when it is a backbone's (kind hf), else None: bytes, whose ids
    are the sample's bytes (read_sample's fast path)."""
    manifest = load_manifest(data_dir)
    if manifest.get("tokenizer", {}).get("kind") != HF_KIND:
        return None
    return load_tokenizer(tokenizer_folder(data_dir, manifest))


def read_sample(task: str, tokens: np.ndarray, answer_len: int, tgt_len: int,
                tokenizer=None) -> tuple[str, str, int | None]:
    """(prompt, answer, segments from fact to answer or None) of one sample as read_split gives it. tokenizer: a
    backbone's (sample_tokenizer), whose samples are encode(prompt) + encode(SEP) + encode(answer)
    (data_pipeline/longctx_tokens.py); None: bytes. The fact is found in the text (fact_start) and placed at the
    token that holds its first character."""
    if tokenizer is None:
        text = bytes(tokens.astype(np.uint8)).decode("ascii")
        prompt, answer = text[:len(text) - answer_len - 1], text[len(text) - answer_len:]
        fact = fact_start(task, prompt, answer)
        return prompt, answer, None if fact is None else segments_apart(fact, len(prompt) + 1, tgt_len)
    answer_first = len(tokens) - answer_len
    prompt_ids = tokens[:answer_first - len(tokenizer.encode(SEP_TEXT))]
    prompt, answer = tokenizer.decode(prompt_ids), tokenizer.decode(tokens[answer_first:])
    fact = fact_start(task, prompt, answer)
    if fact is None:
        return prompt, answer, None
    return prompt, answer, segments_apart(token_at(prompt_ids, fact, tokenizer), answer_first, tgt_len)


def token_at(ids: np.ndarray, char: int, tokenizer) -> int:
    """The index of the token of `ids` whose decoded text holds character `char`: the most tokens whose decoded
    prefix ends at or before it (a binary search; prefixes decode to longer texts as they grow)."""
    low, high = 0, len(ids)  # decode(ids[:low]) ends at or before char; ids[:high] past it (or every id)
    while high - low > 1:
        mid = (low + high) // 2
        if len(tokenizer.decode(ids[:mid])) <= char:
            low = mid
        else:
            high = mid
    return low


def describe(task: str, samples: list[tuple[np.ndarray, int]], tgt_len: int, tokenizer=None) -> dict:
    """Lengths, segments per sample and segments between fact and answer, counted over `samples` (tokenizer: see
    read_sample)."""
    lengths, spans = [], Counter()
    for tokens, answer_len in samples:
        lengths.append(len(tokens))
        apart = read_sample(task, tokens, answer_len, tgt_len, tokenizer)[2]
        if apart is not None:
            spans[apart] += 1
    segments = Counter(-(-n // tgt_len) for n in lengths)
    return {"samples": len(samples), "tgt_len": tgt_len,
            "length": {"min": min(lengths), "median": float(np.median(lengths)), "max": max(lengths)},
            "segments": {str(k): segments[k] for k in sorted(segments)},
            "fact_segments_apart": {str(k): spans[k] for k in sorted(spans)}}


def summary_line(summary: dict, segments: int, unit: str = "bytes") -> str:
    """One line: the achieved lengths (in `unit`) and how many samples are what the stage asked for."""
    n, length = summary["samples"], summary["length"]
    exact = summary["segments"].get(str(segments), 0)
    line = (f"{n:,} samples of {length['min']:,}-{length['max']:,} {unit} (median {length['median']:g}); "
            f"{exact:,} ({100 * exact / max(n, 1):.0f}%) span {segments} segment(s) of {summary['tgt_len']}")
    spans = summary["fact_segments_apart"]
    if spans:
        apart = spans.get(str(segments), 0)
        line += (f"; fact and answer {segments} segment(s) apart in {apart:,} ({100 * apart / max(n, 1):.0f}%)"
                 + ("" if apart == n else f" (all: {', '.join(f'{k}: {v:,}' for k, v in spans.items())})"))
    return line
