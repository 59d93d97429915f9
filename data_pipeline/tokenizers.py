"""Tokenizers: word (WikiText parity), bytes (enwik8/text8), sentencepiece unigram and BPE.

Lines. Text is a sequence of lines, each ended by "\n" or by the end of the text. The word and sentencepiece
tokenizers encode each line as its tokens followed by the boundary id (<eos> / the sentencepiece eos), so one
boundary per line, blank lines included: this is the WikiText convention that gives the published token counts
(WikiText-2 train 2,088,628 = words + one <eos> for each of the 36,718 lines, of which 12,951 are blank " ").
"a b" and "a b\n" both encode to [a, b, <eos>]; decode writes "\n" for each boundary, so decode(encode(x)) == x
for sentencepiece text that ends in "\n" (word decoding normalises spacing to single spaces).
The bytes tokenizer is the identity on UTF-8 bytes; its boundary is "\n" (10).
A Hugging Face backbone's own tokenizer.json is read by data_pipeline/hf_tokenizer.py (kind "hf", never trained
here: `load_tokenizer` takes the model folder).

Files. `save(directory)` writes tokenizer.json (and spm.model for sentencepiece). `identity()` hashes exactly
those bytes: sha256 over the files in name order, each as name, NUL, length (decimal), NUL, content.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece as spm

from .corpora import Document
from .format import DataError

TOKENIZER_KINDS = ("word", "bytes", "spm-unigram", "spm-bpe")
TOKENIZER_FORMAT = "memlm-tokenizer/1"
TOKENIZER_JSON = "tokenizer.json"
SPM_MODEL = "spm.model"

UNK, EOS = "<unk>", "<eos>"

# sentencepiece 0.2.3 silently drops training lines longer than max_sentence_length (4,192 bytes by default);
# longer lines are cut on sentence, then whitespace, then character boundaries to at most this many bytes.
SPM_MAX_LINE_BYTES = 4096
# Encoding one huge line (text8 is a single 100 MB line) in one call builds a huge lattice; such lines are
# encoded in pieces cut at a space, which gives the same ids (pieces never cross a whitespace boundary).
SPM_ENCODE_CHUNK_CHARS = 1 << 20
# Part of the model file (trainer_spec), so fixed: a machine-dependent thread count would change the bytes.
SPM_TRAIN_THREADS = 8


def _lines(text: str) -> list[str]:
    """The lines of `text` without their "\n"; a final "\n" ends the last line rather than starting a new one."""
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def _document_text(document: Document) -> str:
    if document.text is not None:
        return document.text
    if document.data is None:
        raise DataError(f"document {document.title!r} has neither text nor data")
    try:
        return document.data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"document {document.title!r}: byte {e.start} is not valid UTF-8, so it has no text for a word or "
            "sentencepiece tokenizer: use --tokenizer bytes for a byte corpus"
        ) from None


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


class Tokenizer:
    """Base class. Subclasses set kind, vocab_size, boundary_id and implement encode, decode and _files."""

    kind: str
    vocab_size: int
    boundary_id: int

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Encode raw bytes (byte corpora). Text tokenizers need them to be UTF-8."""
        return self.encode(_document_text(Document(title="<bytes>", data=data)))

    def encode_document(self, document: Document) -> np.ndarray:
        """Encode a Document whichever of text/data it carries."""
        if document.data is not None:
            return self.encode_bytes(document.data)
        return self.encode(_document_text(document))

    def decode(self, ids) -> str:
        raise NotImplementedError

    def _files(self) -> dict[str, bytes]:
        """File name -> the exact bytes `save` writes."""
        raise NotImplementedError

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, content in self._files().items():
            partial = directory / (name + ".partial")
            partial.write_bytes(content)
            partial.replace(directory / name)  # a crash never leaves a half-written file under the real name

    def identity(self) -> dict:
        digest = hashlib.sha256()
        for name, content in sorted(self._files().items()):
            digest.update(name.encode() + b"\0" + str(len(content)).encode() + b"\0" + content)
        return {"kind": self.kind, "vocab_size": self.vocab_size, "sha256": digest.hexdigest(),
                "boundary_id": self.boundary_id}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size}, "
                f"boundary_id={self.boundary_id})")


