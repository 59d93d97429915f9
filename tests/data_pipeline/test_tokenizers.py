"""Tokenizers: WikiText token counts and vocabulary, bytes, real sentencepiece training, save/load identity."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

import memlm.data_pipeline.tokenizers as tokenizers
from memlm.data_pipeline.corpora import Document, read_corpus
from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.tokenizers import load_tokenizer, split_long_line, train_tokenizer

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
WIKITEXT2 = DATA / "wikitext-2"
WIKITEXT103_EVAL = DATA / "wikitext-103-eval"


@pytest.fixture(scope="module")
def word_wt2(tmp_path_factory):
    return train_tokenizer("word", read_corpus("wikitext", WIKITEXT2, "train"), None, tmp_path_factory.mktemp("word"))


# ---------------------------------------------------------------- word


def test_wikitext2_vocabulary_has_33278_types_including_eos(word_wt2):
    # 33,277 whitespace types in the train file (<unk> is one of them, it occurs in the text) plus <eos>.
    assert word_wt2.vocab_size == 33_278
    assert word_wt2.vocab[:2] == ["<unk>", "<eos>"]
    assert word_wt2.boundary_id == 1
    assert word_wt2.vocab[2] == "the"  # the most frequent word comes first


@pytest.mark.parametrize(
    "folder, split, tokens",
    [(WIKITEXT2, "train", 2_088_628), (WIKITEXT2, "valid", 217_646), (WIKITEXT2, "test", 245_569),
     (WIKITEXT103_EVAL, "valid", 217_646), (WIKITEXT103_EVAL, "test", 245_569)],
)
def test_wikitext_token_counts_match_published(word_wt2, folder, split, tokens):
    # Published counts = whitespace words + one <eos> per line, blank " " lines included (they give <eos> alone).
    encoded = [word_wt2.encode(d.text) for d in read_corpus("wikitext", folder, split)]
    assert sum(len(ids) for ids in encoded) == tokens
    assert all(ids.dtype == np.int64 for ids in encoded)


def test_wikitext2_valid_and_test_have_no_words_outside_the_train_vocabulary(word_wt2):
    # The only <unk> ids come from the literal <unk> tokens already in the text.
    for split in ("valid", "test"):
        for d in read_corpus("wikitext", WIKITEXT2, split):
            ids = word_wt2.encode(d.text)
            assert (ids == 0).sum() == d.text.split().count("<unk>")


def test_word_vocabulary_order_unknowns_and_lines(tmp_path):
    docs = [Document("a", "b a c\n\nc b"), Document("b", "a <unk> d")]
    tok = train_tokenizer("word", docs, None, tmp_path)
    # counts: a 2, b 2, c 2, d 1 -> ties broken by first occurrence (b, a, c), literal <unk> is not a new type
    assert tok.vocab == ["<unk>", "<eos>", "b", "a", "c", "d"]
    assert tok.encode("a zzz\n\n").tolist() == [3, 0, 1, 1]  # unknown -> <unk>; the blank line is one <eos>
    assert tok.encode("a b").tolist() == tok.encode("a b\n").tolist() == [3, 2, 1]
    assert tok.encode("").tolist() == []
    assert tok.decode(tok.encode("b  a\n c")) == "b a\nc\n"
    capped = train_tokenizer("word", docs, 4, tmp_path / "capped")
    assert capped.vocab == ["<unk>", "<eos>", "b", "a"]


def test_word_tokenizer_reads_byte_documents(tmp_path):
    tok = train_tokenizer("word", [Document("x", data=b"one two\ntwo")], None, tmp_path)
    assert tok.encode_document(Document("y", data=b"two one")).tolist() == [2, 3, 1]
    with pytest.raises(DataError, match="not valid UTF-8"):
        tok.encode_bytes(b"\xff")


# ---------------------------------------------------------------- bytes


def test_bytes_tokenizer_is_the_identity_on_utf8(tmp_path):
    tok = train_tokenizer("bytes", [], None, tmp_path)
    assert (tok.kind, tok.vocab_size, tok.boundary_id) == ("bytes", 256, 10)
    assert tok.encode("é\n").tolist() == [0xC3, 0xA9, 10]
    raw = bytes(range(256))
    assert tok.encode_document(Document("d", data=raw)).tolist() == list(range(256))
    assert tok.decode_bytes(tok.encode_bytes(raw)) == raw
    assert tok.decode(tok.encode("naïve ☃")) == "naïve ☃"


# ---------------------------------------------------------------- sentencepiece

SPM_KINDS = ["spm-unigram", "spm-bpe"]
ODD_TEXT = " = Title = \n  two  spaces\tand a tab \nunicode: naïve 世界 🙂 \x01 control\n\n <unk> last line\n"


def wt2_valid():
    return read_corpus("wikitext", WIKITEXT2, "valid")


@pytest.fixture(scope="module")
def spm_trained(tmp_path_factory):
    """Each kind trained once on WikiText-2 valid (1.1 MB), vocab 1000, in its own folder."""
    return {
        kind: (train_tokenizer(kind, wt2_valid, 1000, folder), folder)
        for kind in SPM_KINDS
        for folder in [tmp_path_factory.mktemp(kind)]
    }


@pytest.mark.parametrize("kind", SPM_KINDS)
def test_spm_round_trips_text_with_one_boundary_per_line(spm_trained, kind):
    tok, _ = spm_trained[kind]
    assert (tok.kind, tok.vocab_size, tok.boundary_id) == (kind, 1000, 1)
    ids = tok.encode(ODD_TEXT)
    assert (ids == tok.boundary_id).sum() == ODD_TEXT.count("\n")
    assert tok.decode(ids) == ODD_TEXT  # identity normalisation + byte fallback: exact, whatever the characters
    for document in read_corpus("wikitext", WIKITEXT2, "test"):
        assert tok.decode(tok.encode(document.text)) == document.text


@pytest.mark.parametrize("kind", SPM_KINDS)
def test_spm_training_is_deterministic(spm_trained, kind, tmp_path):
    # A second training, in another folder, gives the same model bytes and so the same identity.
    first, _ = spm_trained[kind]
    second = train_tokenizer(kind, wt2_valid(), 1000, tmp_path)
    assert second.model == first.model
    assert second.identity() == first.identity()


@pytest.mark.parametrize("kind", SPM_KINDS)
def test_spm_save_load_identity(spm_trained, kind):
    tok, folder = spm_trained[kind]
    assert sorted(p.name for p in folder.iterdir()) == ["spm.model", "tokenizer.json"]
    loaded = load_tokenizer(folder)
    assert loaded.identity() == tok.identity()
    assert loaded.encode(ODD_TEXT).tolist() == tok.encode(ODD_TEXT).tolist()


def test_identities_differ_between_kinds(spm_trained):
    hashes = {spm_trained[kind][0].identity()["sha256"] for kind in SPM_KINDS}
    assert len(hashes) == 2


_rng = random.Random(0)
LONG_LINE_WORDS = sorted({"".join(_rng.choice("abcdefghij") for _ in range(_rng.randint(3, 7))) for _ in range(40)})


def long_lines(seed: int = 0) -> list[str]:
    """30 lines of ~10 KB, each far over sentencepiece's 4,192-byte training limit, from 40 distinct words."""
    rng = random.Random(seed)
    sentence = lambda: " ".join(rng.choice(LONG_LINE_WORDS) for _ in range(12)) + " ."  # noqa: E731
    return [" ".join(sentence() for _ in range(120)) for _ in range(30)]


