"""BABILong's own files (data_pipeline/babilong.py, babilong_prepare.py): every layout its hub repositories have used,
written here by the test as the authors' tools write them (pyarrow parquet, json.dump of a list, JSON lines); the
prompt as memlm renders it; BABILong's scoring rule on hand-made outputs; the DATA_DIR `memlm prepare --corpus
babilong` writes; and every bad folder, file or field as one line."""

from __future__ import annotations

import json

import pytest

from memlm.data_pipeline import babilong
from memlm.data_pipeline.format import DataError

ROOMS = ["bathroom", "bedroom", "garden", "hallway", "kitchen", "office"]


def rows(n: int, tag: str) -> list[dict]:
    """n records whose fields say where they came from (tag) and in which order."""
    return [{"input": f"{tag} record {i}. Mary went to the {ROOMS[i % 6]}.", "question": "Where is Mary? ",
             "target": ROOMS[i % 6]} for i in range(n)]


def write_parquet(path, records) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


def write_json(path, records, lines: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) if lines else json.dumps(records)
    path.write_text(text)


@pytest.mark.parametrize("layout", ["length/task-shard.parquet", "task/length-shard.parquet",
                                    "length/task/0000.parquet", "task/length/0000.parquet", "task/length.json",
                                    "data/task/length.json", "data/task/length.json lines", "task/length.jsonl"])
def test_every_layout_reads_its_records_in_order(tmp_path, layout):
    made = {"1k": rows(5, "one"), "16k": rows(3, "sixteen")}
    for label, records in made.items():
        path = tmp_path / layout.split()[0].replace("length", label).replace("task", "qa2").replace(
            "shard", "00000-of-00001")
        if path.suffix == ".parquet":
            write_parquet(path, records)
        else:
            write_json(path, records, lines=layout.endswith("lines") or path.suffix == ".jsonl")
    # Another task beside it, whose name starts like this one's: never read for qa2.
    write_parquet(tmp_path / "1k" / "qa20-00000-of-00001.parquet", rows(2, "other"))
    assert babilong.lengths(tmp_path, "qa2") == ["1k", "16k"]
    for label, records in made.items():
        got = babilong.records(tmp_path, "qa2", label)
        assert [(r.context, r.question, r.target) for r in got] == [
            (r["input"], r["question"], r["target"]) for r in records]
    assert [r.context for r in babilong.records(tmp_path, "qa2", "1k", limit=2)] == [
        "one record 0. Mary went to the bathroom.", "one record 1. Mary went to the bedroom."]


def test_shards_are_read_in_order_and_extra_fields_are_ignored(tmp_path):
    first = [{**r, "answer": "unused"} for r in rows(3, "first")]
    write_parquet(tmp_path / "2k" / "qa1-00001-of-00002.parquet", rows(2, "second"))
    write_parquet(tmp_path / "2k" / "qa1-00000-of-00002.parquet", first)
    got = [r.context.split(" record")[0] for r in babilong.records(tmp_path, "qa1", "2k")]
    assert got == ["first"] * 3 + ["second"] * 2


def test_a_snapshot_with_two_layouts_reads_the_current_one(tmp_path):
    write_parquet(tmp_path / "1k" / "qa1-00000-of-00001.parquet", rows(2, "current"))
    write_parquet(tmp_path / "qa1" / "1k-00000-of-00001.parquet", rows(2, "earlier"))
    assert {r.context.split()[0] for r in babilong.records(tmp_path, "qa1", "1k")} == {"current"}


def test_length_labels_name_thousands_of_tokens():
    assert [babilong.length_tokens(x) for x in ("0k", "1k", "128k", "1M")] == [0, 1000, 128_000, 1_000_000]
    with pytest.raises(DataError, match="BABILong length '1K': give a label such as 0k"):
        babilong.length_tokens("1K")


def test_the_prompt_is_memlms_task_prompt_on_one_printable_line():
    record = babilong.Record("The \u201cold\u201d caf\u00e9 \u2014 closed.\nMary went to the office.  a > b\u2026",
                             "Where is Mary? ", " office\n")
    assert babilong.prompt_of(record) == 'The "old" cafe - closed. Mary went to the office. a b... Q: Where is Mary?'
    assert babilong.printable(record.target) == "office"
    assert babilong.printable("\u4e2d\u6587 text\u00a0here") == "text here"


@pytest.mark.parametrize("output,question,right", [
    ("office", "Where is Mary?", True),
    ("Office. Then the kitchen", "Where is Mary?", True),  # only the first sentence counts, in any case
    ("the office or the kitchen", "Where is Mary?", False),  # two labels: not an answer
    ("kitchen", "Where is Mary?", False),
    ("", "Where is Mary?", False),
    ("office, not the kitchen", "Where was the apple before the kitchen?", True),  # the question's label is ignored
    ("office <context> kitchen", "Where is Mary?", True),  # what it starts to write after a <context> is cut
])
def test_babilongs_rule_wants_the_target_as_the_only_label(output, question, right):
    assert babilong.right("office", output, question, babilong.TASK_LABELS["qa1"]) is right


def test_babilongs_rule_finds_labels_as_substrings():
    # As their compare_answers: "none" also holds "one", so qa7's "none" can never be the only label.
    assert babilong.right("none", "none", "How many apples is Mary carrying?", babilong.TASK_LABELS["qa7"]) is False
    assert babilong.right("two", "two", "How many apples is Mary carrying?", babilong.TASK_LABELS["qa7"]) is True


