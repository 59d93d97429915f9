"""Writing and reading the webdataset tar shards of a prepared DATA_DIR (the contract is in format.py).

Writer: documents stream in one at a time and go straight into the open tar through a hashing file wrapper, so
memory is bounded by one document and each shard's sha256 is known the moment it closes. Tar members are written
with fixed metadata (mtime 0, uid/gid 0, empty owner names, mode 0o644, ustar headers), so the same documents give
the same bytes on any machine.

Reader: `read_shard` uses webdataset's own grouping of tar members into samples (so it sees a shard exactly as a
webdataset pipeline does) and checks everything it can without the manifest: each sample has its members, its
metadata agrees with its payload, indices are contiguous, and the archive ends with tar's end-of-archive blocks
(tarfile silently stops at a damaged header, which would otherwise look like a shorter, valid shard).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from .format import FORMAT_VERSION, MANIFEST, SPLITS, DataError, sample_key, shard_name, token_dtype
from .remote.fetch import Fetcher
from .remote.location import Location, as_location, is_remote

DEFAULT_SHARD_TOKENS = 50_000_000
_BLOCK = tarfile.BLOCKSIZE  # 512


def _meta_bytes(index: int, tokens: int, title: str) -> bytes:
    return json.dumps({"index": index, "tokens": tokens, "title": title}, sort_keys=True,
                      separators=(",", ":")).encode()


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts the bytes on their way to disk."""

    def __init__(self, f):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._f.write(data)
        self.sha256.update(data)
        self.bytes += len(data)
        return len(data)

    def tell(self) -> int:
        return self.bytes


