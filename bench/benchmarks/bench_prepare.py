"""`memlm prepare` wall time on WikiText-2 (train + valid + test) against the bare floor of the same run:
reading the three files and splitting them into words, with no vocabulary, ids, shards or hashing.

    .venv/bin/python bench/benchmarks/bench_prepare.py            # -> bench/results/prepare_cpu.json

Median of --repeats runs per setting (tokenizer x workers). Never part of the test suite.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from memlm.bench.common import RESULTS, WIKITEXT2, write_result
from memlm.bench.interrupt import stop_in_one_line
from memlm.data_pipeline.prepare import prepare


def bare_read_and_split(folder: Path) -> int:
    words = 0
    for split in ("train", "valid", "test"):
        for line in (folder / f"wiki.{split}.tokens").read_text(encoding="utf-8").splitlines():
            words += len(line.split()) + 1
    return words


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "prepare_cpu.json"))
    args = parser.parse_args()

    floor = timed(lambda: bare_read_and_split(WIKITEXT2), args.repeats)
    results = {"bare_read_split_s": statistics.median(floor), "settings": {}}
    for tokenizer, vocab in (("word", None), ("spm-bpe", 8000)):
        for workers in (1, 2):
            def run():
                out = Path(tempfile.mkdtemp()) / "wt2"
                prepare("wikitext", WIKITEXT2, out, tokenizer=tokenizer, vocab_size=vocab, workers=workers)
                shutil.rmtree(out.parent)

            times = timed(run, args.repeats)
            median = statistics.median(times)
            results["settings"][f"{tokenizer}/workers={workers}"] = {
                "median_s": median, "times_s": times, "over_bare_floor": median / results["bare_read_split_s"],
            }
            ratio = median / results["bare_read_split_s"]
            print(f"{tokenizer:8s} workers={workers}: {median:.2f} s ({ratio:.1f}x the bare read+split)")
    results.update(python=platform.python_version(), machine=platform.machine(), tokens=2_551_843)
    write_result(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
