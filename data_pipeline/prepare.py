"""`memlm prepare`: corpus -> tokenizer -> webdataset shards + manifest.json in a DATA_DIR (format.py).

Atomic: everything is built in a sibling folder `OUT.tmp-<pid>` (manifest.json written last inside it) and renamed
to OUT at the end, so OUT is either absent, the earlier finished folder, or the new finished folder; a failure
removes the temporary folder. Deterministic: no timestamps, the input path recorded as given, tar members with fixed
metadata, so preparing the same input twice gives byte-identical files.

Parallelism: with workers > 1, documents are tokenized in a process pool (imap keeps corpus order), each worker
loading the tokenizer from the folder just saved. Measured on WikiText-2 (train+valid+test, 2 cores, whole
prepare): word 0.79 -> 0.70 s, spm-bpe 8k 2.66 -> 1.65 s, spm-unigram 8k 4.55 -> 4.21 s (training dominates) with
1 -> 2 workers, so 2 is the default. A corpus that is one document per split (enwik8/text8 without --split-pages)
is always tokenized in this process: a pool could not split it.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from . import longctx, longctx_tokens
from .corpora import read_corpus
from .format import FORMAT_VERSION, MANIFEST, SPLITS, TOKENIZER_DIR, DataError, token_dtype
from .hf_tokenizer import KIND as HF_KIND
from .progress import Meter, is_terminal
from .progress import phase as progress_phase
from .shards import DEFAULT_SHARD_TOKENS, write_split
from .tasks import resolve_options, task_documents
from .tokenizers import load_tokenizer, train_tokenizer

CORPORA = ("wikitext", "enwik8", "text8", "textdir", "jsonl", "task")
BYTE_CORPORA = ("enwik8", "text8", "task")  # default tokenizer: bytes; the rest default to word
POOL_CHUNK = 8  # documents per pool task: articles vary a lot in size, small chunks keep both cores busy


def prepare(corpus: str, input_path: str | os.PathLike | None, out: str | os.PathLike, tokenizer: str | None = None,
            vocab_size: int | None = None, task: str | None = None, task_options: dict | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, split_pages: bool = False, workers: int = 2,
            overwrite: bool = False, tokenizer_from: str | os.PathLike | None = None,
            progress: bool | None = None) -> dict:
    """Prepare a DATA_DIR and return its manifest. Any user mistake raises DataError (naming the file and the fix).

    tokenizer: word | bytes | spm-unigram | spm-bpe (default: bytes for enwik8/text8/task, else word), trained on
    the train split; or tokenizer_from: an existing tokenizer folder to reuse (another DATA_DIR/tokenizer, or a
    Hugging Face model folder's own tokenizer.json: data_pipeline/hf_tokenizer.py; a task then counts a long-context
    sample's length in its tokens: data_pipeline/longctx_tokens.py).
    progress: None shows a bar on a terminal, else a progress line every 15 s on stderr; False shows nothing.
    """
    out = Path(out)
    tokenizer = _check_arguments(corpus, input_path, tokenizer, vocab_size, task, tokenizer_from)
    task_tokenizer = None
    if corpus == "task":
        task_tokenizer = _task_tokenizer(tokenizer_from)  # a folder without a usable tokenizer: refused here
        in_tokens = task_tokenizer is not None
        # a bad option is refused before any folder is made
        task_options = resolve_options(task, task_options, in_tokens=in_tokens)
    _check_out(out, overwrite)
    made = _make_parents(out.parent)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    if tmp.exists():  # a leftover of an earlier process with our pid
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        if corpus == "task":
            manifest = _prepare_task(tmp, task, task_options, shard_tokens, progress, task_tokenizer,
                                     tokenizer_from)
        else:
            manifest = _prepare_corpus(tmp, corpus, input_path, tokenizer, vocab_size, shard_tokens, split_pages,
                                       workers, tokenizer_from, progress)
        # Written last: a folder without manifest.json is never mistaken for finished data.
        (tmp / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)  # a refused or failed prepare leaves no empty folders behind (issue 32)
        raise
    return manifest


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p `folder`; the folders it created, deepest first."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first: a parent empties as its children go
        try:
            folder.rmdir()
        except OSError:  # not empty (another process wrote there meanwhile) or already gone: leave it
            return


def _check_arguments(corpus, input_path, tokenizer, vocab_size, task, tokenizer_from) -> str:
    """Catch argument mistakes before any work; return the tokenizer kind to use."""
    if corpus not in CORPORA:
        raise DataError(f"unknown corpus {corpus!r}: use one of {', '.join(CORPORA)}")
    if corpus == "task":
        if task is None:
            raise DataError("--corpus task needs --task (copy, reverse, retrieval or quadratic)")
        if tokenizer not in (None, "bytes") or vocab_size not in (None, 256):
            raise DataError("--corpus task documents are ASCII text on the bytes tokenizer, or on a backbone's "
                            "(--tokenizer-from MODEL_FOLDER): drop --tokenizer/--vocab-size")
        return "bytes" if tokenizer_from is None else "from"
    if task is not None:
        raise DataError(f"--task applies to --corpus task only, not to {corpus}")
    if input_path is None:
        raise DataError(f"--corpus {corpus} needs --input PATH")
    if tokenizer_from is not None:
        if tokenizer is not None or vocab_size is not None:
            raise DataError("--tokenizer-from reuses a trained tokenizer: drop --tokenizer and --vocab-size")
        return "from"
    return tokenizer or ("bytes" if corpus in BYTE_CORPORA else "word")


def _check_out(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"--out {out} exists and is not a folder: choose another --out")
    if (out / MANIFEST).is_file():
        if not overwrite:
            raise DataError(f"--out {out} already holds prepared data: pass --overwrite to replace it, "
                            "or choose another --out")
    elif any(out.iterdir()):
        # Not ours: never delete a folder that is not a prepared DATA_DIR, even with --overwrite.
        raise DataError(f"--out {out} is a non-empty folder without {MANIFEST} (not a prepared data folder): "
                        "choose another --out or remove it yourself")


def _install(tmp: Path, out: Path) -> None:
    """Put the finished folder in place; an earlier OUT is only deleted once the new one is in place."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f"{out.name}.old-{os.getpid()}"
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old)


