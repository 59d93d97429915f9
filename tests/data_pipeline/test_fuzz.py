"""Fuzzed input (Hypothesis, derandomized: the same examples on every run; small example counts; a SIGALRM guard
turns a hang into a failure). Surfaces: the config loader (random dotted keys, types and values, and random YAML
files), the command line in-process (`memlm config`, `train`, `eval`, `prepare` with random overrides and flag values:
one `memlm: error:` line and exit 2, or success; never a traceback), the corpus readers and the shard reader (random
and truncated bytes: DataError naming the file, never another exception), and data folders whose manifest and
shards disagree. FUZZ_COUNTS records how many examples each surface ran (bench/benchmarks/bench_fault_check.py reports
them).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import string
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlm.cli import main
from memlm.data_pipeline.format import DataError
from memlm.models.config import ConfigError
from support.training import make_data, preset

FUZZ_COUNTS: Counter = Counter()
FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HANG_S = 20  # no single example may take longer: a reader that loops forever fails here instead of stalling CI


@contextlib.contextmanager
def no_hang(seconds: int = HANG_S):
    def fail(signum, frame):  # noqa: ARG001
        raise TimeoutError(f"an example ran past {seconds} s (a hang?)")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("fuzz_data"))


# ---------------------------------------------------------------------------------------------------------------
# Config loader and command line

SECTIONS = ("model", "data", "train", "deepspeed", "tracking", "eval")
KNOWN = ("model.arch", "model.n_layer", "model.mem_len", "model.tgt_len", "model.dropout", "model.cutoffs",
         "model.bptt_depth", "model.bptt_mode", "data.batch_size", "data.path", "data.continuous", "train.steps",
         "train.lr", "train.warmup_steps", "train.max_bad_steps", "train.adam_betas", "train.schedule",
         "deepspeed.zero_stage", "deepspeed.precision", "tracking.enabled", "eval.mem_mult", "eval.tgt_len")
words = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=10)
keys = st.one_of(st.sampled_from(KNOWN), st.builds(lambda s, k: f"{s}.{k}", st.sampled_from(SECTIONS), words),
                 words, st.builds(lambda k: k + ".x", st.sampled_from(KNOWN)))
values = st.one_of(st.integers(-10**12, 10**12).map(str), st.floats(allow_nan=True).map(str),
                   st.sampled_from(["", "null", "true", "[1, 2]", "{a: 1}", "[", "'", "1e400", "-0", "nan", "~",
                                    "txl", "rmt", "chunk", "bf16", "fp16", "[0.9]", "[1, x]", "{", ": :"]),
                   st.text(max_size=12))
override = st.builds(lambda k, v: f"{k}={v}", keys, values)
overrides = st.lists(st.one_of(override, st.text(max_size=8)), min_size=1, max_size=4)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("memlm: error: "), err
    return lines[0]


@settings(FAST, max_examples=150)
@given(overrides=overrides)
def test_config_loader_refuses_bad_overrides_by_name(overrides):
    """load_config with random overrides: a valid RunConfig, or a ConfigError whose one line names an override."""
    from memlm.trainer.config.run_config import load_config

    FUZZ_COUNTS["config overrides"] += 1
    with no_hang():
        try:
            load_config(preset("txl"), overrides)
        except ConfigError as exc:
            message = str(exc)
            assert "\n" not in message and message
            named = ({o.split("=", 1)[0] for o in overrides} | {o.split("=", 1)[0].split(".")[-1] for o in overrides}
                     | {repr(o) for o in overrides})
            assert any(name and name in message for name in named), (overrides, message)


yaml_docs = st.one_of(
    st.text(max_size=80),
    st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
                 lambda children: st.one_of(st.lists(children, max_size=3),
                                            st.dictionaries(st.one_of(st.sampled_from(SECTIONS + ("inherit",)), words),
                                                            children, max_size=3)),
                 max_leaves=8).map(json.dumps))


@settings(FAST, max_examples=100)
@given(document=yaml_docs, extra=st.lists(override, max_size=2))
def test_memlm_config_with_random_yaml_is_one_line_or_a_config(document, extra, tmp_path_factory, capsys):
    FUZZ_COUNTS["config files (memlm config)"] += 1
    path = tmp_path_factory.mktemp("yaml") / "run.yaml"
    path.write_text(document)
    capsys.readouterr()
    with no_hang():
        rc = main(["config", str(path), *extra])
    out, err = capsys.readouterr()
    if rc == 0:
        assert not err.strip() and out
    else:
        assert rc == 2
        one_error_line(err)


@settings(FAST, max_examples=100)
@given(overrides=overrides)
def test_memlm_train_with_random_overrides_is_one_line(overrides, tmp_path_factory, capsys):
    """`memlm train` with random overrides and a data folder that does not exist: whatever is wrong first is one
    line (a config that happens to be valid still stops at the missing data, before any engine is built)."""
    FUZZ_COUNTS["memlm train overrides"] += 1
    out = tmp_path_factory.mktemp("train")
    capsys.readouterr()
    with no_hang():
        rc = main(["train", preset("rmt"), *overrides, f"data.path={out / 'no-data'}", "--out", str(out / "run")])
    assert rc == 2
    one_error_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def run_dir(data, tmp_path_factory):
    from support.training import train_in_process

    out = tmp_path_factory.mktemp("fuzz_run") / "run"
    train_in_process("txl", data, out, train__steps=2, train__save_every=2)
    return out


@settings(FAST, max_examples=15)
@given(flags=st.lists(st.tuples(st.sampled_from(["--tgt-len", "--mem-len", "--mem-mult", "--clamp-len", "--lanes"]),
                                st.one_of(st.integers(-5, 40), st.floats(-3, 12, allow_nan=False))),
                      max_size=3, unique_by=lambda f: f[0]),
       where=st.sampled_from(["run", "missing", "empty", "garbage-config"]))
def test_memlm_eval_with_random_flags_is_one_line_or_a_result(flags, where, run_dir, tmp_path_factory, capsys):
    FUZZ_COUNTS["memlm eval flags"] += 1
    target = run_dir
    if where != "run":
        target = tmp_path_factory.mktemp("evalfuzz") / "x"
        if where != "missing":
            target.mkdir()
        if where == "garbage-config":
            (target / "config.yaml").write_text("model: [1, 2\n")
    argv = ["eval", str(target), "--json", str(tmp_path_factory.mktemp("json") / "r.json")]
    for flag, value in flags:
        argv += [flag, str(int(value)) if flag != "--mem-mult" else str(value)]
    capsys.readouterr()
    with no_hang(60):
        rc = main(argv)
    out, err = capsys.readouterr()
    if rc == 0:
        result = json.loads(out)
        assert result["tokens"] > 0 and result["ppl"] == result["ppl"]  # never a NaN as a result
    else:
        assert rc == 2
        one_error_line(err)


@settings(FAST, max_examples=20)
@given(kind=st.sampled_from(["wikitext", "textdir", "jsonl", "enwik8", "text8", "nope"]),
       tokenizer=st.sampled_from(["bytes", "word", "bpe", "unigram", "nope"]),
       vocab=st.sampled_from([None, "-1", "0", "3", "x"]), where=st.sampled_from(["missing", "empty"]))
def test_memlm_prepare_with_random_settings_is_one_line(kind, tokenizer, vocab, where, tmp_path_factory, capsys):
    FUZZ_COUNTS["memlm prepare settings"] += 1
    root = tmp_path_factory.mktemp("prep")
    source = root / "corpus"
    if where == "empty":
        source.mkdir()
    argv = ["prepare", kind, str(source), "--out", str(root / "out"), "--tokenizer", tokenizer]
    if vocab is not None:
        argv += ["--vocab-size", vocab]
    capsys.readouterr()
    with no_hang():
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's own refusal of a flag value: one line too (memlm.cli.OneLineParser)
            assert exc.code == 2
            one_error_line(capsys.readouterr().err)
            return
    assert rc == 2
    one_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------------------------
# Corpus readers, shard reader, manifest


def _mutate(raw: bytes, how: str, at: int, junk: bytes) -> bytes:
    at = at % (len(raw) + 1)
    if how == "truncate":
        return raw[:at]
    if how == "flip":
        return raw[:at] + junk + raw[at + len(junk):]
    if how == "insert":
        return raw[:at] + junk + raw[at:]
    return junk  # "random"


mutations = dict(how=st.sampled_from(["truncate", "flip", "insert", "random"]), at=st.integers(0, 10**6),
                 junk=st.binary(min_size=1, max_size=64))


def _corpus_file(root: Path, kind: str, split: str) -> Path:
    if kind == "wikitext":
        return root / f"wiki.{split}.tokens"
    if kind == "textdir":
        return root / split / "0.txt"
    if kind == "jsonl":
        return root / f"{split}.jsonl"
    return root / kind


SAMPLES = {"wikitext": b"\n = Title = \n\n Some text here .\n\n = Other = \n\n More @-@ text .\n",
           "textdir": "A document with unicode: caf\u00e9.\n".encode(),
           "jsonl": b'{"text": "one"}\n{"text": "two"}\n', "text8": b"abc def " * 40, "enwik8": b"<page>x</page>" * 30}


@settings(FAST, max_examples=150)
@given(kind=st.sampled_from(sorted(SAMPLES)), **mutations)
def test_corpus_readers_with_damaged_bytes_name_the_file(kind, how, at, junk, tmp_path_factory):
    from memlm.data_pipeline.corpora import read_corpus

    FUZZ_COUNTS["corpus files"] += 1
    root = tmp_path_factory.mktemp("corpus")
    path = _corpus_file(root, kind, "train")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_mutate(SAMPLES[kind], how, at, junk))
    byte_splits = (max(len(path.read_bytes()) - 2, 1), 1, 1)
    with no_hang():
        try:
            for _ in read_corpus(kind, root if kind not in ("text8", "enwik8") else path, "train",
                                 byte_splits=byte_splits):
                pass
        except DataError as exc:
            message = str(exc)
            assert "\n" not in message
            assert str(path) in message or str(root) in message, message


@settings(FAST, max_examples=150)
@given(**mutations)
def test_shard_reader_with_damaged_bytes_names_the_shard(data, how, at, junk, tmp_path_factory):
    from memlm.data_pipeline.shards import read_shard

    FUZZ_COUNTS["shard files"] += 1
    shard = sorted((data / "train").glob("*.tar"))[0]
    path = tmp_path_factory.mktemp("shard") / shard.name
    path.write_bytes(_mutate(shard.read_bytes(), how, at, junk))
    with no_hang():
        try:
            for document in read_shard(path):
                assert document["tokens"].ndim == 1
        except DataError as exc:
            assert str(path) in str(exc) and "\n" not in str(exc), str(exc)


manifest_edits = st.lists(st.tuples(
    st.sampled_from(["bytes", "sha256", "documents", "tokens", "first_index", "path", "split-documents",
                     "split-tokens", "drop-shard", "extra-shard", "format", "splits"]),
    st.one_of(st.integers(-3, 10**6), st.text(max_size=5), st.none(), st.just([]), st.just({}))), min_size=1,
    max_size=3)


def _edit_manifest(manifest: dict, field: str, value) -> None:
    split = manifest["splits"]["train"]
    shard = split["shards"][0]
    if field == "split-documents":
        split["documents"] = value
    elif field == "split-tokens":
        split["tokens"] = value
    elif field == "drop-shard":
        split["shards"] = split["shards"][1:]
    elif field == "extra-shard":
        split["shards"].append(dict(shard, path="train/missing.tar"))
    elif field in ("format", "splits"):
        manifest[field] = value
    else:
        shard[field] = value


@settings(FAST, max_examples=60)
@given(edits=manifest_edits)
def test_a_data_folder_whose_manifest_and_shards_disagree_is_one_line(data, edits, tmp_path_factory):
    """verify_manifest and the training stream over a folder whose manifest was edited at random: DataError (one
    line, naming the folder, its manifest or a shard) or, where the edit changed nothing that matters, data."""
    from memlm.data_pipeline.shards import verify_manifest
    from memlm.data_pipeline.stream import LaneStream

    FUZZ_COUNTS["manifest edits"] += 1
    folder = tmp_path_factory.mktemp("manifest") / "data"
    shutil.copytree(data, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    for field, value in edits:
        train = manifest.get("splits", {}).get("train") if isinstance(manifest.get("splits"), dict) else None
        if isinstance(train, dict) and isinstance(train.get("shards"), list) and train["shards"]:
            _edit_manifest(manifest, field, value)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    for check in (lambda: verify_manifest(folder),
                  lambda: [next(LaneStream(folder, "train", lanes=2, seg_len=8, mode="train")) for _ in range(3)]):
        with no_hang():
            try:
                check()
            except DataError as exc:
                message = str(exc)
                assert "\n" not in message and str(folder) in message, message
