"""`memlm curriculum` and `memlm longeval` on a backbone whose folder has its own tokenizer.json (issue 37 item 5):
the task samples are made in its tokens, every length counted in them, as `memlm prepare --tokenizer-from FOLDER`
makes them; a backbone without one keeps bytes (tests/trainer/loop/test_curriculum.py).

The backbone is a tiny random GPT-2 with a BPE of 300 ids trained here on WikiText-2 lines (no hub). The references
read the samples with the `tokenizers` library itself, and place a sample's fact by decoding its tokens one at a time
(a byte-level BPE's tokens decode to the text's pieces), not by memlm's search. Passkey at 80 tokens a segment is
refused in bytes (its samples need 91 bytes at least), so these runs cannot pass on bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from memlm.cli import main
from support.hf_backbone import gpt2_folder, train_bpe, wiki_lines

pytest.importorskip("transformers")  # the 'pretrained' extra: the test command installs it
tokenizers = pytest.importorskip("tokenizers")

N = 80  # tokens a segment: passkey needs 91 bytes, so bytes are refused at this length
VOCAB = 300


def library(folder):
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def encode(lib, text: str) -> list[int]:
    return lib.encode(text, add_special_tokens=False).ids


def reference_apart(lib, ids: list[int], answer_len: int) -> int:
    """Segments from the token holding the key's last mention in the prompt to the answer's first token (passkey)."""
    pieces = [lib.decode([token]) for token in ids]
    answer = "".join(pieces[len(ids) - answer_len:])
    sep = len(encode(lib, ">"))
    prompt = "".join(pieces[:len(ids) - answer_len - sep])
    fact = prompt.rpartition(" Q: ")[0].rfind(answer)
    ends = np.cumsum([len(p) for p in pieces])
    fact_token = int(np.searchsorted(ends, fact, side="right"))  # the token whose text holds character `fact`
    return (len(ids) - answer_len) // N - (fact_token + 1) // N + 1


@pytest.fixture(scope="module")
def curriculum(tmp_path_factory):
    root = tmp_path_factory.mktemp("backbone_tokens")
    folder = gpt2_folder(root / "gpt2", train_bpe(wiki_lines(), VOCAB), n_positions=128)
    out = root / "cur"
    command = ["curriculum", "tiny/hf_rmt", f"model.backbone={folder}", "model.backbone_config={}",
               f"model.tgt_len={N}", "train.warmup_steps=0", "tracking.enabled=false", "--task", "passkey",
               "--segments", "1,2", "--steps", "2", "--check-every", "2", "--check-samples", "2", "--docs", "12,3,3",
               "--out", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(command) == 0
    return SimpleNamespace(root=root, folder=folder, out=out, command=command, printed=printed.getvalue())


def test_the_curriculum_makes_its_samples_in_the_backbones_tokens(curriculum):
    printed = curriculum.printed
    assert f"model.vocab_size {VOCAB} from {curriculum.folder}'s tokenizer.json (tiny/hf_rmt says 256)" in printed
    lib = library(curriculum.folder)
    from memlm.trainer.loop.curriculum_samples import read_split

    for count in (1, 2):
        data = curriculum.out / "data" / f"passkey-{count}seg"
        manifest = json.loads((data / "manifest.json").read_text())
        assert manifest["tokenizer"]["kind"] == "hf" and manifest["corpus"]["options"]["length"] == count * N
        samples = read_split(data, "train")
        for tokens, answer_len in samples:
            ids = tokens.tolist()
            text = lib.decode(ids)
            prompt, _, answer = text.rpartition(">")
            assert ids == encode(lib, prompt) + encode(lib, ">") + encode(lib, answer)  # three encodings end to end
            assert answer_len == len(encode(lib, answer)) and len(ids) <= count * N
        record = json.loads((curriculum.out / f"stage{count - 1}-{count}seg" / "curriculum_stage.json").read_text())
        want = Counter(str(reference_apart(lib, t.tolist(), a)) for t, a in samples)
        assert record["data"]["fact_segments_apart"] == dict(want) and record["step"] == 2
        assert record["data"]["length"]["max"] <= count * N
    assert re.search(r"stage 1 \(2 segment\(s\) of 80\): samples of 160 tokens", printed), printed
    assert re.search(r"12 samples of \d+-\d+ tokens", printed), printed


def test_longeval_scores_the_run_on_samples_in_its_tokens(curriculum):
    from memlm.cluster.longeval_plan import source_of
    from memlm.trainer.inference.longeval import cell_docs, evaluate_length

    run = curriculum.out / "stage1-2seg"
    args = argparse.Namespace(babilong=None, lengths="80,160", depths=1, samples=3, task=None, background=None,
                              seed=None, split=None)
    source = source_of(args, run)  # 80 is under passkey's byte floor: accepted because it counts tokens
    assert source.task == "passkey" and source.lengths == (80, 160)
    result = evaluate_length(run, "passkey", source.options, N, depths=1, samples=3)
    assert result["samples"] == 3 and result["length"] == N and 0.0 <= result["accuracy"] <= 1.0
    lib = library(curriculum.folder)
    from memlm.data_pipeline.tokenizers import load_tokenizer

    docs, pairs = cell_docs("passkey", source.options, N, (0.0, 1.0), 3, 0, "test",
                            load_tokenizer(curriculum.out / "data" / "passkey-2seg" / "tokenizer"))
    for (ids, answer_len), (prompt, answer) in zip(docs, pairs):
        assert ids.tolist() == encode(lib, prompt) + encode(lib, ">") + encode(lib, answer)
        assert answer_len == len(encode(lib, answer)) and len(ids) <= N


def test_tokens_too_few_for_the_story_are_one_line_before_anything_is_made(curriculum, tmp_path, capsys):
    out = tmp_path / "cur"
    command = [c if c != f"model.tgt_len={N}" else "model.tgt_len=8" for c in curriculum.command]
    command[command.index("--out") + 1] = str(out)
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "curriculum stage 0 (1 segment(s) of 8 tokens): passkey:" in err, err
    assert "give a larger model.tgt_len" in err and not out.exists()
