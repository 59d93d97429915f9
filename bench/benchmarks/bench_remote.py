"""Does a remote reader keep the trainer fed? LaneStream tokens/s from a local folder, HTTP and S3 on loopback.

    .venv/bin/python bench/benchmarks/bench_remote.py                  # -> bench/results/remote_cpu.json
    .venv/bin/python bench/benchmarks/bench_remote.py --smoke --out /tmp/remote_smoke.json   # seconds, for the tests

WikiText-2 (../shared/data/wikitext-2) is prepared with the bytes tokenizer into a temporary folder in 1M-token
shards (11 train shards, 10.8 MB), then served by the test suite's loopback servers (imported as
memlm.tests.support: a checkout's folders are memlm.*), tests/support/http_shards.py's ShardServer (HTTP with Range)
and tests/support/s3_server.py's moto server (S3, read through s3fs), in this process. Each is read
plainly and "far": through a FaultProxy that waits `--latency-ms` before every request and paces every body to
`--mbit` (per connection). Each remote reader runs with data.remote.prefetch 0 (a shard fetched when the stream
reaches it) and 2 (the next two fetched while this one is read). One timing: a fresh LaneStream (8 lanes x 512
tokens, training order, no cache) reads the train split's tokens once; tokens/s counts batch slots, as
bench_stream.py and the trainer's tokens/s do. Cases run interleaved (every case once per repeat), medians reported;
also the time to the first batch (manifest and first shard, once per run) and the longest wait for a later batch (a
shard boundary without prefetch), which a training step would see as a stall.

Paced: a consumer that spends an H100-class step's time per batch (8 x 512 tokens at 265,573 tokens/s: 15.4 ms,
slept as a process waits on its GPU) reads --paced-tokens from each far reader; its time waiting for data after the
first batch is what the trainer would lose. The rates it is read against: `memlm train tiny/txl` on this machine at
8 lanes x 128 (its median tokens/s after two warm-up steps), and an H100-class step at 265,573 tokens/s
(bench/README.md's speed ledger: txl 64 lanes, triton attention).
Never part of the test suite; nothing here asserts a timing (tests/data_pipeline/remote/test_remote_bench.py runs
--smoke: a tiny corpus read once, one repeat, 5 ms latency, no training step).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from memlm.bench.common import RESULTS, WIKITEXT2, child_env, write_result
from memlm.bench.interrupt import stop_in_one_line

H100_TOKENS_PER_S = 265_573  # bench/README.md's ledger: txl 64 lanes, model scope, attention: triton (b61868e)
BUCKET, PREFIX = "memlm-bench", "wikitext-2"
LANES, SEG_LEN = 8, 512


def machine() -> str:
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'}, {len(names)} cores"


def prepare_data(root: Path, smoke: bool) -> Path:
    from memlm.data_pipeline.prepare import prepare

    if smoke:  # the test suite's tiny corpus: seconds, several shards
        from memlm.tests.support.training import make_data

        return make_data(root, shard_tokens=1000)
    out = root / "data"
    # workers=1: a pool forked under stop_in_one_line inherits its SIGTERM handler, and terminate() then hangs
    prepare("wikitext", WIKITEXT2, out, tokenizer="bytes", shard_tokens=1_000_000, workers=1, progress=False)
    return out


def time_stream(where, prefetch: int, limit: int | None) -> dict:
    """Seconds for a fresh stream to read the train split's tokens once (or `limit` slots), and its longest wait."""
    from memlm.data_pipeline.config import DataConfig, RemoteConfig
    from memlm.data_pipeline.remote.location import as_location
    from memlm.data_pipeline.stream import LaneStream

    if isinstance(where, str):  # no cache: every fresh stream fetches its shards
        where = as_location(where, DataConfig(remote=RemoteConfig(prefetch=prefetch, stall_s=30.0, backoff_s=0.1)))
    slots = limit or _train_tokens(where)
    start = last = time.perf_counter()
    stream = LaneStream(where, "train", lanes=LANES, seg_len=SEG_LEN, seed=1)
    batches, longest, first = 0, 0.0, None
    for _ in stream:
        now = time.perf_counter()
        if first is None:
            first = now - start  # the manifest, the first shard: once per run, before the first step
        else:
            longest = max(longest, now - last)
        last = now
        batches += 1
        if batches * LANES * SEG_LEN >= slots:
            break
    seconds = time.perf_counter() - start
    del stream  # its prefetch thread stops with it, before the next case
    return {"seconds": seconds, "slots": batches * LANES * SEG_LEN, "first_batch_s": first, "longest_wait_s": longest}