# ---------------------------------------------------------------- text and byte corpora


def _prepare_corpus(tmp: Path, corpus: str, input_path, kind: str, vocab_size, shard_tokens: int, split_pages: bool,
                    workers: int, tokenizer_from, progress) -> dict:
    tok_dir = tmp / TOKENIZER_DIR
    if kind == "from":
        source = Path(tokenizer_from)
        tok = load_tokenizer(source)  # checks the folder; DataError names it
        tok.save(tok_dir)
    else:
        # A callable: the bytes tokenizer never reads the corpus, so nothing is read for it.
        progress_phase(f"reading {input_path}'s train split and training the {kind} tokenizer")
        tok = train_tokenizer(kind, lambda: read_corpus(corpus, input_path, "train", split_pages), vocab_size, tok_dir)
    one_document_splits = corpus in ("enwik8", "text8") and not split_pages
    pool = None
    if workers > 1 and not one_document_splits:
        pool = multiprocessing.get_context().Pool(workers, initializer=_worker_init, initargs=(str(tok_dir),))
    try:
        splits = {}
        for split in SPLITS:
            progress_phase(f"reading {input_path}'s {split} split")
            documents = read_corpus(corpus, input_path, split, split_pages)
            if pool is None:
                encoded = (_encode(tok, document) for document in documents)
            else:
                encoded = pool.imap(_worker_encode, documents, chunksize=POOL_CHUNK)
            splits[split] = _write(tmp, split, encoded, tok.vocab_size, shard_tokens, progress)
    finally:
        if pool is not None:
            pool.terminate()  # on success every result is in; on failure do not wait for queued documents
            pool.join()
    corpus_entry = {"kind": corpus, "input": str(input_path)}
    if split_pages:
        corpus_entry["split_pages"] = True
    return _manifest(corpus_entry, tok, splits, tokenizer_from)


def _encode(tok, document) -> tuple[np.ndarray, None, str]:
    # Cast to the on-disk dtype here: in a worker it shrinks what travels back to the parent 2-8x.
    return tok.encode_document(document).astype(token_dtype(tok.vocab_size)), None, document.title


_worker_tokenizer = None


def _worker_init(tok_dir: str) -> None:
    global _worker_tokenizer

    _worker_tokenizer = load_tokenizer(Path(tok_dir))


def _worker_encode(document):
    return _encode(_worker_tokenizer, document)


# ---------------------------------------------------------------- algorithmic tasks


