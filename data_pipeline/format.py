"""The on-disk contract between `memlm prepare` (writer) and the lane streams (reader).

A prepared DATA_DIR holds:
    manifest.json                    written last: a folder without it is not a finished data folder
    tokenizer/                       the tokenizer (tokenizer.json, plus spm.model for sentencepiece or
                                     hf-tokenizer.json, a backbone's own tokenizer.json, for hf)
    {split}/{split}-{k:05d}.tar      webdataset shards, k = 0, 1, ...

One webdataset sample = one document, documents in corpus order, keys:
    __key__      f"{index:09d}"  the document's index within its split (0-based, contiguous over shards)
    tokens.bin   the token ids, raw little-endian, dtype `token_dtype(vocab_size)` (uint8/uint16/uint32)
    mask.bin     optional (algorithmic tasks): uint8 0/1 per token, 1 where the token is scored
    meta.json    {"index": int, "tokens": int, "title": str}  (sorted keys, compact separators)
Tar members carry mtime 0, uid/gid 0, empty owner names and mode 0o644, so the same input gives the same bytes.

manifest.json (sorted keys, indent 2):
    {"format": FORMAT_VERSION,
     "corpus": {"kind": ..., "input": ...},   a task in a backbone's tokens adds "length_unit": "tokens"
     "tokenizer": {"kind": "word"|"bytes"|"spm-unigram"|"spm-bpe"|"hf", "vocab_size": V, "sha256": ...,
                   "boundary_id": id, "path": "tokenizer"},   hf (a backbone's tokenizer.json, hf_tokenizer.py)
                   adds "tokenizer_json_sha256" (of that file's bytes) and "source" (the model folder as given)
     "splits": {split: {"documents": n, "tokens": t,
                        "shards": [{"path": "train/train-00000.tar", "documents": n, "tokens": t,
                                    "first_index": i, "sha256": ..., "bytes": b}, ...]}}}

Token accounting: a document of T tokens contributes T predictions. Its first token is predicted from the
tokenizer's `boundary_id` (WikiText: <eos>, the symbol that ends the line before an article; bytes: "\n"), so
the stream's inputs are [boundary] + doc[:-1] and its targets are doc. Summed over a split this equals the
manifest's `tokens`, which for WikiText-2/103 valid and test are the published counts (217,646 and 245,569).
One exception, named in the manifest: a task corpus prepared with `predict_first` false has `corpus.first_target`
1, and each of its documents gives T - 1 predictions (inputs doc[:-1], targets doc[1:]; shard_source.Doc.start).
"""

from __future__ import annotations

import numpy as np

from memlm.errors import MemlmError

FORMAT_VERSION = "memlm-shards/1"
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "valid", "test")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id of the vocabulary."""
    if vocab_size <= 1 << 8:
        return np.dtype("<u1")
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    return np.dtype("<u4")


def shard_name(split: str, k: int) -> str:
    return f"{split}/{split}-{k:05d}.tar"


def sample_key(index: int) -> str:
    return f"{index:09d}"


class DataError(MemlmError, ValueError):
    """Bad input data (missing file, empty corpus, corrupt shard, ...); the message names the file and the fix."""
