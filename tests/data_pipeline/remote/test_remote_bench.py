"""bench/benchmarks/bench_remote.py's smoke profile (the tests' tiny corpus read once from a local folder, HTTP and
S3 on loopback, plain and through a proxy with 5 ms a request, prefetch 0 and 2): every case reads the whole split,
the far reads pay the proxy's latency, and the JSON has the form bench/README.md's table is made from. No timing is
asserted beyond the injected latency's floor. About 5 s."""

from __future__ import annotations

import json

from memlm.bench.benchmarks.bench_remote import main
from memlm.data_pipeline.shards import load_manifest


def test_remote_bench_smoke(tmp_path):
    out = tmp_path / "remote_smoke.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    cases = result["cases"]
    expected = {"local"} | {f"{kind} {where}, prefetch {p}" for kind in ("http", "s3") for where in ("loopback", "far")
                            for p in (0, 2)}
    assert set(cases) == expected
    lanes, seg_len = result["config"]["lanes"], result["config"]["seg_len"]
    slots = {row["slots"] for row in cases.values()}
    assert len(slots) == 1 and slots.pop() % (lanes * seg_len) == 0  # every reader read the same batches
    for name, row in cases.items():
        assert row["tokens_per_s"] > 0 and row["headroom"]["h100_class"] > 0, name
        if "far" in name:  # the manifest and the first shard: at least two requests through the proxy's 5 ms
            assert row["first_batch_s_median"] >= 2 * result["config"]["latency_ms"] / 1000, name
    assert result["step"] is None and "provenance" in result and result["machine"]


def test_smoke_corpus_has_several_shards(tmp_path):
    """The smoke reads across shard boundaries (where prefetch matters), not one shard."""
    from memlm.bench.benchmarks.bench_remote import prepare_data

    assert len(load_manifest(prepare_data(tmp_path, smoke=True))["splits"]["train"]["shards"]) >= 3