def _task_tokenizer(tokenizer_from):
    """None for the bytes tokenizer (the default, or a bytes DATA_DIR/tokenizer), else the backbone's tokenizer."""
    if tokenizer_from is None:
        return None
    tok = load_tokenizer(Path(tokenizer_from))  # checks the folder; DataError names it
    if tok.kind == "bytes":
        return None
    if tok.kind != HF_KIND:
        raise DataError(f"--tokenizer-from {tokenizer_from} is a {tok.kind} tokenizer; --corpus task takes the bytes "
                        "tokenizer (the default) or a Hugging Face backbone's (a model folder with tokenizer.json)")
    return tok


def _prepare_task(tmp: Path, task: str, task_options: dict | None, shard_tokens: int, progress, tok=None,
                  tokenizer_from=None) -> dict:
    options = resolve_options(task, task_options, in_tokens=tok is not None)
    if tok is None:
        tok = train_tokenizer("bytes", [], None, tmp / TOKENIZER_DIR)
        documents = task_documents
    else:
        tok.save(tmp / TOKENIZER_DIR)
        documents = functools.partial(longctx_tokens.token_documents, tokenizer=tok)
    lengths: dict[str, list[int]] = {split: [] for split in SPLITS}

    def measured(split: str):
        for document in documents(task, split, options):
            lengths[split].append(len(document[0]))
            yield document

    splits = {split: _write(tmp, split, measured(split), tok.vocab_size, shard_tokens, progress,
                            total=options["docs"][split])
              for split in SPLITS}
    if progress is not False:
        print(length_report(task, options, lengths, tok.kind))
    # first_target: where a document's targets start (shard_source.Doc.start), read by every stream of the data.
    corpus = {"kind": "task", "input": None, "task": task, "options": options,
              "first_target": 0 if options["predict_first"] else 1}
    if tok.kind == HF_KIND and task in longctx.LONGCTX_TASKS:
        corpus["length_unit"] = "tokens"  # options.length counts the backbone's tokens (bytes when absent)
    return _manifest(corpus, tok, splits, tokenizer_from)


def length_report(task: str, options: dict, lengths: dict[str, list[int]], kind: str = "bytes") -> str:
    """The samples' achieved lengths per split (tokens of the bytes tokenizer, so bytes; or of a backbone's),
    beside the asked length and its tolerance where the task has one (the long-context tasks:
    data_pipeline/longctx.py; in a backbone's tokens, longctx_tokens.py: no fixed tolerance, the minimum shows it)."""
    rows = ", ".join(f"{split} {min(n)} / {np.median(n):g} / {max(n)}" for split, n in lengths.items() if n)
    if kind == HF_KIND:
        asked = f", asked {options['length']}" if task in longctx.LONGCTX_TASKS else ""
        return f"{task}: sample lengths in the backbone's tokens{asked}, min / median / max: {rows}"
    asked = ""
    if task in longctx.LONGCTX_TASKS:
        asked = f", asked {options['length']} (tolerance {longctx.TOLERANCE})"
    return f"{task}: sample lengths in bytes (the bytes tokenizer's tokens){asked}, min / median / max: {rows}"


# ---------------------------------------------------------------- shared


def _write(tmp: Path, split: str, documents: Iterable, vocab_size: int, shard_tokens: int, progress,
           total: int | None = None) -> dict:
    """One split to shards, with progress (documents and tokens done; an ETA when `total` documents is known):
    a bar on a terminal, else a line every 15 s on stderr; progress=False shows nothing."""
    start = time.perf_counter()
    meter = Meter(f"prepare {split}", total=total, unit="doc", enabled=progress is not False)

    def counted(items):
        for item in items:
            meter.update(1, tokens=len(item[0]))
            yield item

    try:
        entry = write_split(tmp, split, counted(documents), vocab_size, shard_tokens)
    finally:
        meter.close(summary=False)  # the command prints every split's totals at the end
    if progress or (progress is None and is_terminal(sys.stderr)):
        print(f"  {split}: {entry['documents']:,} documents, {entry['tokens']:,} tokens, "
              f"{len(entry['shards'])} shard(s) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return entry


def _manifest(corpus_entry: dict, tok, splits: dict, tokenizer_from=None) -> dict:
    tokenizer = {**tok.identity(), "path": TOKENIZER_DIR}
    if tok.kind == HF_KIND:  # where a backbone's tokenizer came from (its hash is the identity's)
        tokenizer["source"] = str(tokenizer_from)
    return {"format": FORMAT_VERSION, "corpus": corpus_entry, "tokenizer": tokenizer, "splits": splits}
