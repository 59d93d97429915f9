"""`memlm prepare --tokenizer-from MODEL_FOLDER`: data in a Hugging Face backbone's own tokens (issue 37 item 4).

The backbone is built here: a byte-level BPE trained with the `tokenizers` library on a few hundred WikiText-2
lines, saved beside a tiny random GPT-2 (transformers' save_pretrained). Every expected id comes from the library's
own Tokenizer read from that file, never from memlm's wrapper.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memlm.data_pipeline.format import MANIFEST, DataError
from memlm.data_pipeline.hf_tokenizer import check_backbone_tokenizer
from memlm.data_pipeline.longctx_world import LOCATIONS
from memlm.data_pipeline.prepare import prepare
from memlm.data_pipeline.shards import read_shard, verify_manifest
from memlm.data_pipeline.tokenizers import load_tokenizer
from support.longctx_solver import passkey, read

tokenizers = pytest.importorskip("tokenizers")  # the 'pretrained' extra: the test command installs it
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT2 = ROOT.parent / "shared" / "data" / "wikitext-2"
EOS = "<|endoftext|>"


def train_bpe(lines: list[str], vocab: int) -> "tokenizers.Tokenizer":
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()  # decode gives the text back byte for byte
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def save_backbone(folder: Path, tok) -> Path:
    """A folder as save_pretrained writes it: config.json, model.safetensors, tokenizer.json."""
    eos = tok.token_to_id(EOS)  # 1, not 0: the boundary is read from config.json, not assumed
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_layer=1, n_head=2, n_embd=16,
                                     n_positions=64, bos_token_id=eos, eos_token_id=eos)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def wiki_lines() -> list[str]:
    return (WIKITEXT2 / "wiki.train.tokens").read_text(encoding="utf-8").splitlines()[:400]


@pytest.fixture(scope="module")
def backbone(tmp_path_factory, wiki_lines) -> Path:
    return save_backbone(tmp_path_factory.mktemp("gpt2"), train_bpe(wiki_lines, 500))


def library(folder: Path):
    """The reference: the tokenizers library's own reading of the folder's file."""
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def encode(lib, text: str) -> list[int]:
    return lib.encode(text, add_special_tokens=False).ids


def documents(data_dir: Path, split: str) -> list[dict]:
    manifest = json.loads((data_dir / MANIFEST).read_text())
    return [doc for shard in manifest["splits"][split]["shards"]
            for doc in read_shard(data_dir / shard["path"], shard["sha256"])]


def file_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_corpus_is_the_backbones_encoding_and_records_its_tokenizer(tmp_path, backbone, wiki_lines):
    corpus = tmp_path / "corpus"
    texts = {"train": ["\n".join(wiki_lines[:40]) + "\n", "\n".join(wiki_lines[40:80]) + "\n"],
             "valid": ["\n".join(wiki_lines[80:100]) + "\n"], "test": ["héllo wörld \t tabs\n\nand blank lines\n"]}
    for split, docs in texts.items():
        (corpus / split).mkdir(parents=True)
        for i, text in enumerate(docs):
            (corpus / split / f"{i}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "data"
    run = subprocess.run([sys.executable, "-m", "memlm", "prepare", "--corpus", "textdir", "--input", str(corpus),
                          "--out", str(out), "--tokenizer-from", str(backbone)],  # 2 workers: the pool reloads it
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"tokenizer hf from {backbone}" in run.stdout
    lib = library(backbone)
    for split, docs in texts.items():
        assert [doc["tokens"].tolist() for doc in documents(out, split)] == [encode(lib, text) for text in docs]
    manifest = verify_manifest(out)
    recorded = manifest["tokenizer"]
    content = (backbone / "tokenizer.json").read_bytes()
    assert recorded["kind"] == "hf" and recorded["source"] == str(backbone)
    assert recorded["tokenizer_json_sha256"] == hashlib.sha256(content).hexdigest()
    assert recorded["vocab_size"] == max(lib.get_vocab(with_added_tokens=True).values()) + 1 == 500
    assert recorded["boundary_id"] == lib.token_to_id(EOS) == 1
    # The folder's tokenizer travels with the data, byte for byte; reusing the data's copy gives the same data.
    assert (out / "tokenizer" / "hf-tokenizer.json").read_bytes() == content
    again = tmp_path / "again"
    prepare("textdir", corpus, again, tokenizer_from=out / "tokenizer", workers=1, progress=False)
    assert {k: v for k, v in file_hashes(again).items() if k != MANIFEST} == \
        {k: v for k, v in file_hashes(out).items() if k != MANIFEST}


@pytest.mark.parametrize("task", ["passkey", "qa1"])
def test_long_context_lengths_count_the_backbones_tokens(tmp_path, backbone, task):
    length = 160
    options = {"docs": "24,4,4", "length": length, "seed": 3}
    if task == "qa1":
        options.update(background=str(WIKITEXT2), facts=2)
    out = tmp_path / task
    manifest = prepare("task", None, out, task=task, task_options=options, tokenizer_from=backbone, progress=False)
    assert manifest["corpus"]["length_unit"] == "tokens" and manifest["tokenizer"]["kind"] == "hf"
    lib = library(backbone)
    sep = encode(lib, ">")
    # The prompt's budget: the length less SEP and the longest answer's tokens (the key has 5 digits).
    longest = max(5, *(len(encode(lib, str(d) * 5)) for d in range(10))) if task == "passkey" else \
        max(len(encode(lib, place)) for place in LOCATIONS)
    budget = length - len(sep) - longest
    exact = 0
    for split in ("train", "valid", "test"):
        for doc in documents(out, split):
            ids = doc["tokens"].tolist()
            prompt, answer = lib.decode(ids, skip_special_tokens=False).split(">")
            prompt_ids, answer_ids = encode(lib, prompt), encode(lib, answer)
            assert ids == prompt_ids + sep + answer_ids  # three encodings end to end
            assert doc["mask"].tolist() == [0] * (len(prompt_ids) + len(sep)) + [1] * len(answer_ids)
            assert len(prompt_ids) <= budget and len(ids) <= length
            exact += len(prompt_ids) == budget
            # The story survives: its answer is the one its sentences give.
            assert (passkey(prompt) if task == "passkey" else read(prompt)[0]) == {answer}
    assert exact >= 0.75 * 32, f"{exact} of 32 prompts at exactly {budget} tokens"


def test_the_same_seed_gives_the_same_stories_in_bytes_and_in_tokens(tmp_path, backbone):
    """Tokens change the background's size only: the facts, question and answer are the bytes tokenizer's."""
    options = {"docs": "6,1,1", "length": 400, "seed": 5, "background": str(WIKITEXT2), "facts": 3}
    in_bytes = prepare("task", None, tmp_path / "bytes", task="qa1", task_options=options, progress=False)
    prepare("task", None, tmp_path / "tokens", task="qa1", task_options=options, tokenizer_from=backbone,
            progress=False)
    lib = library(backbone)
    fact = re.compile(r"(?:Mary|John|Sandra|Daniel|Fred|Bill|Julie|Emily) [^.]*\.")
    for a, b in zip(documents(tmp_path / "bytes", "train"), documents(tmp_path / "tokens", "train"), strict=True):
        text_bytes = bytes(a["tokens"].astype(np.uint8)).decode("ascii")
        text_tokens = lib.decode(b["tokens"].tolist(), skip_special_tokens=False)
        assert fact.findall(text_bytes) == fact.findall(text_tokens)
        assert text_bytes.rsplit(" Q: ", 1)[1] == text_tokens.rsplit(" Q: ", 1)[1]
        assert len(text_bytes) >= in_bytes["corpus"]["options"]["length"] - 4  # bytes: the length in bytes


def test_byte_tasks_are_unchanged_by_a_bytes_tokenizer_folder(tmp_path):
    """The bytes tokenizer's folder given with --tokenizer-from is the default: the same files, manifest aside."""
    options = {"docs": "8,2,2", "length": 300}
    prepare("task", None, tmp_path / "default", task="passkey", task_options=options, progress=False)
    prepare("task", None, tmp_path / "from", task="passkey", task_options=options,
            tokenizer_from=tmp_path / "default" / "tokenizer", progress=False)
    assert file_hashes(tmp_path / "from") == file_hashes(tmp_path / "default")
    for doc in documents(tmp_path / "default", "train"):
        assert len(doc["tokens"]) == 300 and doc["tokens"].dtype == np.uint8  # bytes: passkey's keys are 5 long