def test_prepare_writes_a_task_corpus_with_the_answer_masked(tmp_path):
    from memlm.cli import main
    from memlm.data_pipeline.shards import read_shard, verify_manifest

    records = rows(40, "story")
    write_parquet(tmp_path / "bl" / "1k" / "qa1-00000-of-00001.parquet", records)
    out = tmp_path / "data"
    assert main(["prepare", "--corpus", "babilong", "--input", str(tmp_path / "bl"), "--task", "qa1",
                 "--babilong-length", "1k", "--out", str(out)]) == 0
    manifest = verify_manifest(out)
    corpus = manifest["corpus"]
    assert (corpus["kind"], corpus["task"], corpus["length"], corpus["first_target"]) == ("babilong", "qa1", "1k", 0)
    assert corpus["docs"] == {"train": 36, "valid": 2, "test": 2} and manifest["tokenizer"]["kind"] == "bytes"
    seen = []
    for split in ("train", "valid", "test"):
        for shard in manifest["splits"][split]["shards"]:
            for doc in read_shard(out / shard["path"], shard["sha256"]):
                text = bytes(doc["tokens"].tolist()).decode("ascii")
                answer = bytes(doc["tokens"][doc["mask"] == 1].tolist()).decode("ascii")
                seen.append((text, answer))
    # Every record once, in file order, as "<input> Q: <question>>target", the loss on the target only.
    assert seen == [(f"{r['input']} Q: {r['question'].strip()}>{r['target']}", r["target"]) for r in records]


def test_prepare_takes_split_sizes_and_refuses_more_than_the_file_has(tmp_path, capsys):
    from memlm.data_pipeline.babilong_prepare import prepare_babilong

    write_json(tmp_path / "bl" / "qa3" / "0k.json", rows(10, "x"))
    manifest = prepare_babilong(tmp_path / "bl", "qa3", "0k", tmp_path / "d", docs="6,2,2", progress=False)
    assert {s: e["documents"] for s, e in manifest["splits"].items()} == {"train": 6, "valid": 2, "test": 2}
    with pytest.raises(DataError, match=r"asks for 11 records but the file has 10: ask for fewer with --task-docs"):
        prepare_babilong(tmp_path / "bl", "qa3", "0k", tmp_path / "e", docs="7,2,2")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("argv,message", [
    (["--task", "qa1", "--babilong-length", "1k"], "--corpus babilong needs --input DIR: it reads one task"),
    (["--input", "BL", "--task", "qa1"], "needs --babilong-length L"),
    (["--input", "BL", "--task", "qa1", "--babilong-length", "1k", "--tokenizer", "word"],
     "onto the bytes tokenizer: drop --tokenizer"),
    (["--input", "BL", "--task", "qa4", "--babilong-length", "1k"], "has no qa4 file for length 1k (it has no qa4"),
    (["--input", "BL", "--task", "qa1", "--babilong-length", "8k"], "has no qa1 file for length 8k (it has qa1 at 1k)"),
    (["--input", "NOWHERE", "--task", "qa1", "--babilong-length", "1k"], "does not exist: download one with"),
])
def test_prepare_mistakes_are_one_line(tmp_path, capsys, argv, message):
    from memlm.cli import main

    write_parquet(tmp_path / "BL" / "1k" / "qa1-00000-of-00001.parquet", rows(5, "x"))
    argv = [str(tmp_path / a) if a in ("BL", "NOWHERE") else a for a in argv]
    assert main(["prepare", "--corpus", "babilong", *argv, "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memlm: error: ") and message in err and err.count("\n") == 1, err


def test_babilong_length_belongs_to_the_babilong_corpus(tmp_path, capsys):
    from memlm.cli import main

    assert main(["prepare", "--corpus", "task", "--task", "qa1", "--babilong-length", "1k", "--out",
                 str(tmp_path / "d")]) == 2
    assert "--babilong-length applies to --corpus babilong, not to task" in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    ('[{"input": "a", "question": "b"}]', "record 0 has no target (it has input, question; BABILong records have"),
    ('["just text"]', "record 0 is a str, not an object with input, question, target"),
    ('[{"input": "a", "question": "b", "target": " "}]', "record 0 has an empty target"),
    ('[{"input": "a", "question": 3, "target": "x"}]', "record 0's question must be text"),
    ('[{"input": "a", "question": "b", "target": "x"}', "is not valid JSON"),
    ('{"input": "a", "question": "b", "target": "x"}\n{oops}\n', "line 2: not JSON"),
    ("[]", "has no records"),
])
def test_bad_records_are_one_line(tmp_path, content, message):
    (tmp_path / "qa1").mkdir()
    (tmp_path / "qa1" / "1k.json").write_text(content)
    with pytest.raises(DataError) as err:
        babilong.records(tmp_path, "qa1", "1k")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_unreadable_parquet_file_and_an_unknown_task_are_one_line(tmp_path):
    (tmp_path / "1k").mkdir()
    (tmp_path / "1k" / "qa1-00000-of-00001.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="qa1-00000-of-00001.parquet is not a readable parquet file"):
        babilong.records(tmp_path, "qa1", "1k")
    with pytest.raises(DataError, match="BABILong has tasks qa1..qa20, not 'qa21'"):
        babilong.lengths(tmp_path, "qa21")