class _ShardWriter:
    """One open shard: appends documents as tar members, reports its manifest entry when closed."""

    def __init__(self, root: Path, rel_path: str, first_index: int):
        self.rel_path = rel_path
        self.first_index = first_index
        self.documents = 0
        self.tokens = 0
        self._file = open(root / rel_path, "wb")
        self._hashing = _HashingWriter(self._file)
        self._tar = tarfile.open(fileobj=self._hashing, mode="w", format=tarfile.USTAR_FORMAT)

    def _member(self, name: str, payload: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(payload)
        info.mtime = 0
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        self._tar.addfile(info, io.BytesIO(payload))

    def add(self, index: int, tokens: np.ndarray, mask: np.ndarray | None, title: str) -> None:
        key = sample_key(index)
        # Sorted member names, as webdataset's TarWriter writes them.
        if mask is not None:
            self._member(f"{key}.mask.bin", mask.tobytes())
        self._member(f"{key}.meta.json", _meta_bytes(index, len(tokens), title))
        self._member(f"{key}.tokens.bin", tokens.tobytes())
        self.documents += 1
        self.tokens += len(tokens)

    def close(self) -> dict:
        self._tar.close()  # end-of-archive blocks, padded to tar's record size
        self._file.close()
        return {"path": self.rel_path, "documents": self.documents, "tokens": self.tokens,
                "first_index": self.first_index, "sha256": self._hashing.sha256.hexdigest(),
                "bytes": self._hashing.bytes}

    def abort(self) -> None:
        self._file.close()


def _check_document(tokens, mask, title: str, index: int, vocab_size: int, dtype: np.dtype):
    """The document's tokens in the on-disk dtype and its mask as uint8 0/1, or DataError naming it."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise DataError(f"document {index} ({title!r}) has no tokens: a zero-token document cannot be scored; "
                        "drop it from the corpus or fix its text")
    if tokens.dtype.kind not in "iu":
        raise DataError(f"document {index} ({title!r}) has token ids of type {tokens.dtype}, expected integers")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise DataError(f"document {index} ({title!r}) has token id {low if low < 0 else high} outside the "
                        f"vocabulary [0, {vocab_size}): the tokenizer and vocab_size disagree")
    tokens = tokens.astype(dtype, copy=False)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.shape != tokens.shape:
            raise DataError(f"document {index} ({title!r}) has a mask of {mask.size} entries for "
                            f"{len(tokens)} tokens")
        if int(mask.min()) < 0 or int(mask.max()) > 1:
            raise DataError(f"document {index} ({title!r}) has mask values other than 0/1")
        mask = mask.astype(np.uint8, copy=False)
    return tokens, mask


def write_split(out_dir: Path, split: str, documents: Iterable[tuple[np.ndarray, np.ndarray | None, str]],
                vocab_size: int, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> dict:
    """Write one split's documents, in order, as {split}/{split}-{k:05d}.tar; return its manifest entry.

    A shard is closed as soon as it holds at least `shard_tokens` tokens, so shards hold whole documents and
    only the last one is smaller. A split with no documents is a DataError (an empty dataset is always a mistake).
    """
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be >= 1, got {shard_tokens}")
    out_dir = Path(out_dir)
    (out_dir / split).mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    shards: list[dict] = []
    writer: _ShardWriter | None = None
    index = 0
    try:
        for tokens, mask, title in documents:
            tokens, mask = _check_document(tokens, mask, title, index, vocab_size, dtype)
            if writer is None:
                writer = _ShardWriter(out_dir, shard_name(split, len(shards)), first_index=index)
            writer.add(index, tokens, mask, title)
            index += 1
            if writer.tokens >= shard_tokens:
                shards.append(writer.close())
                writer = None
        if writer is not None:
            shards.append(writer.close())
            writer = None
    finally:
        if writer is not None:  # an error mid-split: release the file; the caller discards the folder
            writer.abort()
    if index == 0:
        raise DataError(f"split {split!r} has no documents: check the corpus path and that the split holds data")
    return {"documents": index, "tokens": sum(s["tokens"] for s in shards), "shards": shards}


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _tar_members(tar: tarfile.TarFile, url: str) -> Iterator[dict]:
    """Regular members as webdataset's tar_file_iterator yields them: {"fname", "data", "__url__"}."""
    for info in tar:
        if not info.isreg():
            continue
        data = tar.extractfile(info).read()
        if len(data) != info.size:
            raise DataError(f"shard {url} is truncated inside member {info.name} (re-run `memlm prepare`)")
        yield {"fname": info.name, "data": data, "__url__": url}
        tar.members = []  # streaming: do not keep every header in memory


def _check_end_of_archive(path: Path, offset: int) -> None:
    """tarfile stops quietly at a damaged or missing header; a complete archive has a zero block there."""
    with open(path, "rb") as f:
        f.seek(offset)
        block = f.read(_BLOCK)
    if len(block) != _BLOCK or block.count(0) != _BLOCK:
        raise DataError(f"shard {path} is truncated or corrupt: no valid tar header or end-of-archive marker at "
                        f"byte {offset} (re-run `memlm prepare`)")


def read_shard(path: Path, expected_sha256: str | None = None) -> Iterator[dict]:
    """Yield the shard's documents in order: {"index", "tokens" (np array), "mask" (np uint8 or None), "title"}.

    With expected_sha256 the whole file is hashed before the first document is yielded. Any defect raises
    DataError naming the shard.
    """
    # Imported here: webdataset imports torch (~1 s), which `memlm prepare` (a writer only) does not need.
    from webdataset.tariterators import group_by_keys

    path = Path(path)
    if not path.is_file():
        raise DataError(f"shard {path} is missing (re-run `memlm prepare`)")
    if expected_sha256 is not None:
        digest = file_sha256(path)
        if digest != expected_sha256:
            raise DataError(f"shard {path} has sha256 {digest[:12]}..., the manifest says {expected_sha256[:12]}...: "
                            "the file is corrupt or from another prepare (re-run `memlm prepare`)")
    previous = None
    try:
        with tarfile.open(path, mode="r:") as tar:
            for sample in group_by_keys(_tar_members(tar, str(path))):
                document = _decode_sample(path, sample)
                if previous is not None and document["index"] != previous + 1:
                    raise DataError(f"shard {path}: document {document['index']} follows {previous} "
                                    "(indices must be contiguous)")
                previous = document["index"]
                yield document
            end = tar.offset
    except tarfile.TarError as err:
        raise DataError(f"shard {path} is not a readable tar file ({err}); re-run `memlm prepare`") from err
    if previous is None:
        raise DataError(f"shard {path} holds no documents (re-run `memlm prepare`)")
    _check_end_of_archive(path, end)


def _decode_sample(path: Path, sample: dict) -> dict:
    key = sample["__key__"]
    for member in ("tokens.bin", "meta.json"):
        if member not in sample:
            raise DataError(f"shard {path}: sample {key} has no {member} member (re-run `memlm prepare`)")
    try:
        meta = json.loads(sample["meta.json"])
        index, count, title = int(meta["index"]), int(meta["tokens"]), str(meta["title"])
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"shard {path}: sample {key} has unreadable meta.json ({err})") from err
    raw = sample["tokens.bin"]
    if key != sample_key(index) or count < 1 or len(raw) % count or len(raw) // count not in (1, 2, 4):
        raise DataError(f"shard {path}: sample {key} disagrees with its meta.json (index {index}, {count} tokens, "
                        f"{len(raw)} bytes)")
    tokens = np.frombuffer(raw, dtype=np.dtype(f"<u{len(raw) // count}"))
    mask = None
    if "mask.bin" in sample:
        mask = np.frombuffer(sample["mask.bin"], dtype=np.uint8)
        if len(mask) != count:
            raise DataError(f"shard {path}: sample {key} has a mask of {len(mask)} entries for {count} tokens")
    return {"index": index, "tokens": tokens, "mask": mask, "title": title}