def test_a_model_folder_without_tokenizer_json_is_one_line(tmp_path, backbone):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((backbone / name).read_bytes())
    run = subprocess.run([sys.executable, "-m", "memlm", "prepare", "--corpus", "task", "--task", "passkey",
                          "--out", str(tmp_path / "out"), "--tokenizer-from", str(folder)],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("memlm: error: ")
    assert f"{folder} is a model folder without tokenizer.json" in run.stderr and "save_pretrained" in run.stderr
    assert not (tmp_path / "out").exists()
    (folder / "vocab.json").write_text("{}")  # a slow tokenizer's files: the line says how to convert them
    with pytest.raises(DataError, match=r"it has vocab.json, which memlm does not read\): convert them there with "
                                        r".*AutoTokenizer"):
        load_tokenizer(folder)


def test_training_refuses_data_of_another_tokenizer_than_the_backbones(tmp_path, backbone, wiki_lines):
    from memlm.trainer.config.data_vocab import load_fitted  # the trainer (torch, deepspeed): this test only
    from memlm.trainer.loop.train import open_trainer

    options = {"docs": "4,1,1", "length": 120}
    own = prepare("task", None, tmp_path / "own", task="passkey", task_options=options, tokenizer_from=backbone,
                  progress=False)
    check_backbone_tokenizer(own, str(backbone), tmp_path / "own")  # its own tokenizer: accepted
    # Another BPE of the same vocabulary size, trained on other lines: only the hash tells them apart.
    other = save_backbone(tmp_path / "other", train_bpe(wiki_lines[200:], 500))
    assert (other / "tokenizer.json").read_bytes() != (backbone / "tokenizer.json").read_bytes()
    with pytest.raises(DataError, match=rf"prepared with another tokenizer.json .*from {re.escape(str(backbone))}\), "
                                        rf"not the backbone {re.escape(str(other))}'s .*--tokenizer-from"):
        check_backbone_tokenizer(own, str(other), tmp_path / "own")
    words = prepare("textdir", _textdir(tmp_path / "corpus"), tmp_path / "words", workers=1, progress=False)
    with pytest.raises(DataError, match=r"prepared with memlm's word tokenizer, not the backbone"):
        check_backbone_tokenizer(words, str(backbone), tmp_path / "words")
    (other / "tokenizer.json").unlink()  # nothing to compare: models/pretrained/checks.py compares vocabularies
    check_backbone_tokenizer(own, str(other), tmp_path / "own")
    # memlm train takes the data's vocabulary before checking it against the backbone's (the preset says 256)...
    overrides = ["model.backbone_config={}", f"data.path={tmp_path / 'own'}", "tracking.enabled=false"]
    cfg, note = load_fitted("tiny/hf", [f"model.backbone={backbone}", *overrides])
    assert cfg.model.vocab_size == 500 and note.endswith("'s hf tokenizer (tiny/hf says 256)")
    # ...and refuses, before anything is set up, data of another tokenizer than the backbone's.
    retrained = save_backbone(tmp_path / "retrained", train_bpe(wiki_lines[100:], 500))
    cfg, _ = load_fitted("tiny/hf", [f"model.backbone={retrained}", *overrides])
    with pytest.raises(DataError, match=f"--tokenizer-from {re.escape(str(retrained))}"):
        open_trainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _textdir(root: Path) -> Path:
    for split in ("train", "valid", "test"):
        (root / split).mkdir(parents=True)
        (root / split / "a.txt").write_text("the cat sat on the mat\n")
    return root