def test_split_long_line_keeps_every_word_within_the_limit():
    line = long_lines()[0] + " " + "x" * 5000 + " ünïcödé" * 900
    pieces = split_long_line(line)
    assert all(len(piece.encode("utf-8")) <= tokenizers.SPM_MAX_LINE_BYTES for piece in pieces)
    # Only whitespace is dropped at the cuts (the 5,000-byte word is cut between characters): nothing else lost.
    assert "".join("".join(piece.split()) for piece in pieces) == "".join(line.split())
    assert len(pieces) >= len(line.encode("utf-8")) // tokenizers.SPM_MAX_LINE_BYTES
    assert split_long_line("short line") == ["short line"]


def test_long_lines_are_split_before_sentencepiece_sees_them(tmp_path):
    lines = long_lines()
    # The premise: sentencepiece itself drops every one of these lines and has nothing left to train on.
    with pytest.raises(RuntimeError, match="sentences_"):
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=io.BytesIO(), vocab_size=400,
                                       model_type="bpe", byte_fallback=True, minloglevel=2)
    tok = train_tokenizer("spm-bpe", [Document("long", "\n".join(lines))], 400, tmp_path)
    text = lines[0] + "\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # It learned the words that occur only in long lines: most are single pieces, about one id per word.
    learned = [word for word in LONG_LINE_WORDS if tok.processor.piece_to_id("\u2581" + word) != 0]
    assert len(learned) >= 30
    assert len(ids) < 1.2 * (len(text.split()) + 1)