def load_manifest(data_dir: str | os.PathLike) -> dict:
    """manifest.json of a prepared DATA_DIR, with its format checked (no shard is read)."""
    if not str(data_dir).strip():  # an unset data.path: Path("") would name the working folder without saying so
        raise DataError("data.path is not set: prepare a corpus with `memlm prepare ... --out DATA_DIR`, then pass "
                        "data.path=DATA_DIR")
    if is_remote(data_dir):  # the same checks on the manifest fetched from the URL (data_pipeline/remote/)
        location = as_location(data_dir)
        raw = Fetcher(location.options).read_bytes(location.url(MANIFEST))
        return _parse_manifest(lambda: raw.decode(), location.display(MANIFEST))
    if isinstance(data_dir, Location):
        data_dir = data_dir.root
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} is missing: {data_dir} is not a finished data folder (run `memlm prepare`)")
    return _parse_manifest(path.read_text, path)


def _parse_manifest(read, path) -> dict:
    """The manifest `read()` returns, its format checked; `path` names it in messages (a Path or a URL's display)."""
    try:
        manifest = json.loads(read())
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is not readable JSON ({err}); re-run `memlm prepare`") from err
    if not isinstance(manifest, dict):
        raise DataError(f"{path} is not a JSON object; re-run `memlm prepare`")
    if manifest.get("format") != FORMAT_VERSION:
        raise DataError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT_VERSION!r}; "
                        "re-run `memlm prepare` with this version")
    _check_manifest_fields(manifest, path)
    return manifest


