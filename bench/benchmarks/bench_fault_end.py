"""How long a fault on one rank takes to end a two-node job (trainer/runtime/peer_watch.py; issue 25).

    .venv/bin/python bench/benchmarks/bench_fault_end.py        # -> bench/results/fault_end_cpu.json (~5 min)

Two "nodes" on loopback (torchrun --nnodes 2 --nproc_per_node 1, c10d rendezvous), the tiny Transformer-XL preset
(ZeRO-2) on a small byte-level corpus, and rank 1 fails by a test hook (trainer/runtime/faults.py): an exception
as step 3 starts, a full disk at the step-4 save, SIGKILL in step 3, or SIGSTOP in step 3 (a node gone without a
word: nothing closes its sockets). The clock starts at the last metrics row written before the fault (the file's
modification time; the fault comes within one tiny step of it) and stops as each node's command exits; the
frozen node never exits by itself and is removed once the other has ended. One row, "watch off", is the frozen
rank with train.peer_timeout_s=0: the surviving rank then waits for DeepSpeed's collective timeout (set to 2
minutes here; 30 by default). On one machine the other faults end fast even without the watch (a dead process's
sockets close, and the launchers end the rest), but only the watch's line names the rank and the cause. Never part
of the test suite; nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT, child_env, load_average, write_result
from memlm.bench.interrupt import stop_in_one_line

CASES = {  # name: (hook environment, overrides, DEEPSPEED_TIMEOUT minutes)
    "exception": ({"MEMLM_TEST_KILL": "error:3:1"}, [], "2"),
    "full disk": ({"MEMLM_TEST_KILL": "enospc:4:1"}, [], "2"),
    "SIGKILL": ({"MEMLM_TEST_KILL": "step:3:1"}, [], "2"),
    "frozen, peer_timeout_s=10": ({"MEMLM_TEST_KILL": "step:3:1", "MEMLM_TEST_SIGNAL": "STOP"},
                                  ["train.peer_timeout_s=10"], "2"),
    "frozen, default peer_timeout_s (60)": ({"MEMLM_TEST_KILL": "step:3:1", "MEMLM_TEST_SIGNAL": "STOP"}, [], "2"),
    "frozen, watch off (peer_timeout_s=0)": ({"MEMLM_TEST_KILL": "step:3:1", "MEMLM_TEST_SIGNAL": "STOP"},
                                             ["train.peer_timeout_s=0"], "2"),
}


def make_corpus(root: Path) -> Path:
    from memlm.data_pipeline.prepare import prepare

    rng = random.Random(0)
    words = "the cat sat on a mat and the dog ran far away with a big red ball".split()
    for split, n in (("train", 40), ("valid", 4), ("test", 4)):
        (root / "corpus" / split).mkdir(parents=True)
        for i in range(n):
            (root / "corpus" / split / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(60)))
    prepare("textdir", root / "corpus", root / "data", tokenizer="bytes", workers=1, progress=False)
    return root / "data"


def one_case(name: str, data: Path, work: Path) -> dict:
    from memlm.trainer.runtime.distributed import free_port

    hooks, extra, ds_timeout = CASES[name]
    out, port = work / name.replace(" ", "_").replace(",", ""), free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "memlm", "train", "tiny/txl", f"data.path={data}",
           "tracking.enabled=false", "train.eval_every=0", "train.log_every=1", "train.steps=6",
           "train.save_every=2", "deepspeed.zero_stage=2", *extra, "--out", str(out)]
    env = child_env(OMP_NUM_THREADS="1", DEEPSPEED_TIMEOUT=ds_timeout, **hooks)
    logs = [work / f"{out.name}-node{r}.log" for r in range(2)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for log in logs]
    ended: dict[int, float] = {}
    while len(ended) < 2:
        for r, proc in enumerate(procs):
            if r not in ended and proc.poll() is not None:
                ended[r] = time.time()
        if ended and "STOP" in hooks.values():  # the frozen node never ends by itself
            break
        time.sleep(0.05)
    for proc in procs:  # torchrun starts its ranks in sessions of their own: the frozen rank is killed by name
        import psutil

        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for process in family:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
    fault_at = (out / "metrics.jsonl").stat().st_mtime
    lines = [line for log in logs for line in log.read_text().splitlines() if line.startswith("memlm: error:")]
    return {"case": name, "seconds_to_end": sorted(round(t - fault_at, 1) for t in ended.values()),
            "exit_status": sorted(p.returncode for r, p in enumerate(procs) if r in ended),
            "lines": lines, "latest": (out / "checkpoints" / "latest").read_text().strip()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "fault_end_cpu.json"))
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = make_corpus(Path(tmp))
        for name in args.cases:
            rows.append(one_case(name, data, Path(tmp)))
            print(rows[-1], flush=True)
    path = write_result(args.out, {"machine": f"{os.cpu_count()} cores", "load_average_after": load_average(),
                                   "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))