def time_paced(where, prefetch: int, slots: int, step_s: float) -> dict:
    """A consumer that spends `step_s` per batch (sleeping, as a process waits on its GPU's step) reads `slots`:
    how long it waited for data after its first batch, and how many batches kept it waiting over 1 ms."""
    from memlm.data_pipeline.config import DataConfig, RemoteConfig
    from memlm.data_pipeline.remote.location import as_location, is_remote
    from memlm.data_pipeline.stream import LaneStream

    if is_remote(where):  # a local folder is read as it is
        where = as_location(where, DataConfig(remote=RemoteConfig(prefetch=prefetch, stall_s=30.0, backoff_s=0.1)))
    stream = LaneStream(where, "train", lanes=LANES, seg_len=SEG_LEN, seed=1)
    next(stream)
    start = time.perf_counter()
    waited, late, batches = 0.0, 0, 1
    while batches * LANES * SEG_LEN < slots:
        time.sleep(step_s)
        asked = time.perf_counter()
        next(stream)
        wait = time.perf_counter() - asked
        waited += wait
        late += wait > 1e-3
        batches += 1
    seconds = time.perf_counter() - start
    del stream
    return {"seconds": seconds, "waited_s": waited, "late_batches": late, "batches": batches,
            "wait_share": waited / seconds}


def _train_tokens(where) -> int:
    from memlm.data_pipeline.shards import load_manifest

    return load_manifest(where)["splits"]["train"]["tokens"]


