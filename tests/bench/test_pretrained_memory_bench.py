"""bench/benchmarks/bench_pretrained_memory.py's smoke profile (a 2-layer width-32 GPT-2, windows k = 0 and 1): every
case is timed and measured, and the memory figures move as window BPTT and per-segment checkpointing say they must.
No timing is asserted. A few seconds on 2 quiet cores (transformers already imported by the pretrained tests)."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")  # the 'pretrained' extra: the test command installs it

from memlm.bench.benchmarks.bench_pretrained_memory import main  # noqa: E402 (after the skip)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "pretrained_memory_smoke.json"
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():  # the script pins its threads and seeds torch: this process's, not theirs
            assert main(["--profile", "smoke", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(out.read_text())


def test_every_case_is_timed_and_measured(smoke):
    names = {row["name"] for row in smoke["cases"]}
    expected = {"bare", "hf k=0", "hf k=0 ckpt"} | {f"{arch} k={k}{ckpt}" for arch in ("hf_rmt", "hf_armt")
                                                    for k in (0, 1) for ckpt in ("", " ckpt")}
    assert names == expected
    for row in smoke["cases"]:
        assert len(row["step_s"]) == len(row["step_wall_s"]) == smoke["config"]["repeats"], row["name"]
        assert min(row["step_s"]) > 0 and min(row["step_wall_s"]) > 0, row["name"]
        assert math.isfinite(row["first_loss"]) and math.isfinite(row["last_loss"]), row["name"]
        assert row["forwards_per_step"] == row["bptt_depth"] + 1
        assert 0 < row["held_bytes"] <= row["peak_bytes"], row["name"]
    assert smoke["provenance"]["command"].startswith("python")


def test_a_longer_window_holds_more_and_checkpointing_holds_less(smoke):
    held = {row["name"]: row["held_bytes"] for row in smoke["cases"]}
    for arch in ("hf_rmt", "hf_armt"):
        # k = 1 keeps the replayed segment's activations for the backward as well as the new one's
        assert held[f"{arch} k=1"] > 1.5 * held[f"{arch} k=0"], held
        # checkpointed, a segment keeps its inputs only; its activations are recomputed in the backward
        assert held[f"{arch} k=1 ckpt"] < 0.5 * held[f"{arch} k=1"], held
        assert smoke["checkpointing"][f"{arch} k=1"]["held_ratio"] == held[f"{arch} k=1 ckpt"] / held[f"{arch} k=1"]


def test_the_overhead_is_read_beside_the_rows_each_memory_adds(smoke):
    cfg = smoke["config"]
    N, R = cfg["seg_len"], cfg["mem_tokens"]
    rows = {"hf": N, "hf_rmt": R + N + R, "hf_armt": N + R}  # [read | tokens | write], [tokens | write]
    for arch, row in smoke["overhead_at_one_segment"].items():
        assert row["rows_ratio"] == rows[arch] / N
        assert row["step_ratio_paired"] > 0 and row["target_met"] == (row["step_ratio_paired"] <= 1.15)
    one_segment = [row for row in smoke["cases"] if row["bptt_depth"] == 0 and not row["segment_checkpointing"]]
    assert sorted(row["name"] for row in one_segment) == ["bare", "hf k=0", "hf_armt k=0", "hf_rmt k=0"]
    assert all(len(row["overhead_step_s"]) == cfg["overhead_rounds"] for row in one_segment)
    assert smoke["overhead_at_one_segment"]["hf"]["fwd_flops_ratio"] == 1.0
    assert min(smoke["overhead_at_one_segment"][arch]["fwd_flops_ratio"] for arch in ("hf_rmt", "hf_armt")) > 1


def test_smoke_needs_its_own_out_and_gpu_needs_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--profile", "smoke"])
    assert refused.value.code == 2 and "--profile smoke needs --out" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--profile", "gpu", "--out", str(tmp_path / "gpu.json")]) == 2
        assert capsys.readouterr().err == ("bench_pretrained_memory: --profile gpu needs a CUDA GPU; this torch sees "
                                           "none\n")
        assert not (tmp_path / "gpu.json").exists()