def _check_manifest_fields(manifest: dict, path: Path) -> None:
    """The fields readers index into have the types they expect (a hand-edited or damaged manifest is one line,
    never a TypeError deep inside a reader); shard paths stay inside the data folder."""
    def refuse(where: str, what: str, value) -> None:
        raise DataError(f"{path}: {where} must be {what}, got {value!r}; the manifest is damaged or edited "
                        "(re-run `memlm prepare`)")

    def count(where: str, value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            refuse(where, "a whole number >= 0", value)

    if not isinstance(manifest.get("tokenizer"), dict):
        refuse("tokenizer", "an object", manifest.get("tokenizer"))
    splits = manifest.get("splits")
    if not isinstance(splits, dict):
        refuse("splits", "an object", splits)
    for split, entry in splits.items():
        if not isinstance(entry, dict):
            refuse(f"splits.{split}", "an object", entry)
        count(f"splits.{split}.documents", entry.get("documents"))
        count(f"splits.{split}.tokens", entry.get("tokens"))
        if not isinstance(entry.get("shards"), list):
            refuse(f"splits.{split}.shards", "a list", entry.get("shards"))
        for i, shard in enumerate(entry["shards"]):
            where = f"splits.{split}.shards[{i}]"
            if not isinstance(shard, dict):
                refuse(where, "an object", shard)
            for key in ("bytes", "documents", "tokens", "first_index"):
                count(f"{where}.{key}", shard.get(key))
            digest = shard.get("sha256")
            if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
                refuse(f"{where}.sha256", "64 hex digits", digest)
            rel = shard.get("path")
            if not (isinstance(rel, str) and rel.endswith(".tar") and not Path(rel).is_absolute()
                    and ".." not in Path(rel).parts):
                refuse(f"{where}.path", "a .tar path inside the data folder", rel)


def verify_manifest(data_dir: Path) -> dict:
    """Check a prepared DATA_DIR against its manifest (format, every shard's size and sha256, no stray shards).

    Returns the manifest. Reads every shard once (hashing), so it costs one pass over the data.
    """
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    manifest = load_manifest(data_dir)
    splits = manifest.get("splits") or {}
    listed = set()
    for split, entry in splits.items():
        next_index, tokens = 0, 0
        for shard in entry["shards"]:
            shard_path = data_dir / shard["path"]
            listed.add(shard_path.resolve())
            if not shard_path.is_file():
                raise DataError(f"shard {shard_path} listed in {path} is missing (re-run `memlm prepare`)")
            size = shard_path.stat().st_size
            if size != shard["bytes"]:
                raise DataError(f"shard {shard_path} has {size} bytes, {path} says {shard['bytes']}: the file is "
                                "truncated or replaced (re-run `memlm prepare`)")
            if file_sha256(shard_path) != shard["sha256"]:
                raise DataError(f"shard {shard_path} does not match its sha256 in {path}: the file is corrupt "
                                "(re-run `memlm prepare`)")
            if shard["first_index"] != next_index:
                raise DataError(f"{path}: shard {shard['path']} starts at document {shard['first_index']}, "
                                f"expected {next_index}")
            next_index += shard["documents"]
            tokens += shard["tokens"]
        if (next_index, tokens) != (entry["documents"], entry["tokens"]):
            raise DataError(f"{path}: split {split!r} totals ({entry['documents']} documents, {entry['tokens']} "
                            f"tokens) disagree with its shards ({next_index}, {tokens})")
    for split in sorted(set(SPLITS) | set(splits)):
        for tar_path in sorted((data_dir / split).glob("*.tar")):
            if tar_path.resolve() not in listed:
                raise DataError(f"shard {tar_path} is not listed in {path}: a leftover from another prepare? "
                                "Remove it or re-run `memlm prepare --overwrite`")
    tokenizer = manifest.get("tokenizer", {})
    tok_dir = data_dir / tokenizer.get("path", "tokenizer")
    if not tok_dir.is_dir():
        raise DataError(f"tokenizer folder {tok_dir} named in {path} is missing (re-run `memlm prepare`)")
    return manifest


def check_vocab_size(manifest: dict, vocab_size: int, where: str = "model.vocab_size") -> None:
    """Refuse a model whose vocabulary differs from the data's tokenizer, before any training step.

    A smaller model vocabulary would index out of range; a larger one trains silently on a mismatched softmax.
    """
    tokenizer = manifest["tokenizer"]
    if int(tokenizer["vocab_size"]) != vocab_size:
        raise DataError(
            f"{where}={vocab_size} but the data's {tokenizer['kind']} tokenizer has {tokenizer['vocab_size']} ids: "
            f"set {where}={tokenizer['vocab_size']} or prepare the data with the tokenizer the model was built for"
        )