def step_rate(data: Path, steps: int) -> dict:
    """`memlm train tiny/txl` at 8 lanes x 128 on the local folder: the median tokens/s of its steps after two."""
    with tempfile.TemporaryDirectory() as run:
        cmd = [sys.executable, "-m", "memlm", "train", "tiny/txl", f"data.path={data}", "tracking.enabled=false",
               "train.eval_every=0", f"train.steps={steps}", "train.save_every=0", "data.batch_size=8",
               "model.tgt_len=128", "model.mem_len=128", "--out", str(Path(run) / "run")]
        subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="2"), check=True, capture_output=True, timeout=600)
        rows = [json.loads(line) for line in (Path(run) / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [row["tokens_per_s"] for row in rows if row["step"] > 2]
    return {"arch": "txl", "preset": "tiny/txl", "lanes": 8, "tgt_len": 128, "steps": steps,
            "tokens_per_s": statistics.median(rates)}


def run(args) -> dict:
    from memlm.data_pipeline.remote import transports

    # the test suite's servers, through memlm's namespace (a checkout's folders are memlm.*: memlm/__init__.py)
    from memlm.tests.support.http_shards import FaultProxy, ShardServer
    from memlm.tests.support.s3_server import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
    limit = None  # the train split once
    with tempfile.TemporaryDirectory(prefix="memlm-bench-remote-") as tmp, ExitStack() as stack:
        data = prepare_data(Path(tmp), args.smoke)
        http = stack.enter_context(ShardServer(data))
        s3 = stack.enter_context(S3Server())
        s3.upload(data, BUCKET, PREFIX)
        far = {}
        for name, upstream in (("http", http.url), ("s3", s3.endpoint)):
            proxy = stack.enter_context(FaultProxy(upstream))
            proxy.latency_s, proxy.bytes_per_s = args.latency_ms / 1000, args.mbit * 1e6 / 8
            far[name] = proxy.url
        s3_url = f"s3://{BUCKET}/{PREFIX}"
        cases = {"local": (lambda: data, {}, 0)}
        for prefetch in (0, 2):
            for shaped in (False, True):
                tag = f"{'far' if shaped else 'loopback'}, prefetch {prefetch}"
                cases[f"http {tag}"] = (lambda s=shaped: far["http"] if s else http.url, {}, prefetch)
                cases[f"s3 {tag}"] = (lambda: s3_url, {"AWS_ENDPOINT_URL": far["s3"] if shaped else s3.endpoint},
                                      prefetch)
        times: dict[str, list[dict]] = {name: [] for name in cases}
        base_env = {k: os.environ.get(k) for k in s3.env}
        os.environ.update(s3.env)
        try:
            for repeat in range(args.repeats):
                for name, (where, env, prefetch) in cases.items():
                    os.environ.update(env or {"AWS_ENDPOINT_URL": s3.endpoint})
                    transports._FILESYSTEMS.clear()  # a fresh s3fs per case: its endpoint is the case's
                    result = time_stream(where(), prefetch, limit)
                    times[name].append(result)
                    print(f"repeat {repeat + 1}: {name:28s} {result['slots'] / result['seconds'] / 1e6:6.2f} M tokens/s"
                          f"  longest wait {result['longest_wait_s'] * 1000:6.1f} ms", flush=True)
        finally:
            for k, v in base_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        # The far readers against an H100-class consumer: does prefetch hide the fetch behind the step?
        paced: dict[str, list[dict]] = {}
        step_s = LANES * SEG_LEN / H100_TOKENS_PER_S
        paced_slots = min(int(args.paced_tokens), _train_tokens(data))
        os.environ.update(s3.env)
        try:
            for repeat in range(args.repeats):
                os.environ["AWS_ENDPOINT_URL"] = far["s3"]
                for name in ("local", "http far, prefetch 0", "http far, prefetch 2", "s3 far, prefetch 0",
                             "s3 far, prefetch 2"):
                    transports._FILESYSTEMS.clear()
                    where = {"local": str(data), "http": far["http"], "s3": s3_url}[name.split()[0]]
                    prefetch = int(name[-1]) if name != "local" else 0
                    result = time_paced(where, prefetch, paced_slots, step_s)
                    paced.setdefault(name, []).append(result)
                    print(f"repeat {repeat + 1}: paced {name}: waited {result['waited_s']:.2f} of "
                          f"{result['seconds']:.1f} s, {result['late_batches']} of {result['batches']} batches late",
                          flush=True)
        finally:
            for k, v in base_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        step = None if args.smoke else step_rate(data, args.steps)
    rows = {}
    for name, runs in times.items():
        med = statistics.median(r["seconds"] for r in runs)
        rows[name] = {"seconds": [r["seconds"] for r in runs], "median_s": med, "slots": runs[0]["slots"],
                      "tokens_per_s": runs[0]["slots"] / med,
                      "first_batch_s_median": statistics.median(r["first_batch_s"] for r in runs),
                      "longest_wait_s_median": statistics.median(r["longest_wait_s"] for r in runs)}
    consumers = {"h100_class": H100_TOKENS_PER_S}
    if step:
        consumers["tiny_txl_cpu"] = step["tokens_per_s"]
    for row in rows.values():
        row["headroom"] = {who: row["tokens_per_s"] / rate for who, rate in consumers.items()}
    paced_rows = {name: {"wait_share_median": statistics.median(r["wait_share"] for r in runs),
                         "waited_s": [r["waited_s"] for r in runs], "seconds": [r["seconds"] for r in runs],
                         "late_batches": [r["late_batches"] for r in runs], "batches": runs[0]["batches"]}
                  for name, runs in paced.items()}
    return {"config": {"data": "smoke corpus" if args.smoke else "WikiText-2, bytes tokenizer, 1M-token shards",
                       "lanes": LANES, "seg_len": SEG_LEN, "repeats": args.repeats, "latency_ms": args.latency_ms,
                       "mbit": args.mbit, "limit_slots": limit},
            "machine": machine(), "step": step, "consumers_tokens_per_s": consumers, "cases": rows,
            "paced_h100": {"step_s": step_s, "slots": paced_slots, "cases": paced_rows}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the far reads' wait per request")
    parser.add_argument("--mbit", type=float, default=100.0, help="the far reads' bandwidth per connection")
    parser.add_argument("--paced-tokens", type=float, default=3e6,
                        help="tokens the H100-paced consumer reads per far case (3 shards)")
    parser.add_argument("--steps", type=int, default=12, help="steps of the tiny model whose rate is measured")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny corpus, one repeat, 5 ms latency, no training step")
    parser.add_argument("--out", type=Path, default=RESULTS / "remote_cpu.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.latency_ms = 1, 5.0
    print(f"wrote {write_result(args.out, run(args))}")
    return 0


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
