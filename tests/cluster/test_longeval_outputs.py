"""`memlm longeval`'s plan and outputs without Ray or training (the slow end-to-end runs are test_longeval.py's): the
BABILong source its flags name, every flag mistake as one line, and the baselines beside every accuracy in the
summary, the CSV, the table and the plot, from results written here by hand."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from memlm.cluster.errors import ClusterError
from memlm.cluster.longeval_outputs import summary, table, write_outputs
from memlm.cluster.longeval_plan import LongRun, source_of
from memlm.data_pipeline.format import DataError


def write_babilong(root: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for label in ("0k", "4k", "1k"):
        (root / label).mkdir(parents=True)
        record = {"input": "Mary went to the office.", "question": "Where is Mary?", "target": "office"}
        pq.write_table(pa.Table.from_pylist([record] * 3), root / label / "qa2-00000-of-00001.parquet")
    return root


def plan(*argv: str):
    from memlm.cli import build_parser

    args = build_parser().parse_args(["longeval", "RUN", *argv])
    return source_of(args, Path("RUN"))


def test_babilong_lengths_default_to_every_one_the_folder_has(tmp_path):
    folder = write_babilong(tmp_path / "bl")
    source = plan("--babilong", str(folder), "--task", "qa2")
    assert (source.labels, source.lengths, source.babilong) == (("0k", "1k", "4k"), (0, 1000, 4000), str(folder))
    assert source.result_name(1) == "babilong-qa2-1k.json" and source.samples is None
    chosen = plan("--babilong", str(folder), "--task", "qa2", "--lengths", "4k,0k", "--samples", "2")
    assert chosen.labels == ("0k", "4k") and chosen.spec(1, None) == {
        "source": "babilong", "folder": str(folder), "task": "qa2", "length": "4k", "samples": 2}


@pytest.mark.parametrize("argv,error,message", [
    (["--depths", "3"], ClusterError, "--babilong scores BABILong's own samples: --depths applies to generated tasks "
                                      "only; drop it"),
    (["--seed", "1", "--split", "valid"], ClusterError, "--seed, --split apply to generated tasks only; drop them"),
    (["--lengths", "2k"], DataError, "has no qa2 file for length 2k (it has qa2 at 0k, 1k, 4k)"),
    (["--lengths", "1024"], DataError, "BABILong length '1024': give a label such as 0k"),
    (["--task", "qa21"], DataError, "BABILong has tasks qa1..qa20, not 'qa21'"),
    (["--task", "qa5"], DataError, "it has no qa5 files at any length"),
    (["--samples", "0"], ClusterError, "--samples must be >= 1, got 0"),
])
def test_babilong_flag_mistakes_are_one_line(tmp_path, argv, error, message):
    folder = write_babilong(tmp_path / "bl")
    argv = argv if "--task" in argv else [*argv, "--task", "qa2"]
    with pytest.raises(error) as raised:
        plan("--babilong", str(folder), *argv)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_task_only_babilong_has_needs_its_files():
    with pytest.raises(ClusterError, match="--task qa7: the generated tasks are qa1, qa2, qa3, passkey; BABILong's "
                                          "qa1..qa20 are read from its files with --babilong DIR"):
        plan("--task", "qa7")


def result(length: int, accuracy: float, floor: list[dict], **extra) -> dict:
    """A result as the Ray task writes it, its baselines the depth cells' weighted mean."""
    cells = [{"depth_min": i / len(floor), "depth_max": (i + 1) / len(floor), "samples": 4, "accuracy": accuracy,
              "baselines": b} for i, b in enumerate(floor)]
    mean = {k: sum(b[k] for b in floor) / len(floor) for k in floor[0]}
    return {"task": "qa1", "length": length, "split": "test", "tgt_len": 64, "mem_len": 64, "arch": "txl", "step": 9,
            "samples": 4 * len(floor), "accuracy": accuracy, "by_depth": cells, "baselines": mean, **extra}


def test_baselines_sit_beside_every_accuracy(tmp_path):
    runs = [LongRun(tmp_path / "a", "a", "txl", 9, 64, ""), LongRun(tmp_path / "b", "b", "rmt", 9, 64, "")]
    b512 = [{"chance": 0.125, "last_mentioned": 0.5}, {"chance": 0.125, "last_mentioned": 0.25}]
    b1k = [{"chance": 0.125, "last_mentioned": 0.75}, {"chance": 0.125, "last_mentioned": 0.25}]
    results = {("a", 512): result(512, 0.5, b512), ("b", 512): result(512, 0.25, b512),
               ("a", 1024): result(1024, 1.0, b1k)}  # b failed at 1k
    settings = {"task": "qa1", "source": "task", "babilong": None, "split": "test", "seed": 0,
                "samples_per_depth": 4, "depths": 2}
    body = summary(settings, [512, 1024], ["512", "1k"], runs, results, {})
    assert body["baselines"] == [{"length": 512, "length_label": "512", "chance": 0.125, "last_mentioned": 0.375},
                                 {"length": 1024, "length_label": "1k", "chance": 0.125, "last_mentioned": 0.5}]
    assert body["runs"]["b"]["missing"] == [1024]
    paths = write_outputs(tmp_path / "out", body)
    assert json.loads(paths["summary"].read_text()) == body
    rows = list(csv.DictReader(paths["csv"].open()))
    assert [(r["run"], r["length_label"], r["depth_min"], r["baseline_chance"], r["baseline_last_mentioned"])
            for r in rows] == [("a", "512", "0.0", "0.125", "0.5"), ("a", "512", "0.5", "0.125", "0.25"),
                               ("a", "1k", "0.0", "0.125", "0.75"), ("a", "1k", "0.5", "0.125", "0.25"),
                               ("b", "512", "0.0", "0.125", "0.5"), ("b", "512", "0.5", "0.125", "0.25")]
    assert all(paths[k].stat().st_size > 0 for k in ("plot", "heatmap:a", "heatmap:b"))
    shown = table(body).splitlines()
    assert shown[1:5] == ["| run | 512 | 1k |", "|---|---|---|", "| a | 50.0% | 100.0% |", "| b | 25.0% | failed |"]
    assert shown[5:7] == ["| baseline: chance (1 / possible answers) | 12.5% | 12.5% |",
                          "| baseline: last answer word mentioned | 37.5% | 50.0% |"]


def test_babilong_outputs_have_no_heatmap_and_say_whose_scoring(tmp_path):
    runs = [LongRun(tmp_path / "a", "a", "txl", 9, 64, "")]
    floor = [{"chance": 1 / 6, "most_frequent": 0.5}]
    results = {("a", 0): result(0, 0.5, floor), ("a", 1000): result(1000, 0.25, floor)}
    settings = {"task": "qa1", "source": "babilong", "babilong": "/data/bl", "split": "babilong", "seed": None,
                "samples_per_depth": None, "depths": 1}
    body = summary(settings, [0, 1000], ["0k", "1k"], runs, results, {})
    paths = write_outputs(tmp_path / "out", body)
    assert set(paths) == {"summary", "csv", "plot"} and paths["plot"].stat().st_size > 0
    shown = table(body)
    assert shown.startswith("BABILong qa1 accuracy by length (BABILong's labels and scoring; /data/bl):")
    assert "| a | 50.0% | 25.0% |" in shown and "| baseline: most frequent answer word | 50.0% | 50.0% |" in shown