def test_very_long_lines_are_encoded_in_pieces_with_the_same_ids(spm_trained, monkeypatch):
    tok, _ = spm_trained["spm-unigram"]
    line = " ".join(d.text.replace("\n", " ") for d in read_corpus("wikitext", WIKITEXT2, "test"))[:50_000]
    whole = tok.encode(line)
    monkeypatch.setattr(tokenizers, "SPM_ENCODE_CHUNK_CHARS", 1000)
    assert tok.encode(line).tolist() == whole.tolist()
    assert tok.decode(whole) == line + "\n"


# ---------------------------------------------------------------- identities, loading, errors


def test_word_and_bytes_save_load_identity(word_wt2, tmp_path):
    word_wt2.save(tmp_path / "word")
    assert load_tokenizer(tmp_path / "word").identity() == word_wt2.identity()
    assert word_wt2.identity()["kind"] == "word" and word_wt2.identity()["vocab_size"] == 33_278
    byte_tok = train_tokenizer("bytes", [], None, tmp_path / "bytes")
    assert load_tokenizer(tmp_path / "bytes").identity() == byte_tok.identity()


def test_load_errors_name_the_folder(spm_trained, tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(DataError, match=str(missing)):
        load_tokenizer(missing)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(DataError, match="corrupt"):
        load_tokenizer(broken)
    _, folder = spm_trained["spm-bpe"]
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    (tampered / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tampered / "spm.model").write_bytes((folder / "spm.model").read_bytes()[:-10])
    with pytest.raises(DataError, match=f"{tampered}.*sha256"):
        load_tokenizer(tampered)
    (tampered / "spm.model").unlink()
    with pytest.raises(DataError, match="spm.model is missing"):
        load_tokenizer(tampered)
    config = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    (tampered / "tokenizer.json").write_text(json.dumps({**config, "kind": "wordpiece"}), encoding="utf-8")
    with pytest.raises(DataError, match="unknown kind"):
        load_tokenizer(tampered)


def test_training_argument_errors(tmp_path):
    docs = [Document("a", "some text\n")]
    with pytest.raises(DataError, match="--vocab-size"):
        train_tokenizer("spm-bpe", docs, None, tmp_path)
    with pytest.raises(DataError, match="256"):
        train_tokenizer("bytes", docs, 1000, tmp_path)
    with pytest.raises(DataError, match="unknown tokenizer"):
        train_tokenizer("wordpiece", docs, None, tmp_path)
    with pytest.raises(DataError, match="lower --vocab-size"):
        train_tokenizer("spm-unigram", docs, 50_000, tmp_path)


def test_corpus_errors_raised_during_spm_training_keep_their_message(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.txt").write_text("fine text\n", encoding="utf-8")
    (tmp_path / "train" / "b.txt").write_bytes(b"bad \xff byte")
    with pytest.raises(DataError, match="b.txt"):
        train_tokenizer("spm-bpe", read_corpus("textdir", tmp_path, "train"), 300, tmp_path / "tok")
