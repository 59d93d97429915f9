"""model.vocab_size from the data's manifest when the user gave none (trainer/config/data_vocab.py, issue 32).

Word-level data (a real `memlm prepare` of a small WikiText-format folder, 40 words) with the tiny presets (256,
for bytes): the preset's value is a default, so the manifest's size wins with one line naming both; a size given
on the command line or in the user's own YAML is theirs, and a mismatch is refused naming both, before any build.
Cost: ~2 s (one prepare, configs only; the README test trains this way through `memlm train`).
"""

from __future__ import annotations

import pytest

from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.prepare import prepare
from memlm.data_pipeline.shards import check_vocab_size, load_manifest
from memlm.trainer.config.data_vocab import load_fitted
from memlm.trainer.config.run_config import ConfigError


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    corpus = root / "wikitext"
    corpus.mkdir()
    body = " ".join(f"w{i}" for i in range(37))  # + "=", <unk> and <eos>: 40 ids
    for split in ("train", "valid", "test"):
        (corpus / f"wiki.{split}.tokens").write_text(f" \n = w0 w1 = \n \n {body} \n")
    prepare("wikitext", corpus, root / "data", workers=1, progress=False)
    assert load_manifest(root / "data")["tokenizer"]["vocab_size"] == 40
    return root


def fitted(config, overrides):
    return load_fitted(config, overrides)


def test_a_presets_vocab_size_gives_way_to_the_datas(words):
    overrides = [f"data.path={words / 'data'}"]
    cfg, note = fitted("tiny/lamemo", overrides)
    assert cfg.model.vocab_size == 40
    assert note == f"model.vocab_size 40 from {words / 'data'}'s word tokenizer (tiny/lamemo says 256)"
    check_vocab_size(load_manifest(words / "data"), cfg.model.vocab_size)  # what the run checks: it fits
    # a file of the user's that inherits the preset and says nothing of the vocabulary: the same
    mine = words / "mine.yaml"
    mine.write_text("inherit: tiny/lamemo\ntrain:\n  steps: 5\n")
    cfg, note = fitted(str(mine), overrides)
    assert cfg.model.vocab_size == 40 and "(tiny/lamemo says 256)" not in note and "says 256" in note


def test_a_vocab_size_the_user_gave_is_kept_and_a_mismatch_refused(words):
    data = words / "data"
    for config, overrides in (("tiny/lamemo", [f"data.path={data}", "model.vocab_size=300"]),
                              (str(words / "given.yaml"), [f"data.path={data}"])):
        (words / "given.yaml").write_text("inherit: tiny/lamemo\nmodel:\n  vocab_size: 300\n")
        cfg, note = fitted(config, overrides)
        assert cfg.model.vocab_size == 300 and note is None
        with pytest.raises(DataError, match="model.vocab_size=300 but the data's word tokenizer has 40 ids"):
            check_vocab_size(load_manifest(data), cfg.model.vocab_size)


def test_matching_or_missing_data_changes_nothing(words, tmp_path):
    cfg, note = fitted("tiny/lamemo", [f"data.path={words / 'data'}", "model.vocab_size=40"])
    assert (cfg.model.vocab_size, note) == (40, None)
    cfg, note = fitted("tiny/lamemo", [f"data.path={tmp_path / 'none'}"])  # the run refuses it, naming data.path
    assert (cfg.model.vocab_size, note) == (256, None)


def test_a_preset_the_datas_size_does_not_fit_is_one_line(words):
    """Adaptive softmax cutoffs written for WikiText-103's 267,735 words cannot serve 40: the line says why."""
    with pytest.raises(ConfigError, match=r"model.vocab_size=40 from .*'s word tokenizer \(paper/wt103/lamemo says "
                                          r"267,735\) does not fit the rest of the config: .*cutoffs"):
        fitted("paper/wt103/lamemo", [f"data.path={words / 'data'}"])
