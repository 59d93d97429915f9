"""`memlm prepare --corpus babilong`: one (task, length) of a downloaded BABILong folder as a DATA_DIR to train on.

The documents are the records rendered as memlm's task samples (data_pipeline/babilong.py: `<context> Q: <question>`
+ SEP + target) on the bytes tokenizer, the loss mask on the answer only, exactly as `memlm prepare --corpus task`
writes its tasks, so every trainer path (`memlm train`, `memlm curriculum`, `memlm eval`'s answer accuracy) reads it
unchanged. The splits come from the file's records in order: train first, then valid, then test. Point it at the
authors' training set (RMT-team/babilong-train-5k-samples) and evaluate on a test set (RMT-team/babilong,
babilong-1k-samples) with `memlm longeval --babilong`.

The folder is built and installed as prepare.py builds every DATA_DIR (aside, manifest last, renamed into place), with
prepare.py's own helpers.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from . import babilong
from .format import MANIFEST, SPLITS, TOKENIZER_DIR, DataError
from .prepare import _check_out, _install, _make_parents, _manifest, _remove_empty, _write
from .shards import DEFAULT_SHARD_TOKENS
from .tasks import SEP
from .tokenizers import train_tokenizer

HELD_OUT = 20  # with no `docs`: valid and test get 1/20 of the records each (at least one)


def split_counts(docs, total: int) -> dict[str, int]:
    """Records per split. docs: None (all records: valid and test 1/20 each, the rest train), N (train N, valid
    and test N // 10 each, at least 1), "N,V,T" or a {split: n} dict."""
    if docs is None:
        held = max(1, total // HELD_OUT)
        counts = {"train": total - 2 * held, "valid": held, "test": held}
    elif isinstance(docs, dict):
        counts = {split: int(docs[split]) for split in SPLITS}
    elif isinstance(docs, str) and "," in docs:
        parts = docs.split(",")
        if len(parts) != len(SPLITS) or not all(p.strip().isdigit() for p in parts):
            raise DataError(f"--task-docs {docs!r}: give N or TRAIN,VALID,TEST")
        counts = dict(zip(SPLITS, (int(p) for p in parts)))
    else:
        try:
            n = int(docs)
        except ValueError:
            raise DataError(f"--task-docs {docs!r}: give N or TRAIN,VALID,TEST") from None
        counts = {"train": n, "valid": max(1, n // 10), "test": max(1, n // 10)}
    if min(counts.values()) < 1:
        raise DataError(f"BABILong: every split needs at least one record, got {counts} from {total} records")
    if sum(counts.values()) > total:
        raise DataError(f"BABILong: {counts} asks for {sum(counts.values())} records but the file has {total}: "
                        "ask for fewer with --task-docs TRAIN,VALID,TEST")
    return counts


def prepare_babilong(folder: str | os.PathLike, task: str, length: str, out: str | os.PathLike, *, docs=None,
                     overwrite: bool = False, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                     progress: bool | None = None) -> dict:
    """Write BABILong's `task` at `length` (a label: 0k, 1k, ...) from `folder` as a DATA_DIR at `out`; return its
    manifest. docs: records per split (split_counts). Any mistake is a DataError naming the file and the fix, raised
    before anything is written."""
    out = Path(out)
    sources = babilong.files(folder, task, length)
    found = babilong.records(folder, task, length)
    counts = split_counts(docs, len(found))
    _check_out(out, overwrite)
    made = _make_parents(out.parent)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()

        tok = train_tokenizer("bytes", [], None, tmp / TOKENIZER_DIR)
        splits, first = {}, 0
        for split in SPLITS:
            chosen = found[first:first + counts[split]]
            splits[split] = _write(tmp, split, _documents(chosen, task, length, split), tok.vocab_size, shard_tokens,
                                   progress, total=len(chosen))
            first += counts[split]
        root = Path(folder)
        corpus = {"kind": "babilong", "input": str(folder), "task": task, "length": length,
                  "files": [str(p.relative_to(root)) for p in sources], "docs": counts, "first_target": 0}
        manifest = _manifest(corpus, tok, splits)
        (tmp / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        raise
    return manifest


def _documents(chosen: list[babilong.Record], task: str, length: str,
               split: str) -> Iterator[tuple[np.ndarray, np.ndarray, str]]:
    """(byte ids, loss mask on the answer, title) per record, as tasks.task_documents gives them."""
    for i, record in enumerate(chosen):
        prompt, answer = babilong.prompt_of(record), babilong.printable(record.target)
        tokens = np.frombuffer((prompt + SEP + answer).encode("ascii"), dtype=np.uint8).astype(np.int64)
        mask = np.zeros(len(tokens), dtype=np.uint8)
        mask[len(prompt) + len(SEP):] = 1
        yield tokens, mask, f"babilong-{task}-{length}-{split}-{i}"