# ---------------------------------------------------------------- word


class WordTokenizer(Tokenizer):
    """Whitespace words, <unk> = 0, <eos> = 1, then the training words by descending count, ties in order of first
    occurrence. Words outside the vocabulary (and the literal word <unk>) map to <unk>."""

    kind = "word"

    def __init__(self, vocab: list[str]):
        if len(vocab) < 2 or vocab[0] != UNK or vocab[1] != EOS:
            raise ValueError("a word vocabulary starts with <unk>, <eos>")
        self.vocab = vocab
        self.index = {word: i for i, word in enumerate(vocab)}
        if len(self.index) != len(vocab):
            raise ValueError("word vocabulary has duplicates")
        self.vocab_size = len(vocab)
        self.unk_id = 0
        self.boundary_id = 1

    @classmethod
    def train(cls, documents: Iterable[Document], vocab_size: int | None) -> WordTokenizer:
        counts: Counter[str] = Counter()
        for document in documents:
            for line in _lines(_document_text(document)):
                counts.update(line.split())
        counts.pop(UNK, None)
        counts.pop(EOS, None)
        # Counter keeps first-insertion order and sorted() is stable, so ties stay in order of first occurrence.
        words = [word for word, _ in sorted(counts.items(), key=lambda item: -item[1])]
        if vocab_size is not None:
            if vocab_size < 3:
                raise DataError(f"--vocab-size {vocab_size} is too small for a word vocabulary (<unk>, <eos>, words)")
            words = words[: vocab_size - 2]
        if not words:
            raise DataError("the training split has no words: a word vocabulary needs text")
        return cls([UNK, EOS] + words)

    def encode(self, text: str) -> np.ndarray:
        get, unk, eos = self.index.get, self.unk_id, self.boundary_id
        ids: list[int] = []
        for line in _lines(text):
            ids.extend([get(word, unk) for word in line.split()])
            ids.append(eos)
        return np.array(ids, dtype=np.int64)

    def decode(self, ids) -> str:
        out: list[str] = []
        words: list[str] = []
        for i in np.asarray(ids, dtype=np.int64).tolist():
            if i == self.boundary_id:
                out.append(" ".join(words) + "\n")
                words = []
            else:
                words.append(self.vocab[i])
        if words:
            out.append(" ".join(words))
        return "".join(out)

    def _files(self) -> dict[str, bytes]:
        return {TOKENIZER_JSON: _json_bytes({
            "format": TOKENIZER_FORMAT, "kind": self.kind, "vocab_size": self.vocab_size,
            "boundary_id": self.boundary_id, "unk_id": self.unk_id, "vocab": self.vocab,
        })}


# ---------------------------------------------------------------- bytes


class ByteTokenizer(Tokenizer):
    """ids = the bytes themselves (text as UTF-8); the boundary before a document is "\n"."""

    kind = "bytes"
    vocab_size = 256
    boundary_id = 10

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode_bytes(self, ids) -> bytes:
        return np.asarray(ids, dtype=np.int64).astype(np.uint8).tobytes()

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def _files(self) -> dict[str, bytes]:
        return {TOKENIZER_JSON: _json_bytes({
            "format": TOKENIZER_FORMAT, "kind": self.kind, "vocab_size": self.vocab_size,
            "boundary_id": self.boundary_id,
        })}


# ---------------------------------------------------------------- sentencepiece


def split_long_line(line: str, limit: int = SPM_MAX_LINE_BYTES) -> list[str]:
    """Cut a line into pieces of at most `limit` UTF-8 bytes: at sentence ends where possible, else at whitespace,
    else between characters. Used only for training input; the whitespace at a cut is dropped."""
    if len(line.encode("utf-8")) <= limit:
        return [line]
    units: list[str] = []  # sentences, or words of over-long sentences, or slices of over-long words
    for sentence in re.split(r"(?<=[.!?])\s+", line):
        if len(sentence.encode("utf-8")) <= limit:
            units.append(sentence)
            continue
        for word in sentence.split():
            while len(word.encode("utf-8")) > limit:
                head = word.encode("utf-8")[:limit].decode("utf-8", errors="ignore") or word[0]  # whole characters
                units.append(head)
                word = word[len(head):]
            units.append(word)
    pieces: list[str] = []
    current, current_bytes = "", 0
    for unit in units:
        size = len(unit.encode("utf-8"))
        if current and current_bytes + 1 + size <= limit:
            current, current_bytes = current + " " + unit, current_bytes + 1 + size
        else:
            if current:
                pieces.append(current)
            current, current_bytes = unit, size
    if current:
        pieces.append(current)
    return [piece for piece in pieces if piece.strip()]


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model with identity normalisation (text round-trips exactly), byte fallback (any text
    encodes), <unk> = 0, eos = 1 (the boundary, one per line), no bos/pad."""

    def __init__(self, kind: str, model: bytes):
        self.kind = kind
        self.model = model
        self.processor = spm.SentencePieceProcessor(model_proto=model)
        self.vocab_size = self.processor.get_piece_size()
        self.boundary_id = self.processor.eos_id()
        if self.boundary_id < 0:
            raise DataError("the sentencepiece model has no eos piece; memlm trains its models with eos_id=1")

    @classmethod
    def train(cls, kind: str, documents: Iterable[Document], vocab_size: int | None) -> SentencePieceTokenizer:
        if vocab_size is None:
            raise DataError(f"--tokenizer {kind} needs --vocab-size (e.g. 8000 or 32000)")
        failure: list[BaseException] = []

        def sentences() -> Iterator[str]:
            # An exception raised inside sentencepiece's C++ loop would lose its message; keep it and re-raise.
            try:
                for document in documents:
                    for line in _lines(_document_text(document)):
                        if line.strip():
                            yield from split_long_line(line)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                failure.append(e)

        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences(),
                model_writer=model,  # no model_prefix: a path would be recorded in the model and change its bytes
                model_type=kind.removeprefix("spm-"),
                vocab_size=vocab_size,
                byte_fallback=True,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                unk_id=0, eos_id=1, bos_id=-1, pad_id=-1,
                input_sentence_size=0,  # all sentences, no sampling
                shuffle_input_sentence=False,
                num_threads=SPM_TRAIN_THREADS,
                minloglevel=2,
            )
        except RuntimeError as e:
            if failure:
                raise failure[0] from None
            raise DataError(f"sentencepiece training failed: {e}; if the vocabulary is too large for the "
                            "training text, lower --vocab-size") from None
        if failure:
            raise failure[0]
        return cls(kind, model.getvalue())

    def _encode_line(self, line: str) -> list[int]:
        if len(line) <= SPM_ENCODE_CHUNK_CHARS:
            return self.processor.encode(line)
        ids: list[int] = []
        start = 0
        while start < len(line):
            end = min(start + SPM_ENCODE_CHUNK_CHARS, len(line))
            if end < len(line):
                cut = line.rfind(" ", start + 1, end)
                end = cut if cut > start else end  # no space at all: a hard cut is the best there is
            ids.extend(self.processor.encode(line[start:end]))
            start = end + 1 if end < len(line) and line[end] == " " else end
        return ids

    def encode(self, text: str) -> np.ndarray:
        ids: list[int] = []
        for line in _lines(text):
            ids.extend(self._encode_line(line))
            ids.append(self.boundary_id)
        return np.array(ids, dtype=np.int64)

    def decode(self, ids) -> str:
        out: list[str] = []
        line: list[int] = []
        for i in np.asarray(ids, dtype=np.int64).tolist():
            if i == self.boundary_id:
                out.append(self.processor.decode(line) + "\n")
                line = []
            else:
                line.append(i)
        if line:
            out.append(self.processor.decode(line))
        return "".join(out)

    def _files(self) -> dict[str, bytes]:
        return {
            TOKENIZER_JSON: _json_bytes({
                "format": TOKENIZER_FORMAT, "kind": self.kind, "vocab_size": self.vocab_size,
                "boundary_id": self.boundary_id, "model": SPM_MODEL,
                "model_sha256": hashlib.sha256(self.model).hexdigest(),
            }),
            SPM_MODEL: self.model,
        }


# ---------------------------------------------------------------- train and load


def train_tokenizer(
    kind: str,
    documents: Iterable[Document] | Callable[[], Iterable[Document]],
    vocab_size: int | None,
    workdir: Path,
) -> Tokenizer:
    """Train a tokenizer on the train split and save it into `workdir` (tokenizer.json, spm.model).

    `documents` is iterated at most once (bytes: not at all); a zero-argument callable returning the documents is
    accepted too. `vocab_size`: required for sentencepiece; optional for word (keep the most frequent words);
    None or 256 for bytes."""
    if kind not in TOKENIZER_KINDS:
        raise DataError(f"unknown tokenizer {kind!r}: use one of {', '.join(TOKENIZER_KINDS)}")
    if callable(documents):
        documents = documents()
    if kind == "bytes":
        if vocab_size not in (None, 256):
            raise DataError(f"the bytes tokenizer has 256 ids; drop --vocab-size {vocab_size}")
        tokenizer: Tokenizer = ByteTokenizer()
    elif kind == "word":
        tokenizer = WordTokenizer.train(documents, vocab_size)
    else:
        tokenizer = SentencePieceTokenizer.train(kind, documents, vocab_size)
    tokenizer.save(Path(workdir))
    return tokenizer


def load_tokenizer(directory: Path) -> Tokenizer:
    """Load what `save` wrote, or a Hugging Face model folder's own tokenizer.json (data_pipeline/hf_tokenizer.py);
    a missing, corrupt or mismatched folder raises DataError naming it."""
    from . import hf_tokenizer  # a cycle: hf_tokenizer's tokenizer subclasses Tokenizer

    directory = Path(directory)
    config_path = directory / TOKENIZER_JSON
    fix = "prepare the data again (memlm prepare) or point at the DATA_DIR/tokenizer folder"
    if not config_path.is_file():
        raise DataError(hf_tokenizer.missing_tokenizer_line(directory)
                        or f"tokenizer folder {directory} has no {TOKENIZER_JSON}: {fix}, or at a Hugging Face model "
                        f"folder with its {TOKENIZER_JSON}")
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
        if isinstance(config, dict) and hf_tokenizer.is_hf_tokenizer_json(config):
            return hf_tokenizer.from_backbone(directory)  # DataError naming the folder when it cannot be read
        kind = config["kind"]
        vocab_size = config["vocab_size"]
        boundary_id = config["boundary_id"]
        if config.get("format") != TOKENIZER_FORMAT:
            raise ValueError(f"format {config.get('format')!r}, expected {TOKENIZER_FORMAT!r}")
        if kind == "word":
            tokenizer: Tokenizer = WordTokenizer(list(config["vocab"]))
        elif kind == "bytes":
            tokenizer = ByteTokenizer()
        elif kind in ("spm-unigram", "spm-bpe"):
            model_path = directory / config["model"]
            if not model_path.is_file():
                raise ValueError(f"{model_path.name} is missing")
            model = model_path.read_bytes()
            if hashlib.sha256(model).hexdigest() != config["model_sha256"]:
                raise ValueError(f"{model_path.name} does not match the sha256 recorded in {TOKENIZER_JSON}")
            tokenizer = SentencePieceTokenizer(kind, model)
        elif kind == hf_tokenizer.KIND:
            tokenizer = hf_tokenizer.from_saved(directory, config)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except (ValueError, KeyError, TypeError, RuntimeError, UnicodeDecodeError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"tokenizer folder {directory} is corrupt ({type(e).__name__}: {e}): {fix}") from None
    if (tokenizer.vocab_size, tokenizer.boundary_id) != (vocab_size, boundary_id):
        raise DataError(
            f"tokenizer folder {directory} is corrupt: {TOKENIZER_JSON} says vocab_size={vocab_size}, "
            f"boundary_id={boundary_id} but the tokenizer has {tokenizer.vocab_size}, {tokenizer.boundary_id}: {fix}"
        )
    return tokenizer
