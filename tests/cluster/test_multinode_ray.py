"""`memlm sweep --address` and `memlm extrapolate --address` on a Ray cluster of two nodes, one of them lost.

The cluster is made the way an operator makes one (tests/support/ray_nodes.py): `ray start --head` (node a, 1
CPU) once for the module, and per test `ray start --address` (node b, 1 CPU), both on this machine. The commands
run as subprocesses, as a user runs them, and join the cluster by its address. With one CPU per node and one CPU
per trial or task, both nodes work at once.

Losing node b at a known moment: both nodes hold their trials / tasks at a MEMLM_TEST_HOLD point
(trainer/runtime/faults.py; a node's `ray start` environment reaches its workers), and the test decides:
node b's first hold is released (that trial or task finishes on b), node a's first hold is kept (so node b must
take the next piece of work), and at node b's second hold node b is SIGKILLed as a whole (raylet, agents,
workers), then node a is let go. What must hold afterwards: the work finished on b is kept (not redone), the work
lost with b is retried on a (a trial from the checkpoint it wrote on b), the command exits 0 with every result,
and its summary names the lost node and the retried work.

Cost: the sweep's critical path is three trial runs one after another (b's first, b's second until it is lost,
its retry on a), the extrapolation's a few seconds of tasks. Measured on 2 cores shared with other test suites (load
average 4-6): head 14 s, sweep 223 s, extrapolation 36 s, 280 s for the file; each trial process then takes ~50 s
to start and train, against the 10-15 s of an idle machine (tests/cluster/test_sweep.py).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support.ray_nodes import RayNodes
from support.training import child_env, make_data, train_in_process

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

HOLD_SECONDS = 120  # a safety net only: the test releases every hold itself
HOLD_AT = "trial@4,extrapolate@any"  # a trial after its step-3 checkpoint; a task as it starts
# Three trials: a's first (held), b's first (finishes on b), b's second (lost with b), the fewest that show it all.
SWEEP = """\
name: two-nodes
base: tiny/lamemo
overrides: {train.steps: 6, train.eval_every: 3, train.save_every: 3, train.eval_batches: 2, train.warmup_steps: 0}
space:
  train.lr: {grid: [1.0e-3, 2.0e-3, 3.0e-3]}
resources: {cpus: 1}
max_concurrent: 2
max_failures: 2
"""
STEPS = 6
N = 8


def hold_env(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    return {"MEMLM_TEST_HOLD": f"{HOLD_AT}:{HOLD_SECONDS}:{folder}"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def cluster(root):
    """Node a, the head, for the whole module (its holds are written to ROOT/hold_a)."""
    with RayNodes(env_a=hold_env(root / "hold_a")) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def data(root) -> Path:
    return make_data(root / "corpus")


class NodeLoss(threading.Thread):
    """The test's side of the holds: release node b's first hold, keep node a's, SIGKILL node b at its second
    hold, then release node a for good. Records what b held (file names: POINT-STEP-PID)."""

    def __init__(self, nodes: RayNodes, hold_a: Path, hold_b: Path):
        super().__init__(daemon=True)
        self.nodes, self.hold_a, self.hold_b = nodes, hold_a, hold_b
        self.b_holds: list[str] = []
        self.killed_at: float | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            if self.killed_at is None:
                for held in sorted(self.hold_b.glob("*.held")):
                    if held.name in self.b_holds:
                        continue
                    self.b_holds.append(held.name)
                    if len(self.b_holds) == 1:
                        held.unlink()  # b's first piece of work finishes on b
                    else:
                        self.nodes.kill("b")  # lost while its second piece of work runs there
                        self.killed_at = time.monotonic()
                        break
            else:
                for held in self.hold_a.glob("*.held"):
                    held.unlink(missing_ok=True)
            self.halt.wait(0.05)

    def finish(self) -> None:
        self.halt.set()
        self.join(timeout=10)
        for held in self.hold_a.glob("*.held"):  # never leave node a waiting for the next test
            held.unlink(missing_ok=True)


def memlm(args: list[str], cwd: Path, timeout: float = 500) -> subprocess.CompletedProcess:
    env = child_env({"RAY_AUTH_MODE": "disabled"})
    return subprocess.run([sys.executable, "-m", "memlm", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_with_node_loss(cluster: RayNodes, root: Path, tmp_path: Path, args: list[str]
                       ) -> tuple[subprocess.CompletedProcess, NodeLoss, dict[str, str]]:
    """Join node b, run `memlm ARGS --address` while NodeLoss loses node b; (the command, NodeLoss, node ids)."""
    hold_b = tmp_path / "hold_b"
    cluster.add("b", hold_env(hold_b))
    ids = {"a": cluster.node_id("a"), "b": cluster.node_id("b")}
    loss = NodeLoss(cluster, root / "hold_a", hold_b)
    loss.start()
    try:
        proc = memlm([*args, "--address", cluster.address], cwd=tmp_path)
    finally:
        loss.finish()
    return proc, loss, ids


def test_sweep_loses_a_node(cluster, root, data, tmp_path):
    started = time.monotonic()
    sweep_dir = tmp_path / "sweep"
    (tmp_path / "two_nodes.yaml").write_text(SWEEP)
    proc, loss, ids = run_with_node_loss(cluster, root, tmp_path, ["sweep", str(tmp_path / "two_nodes.yaml"),
                                                             f"data.path={data}", "--out", str(sweep_dir)])
    out = proc.stdout + proc.stderr
    print(f"sweep with a node lost: {time.monotonic() - started:.1f} s, exit {proc.returncode}\n{proc.stdout}")
    assert loss.killed_at is not None, f"node b never held a second trial: {loss.b_holds}\n{out[-3000:]}"
    assert proc.returncode == 0, out[-4000:]

    with (sweep_dir / "trials.csv").open() as f:
        rows = {r["trial_id"]: r for r in csv.DictReader(f)}
    assert len(rows) == 3 and {r["status"] for r in rows.values()} == {"TERMINATED"}, rows
    attempts = {t: [json.loads(line)["node_id"] for line in (sweep_dir / "trials" / t / "nodes.jsonl").open()]
                for t in rows}
    # Work on both nodes: one trial trained all its steps on b, one began on b and was lost with it.
    (done_on_b,) = [t for t, nodes in attempts.items() if nodes == [ids["b"]]]
    (lost,) = [t for t, nodes in attempts.items() if nodes == [ids["b"], ids["a"]]]
    assert all(nodes == [ids["a"]] for t, nodes in attempts.items() if t not in (done_on_b, lost)), attempts
    assert {t: r["node"] for t, r in rows.items()} == {t: nodes[-1] for t, nodes in attempts.items()}
    assert {t: int(r["failures"]) for t, r in rows.items()} == {t: int(t == lost) for t in rows}

    def steps(trial: str) -> list[int]:
        return [json.loads(line)["step"] for line in (sweep_dir / "trials" / trial / "metrics.jsonl").open()]

    # The trial finished on b is kept as it was: trained once, not again after the loss.
    assert steps(done_on_b) == list(range(1, STEPS + 1)) and f"trial {done_on_b} started" in proc.stdout
    assert proc.stdout.count(f"trial {done_on_b} started") == 1
    # The lost trial continued on a from the step-3 checkpoint it wrote on b: steps 1-3 once, then 4-6 (step 4
    # may be logged twice: b logged it as it held there).
    lost_steps = steps(lost)
    assert lost_steps[:3] == [1, 2, 3] and lost_steps.count(1) == 1 and lost_steps[-3:] == [4, 5, 6], lost_steps
    assert (sweep_dir / "trials" / lost / "checkpoints" / "latest").read_text().strip() == f"global_step{STEPS}"
    assert f"trial {lost} failed (" in proc.stdout and "retrying from its last checkpoint (failure 1)" in proc.stdout

    # The summary says what happened.
    assert f"lost 1 node(s) during the sweep: {ids['b'][:8]} (" in proc.stdout, proc.stdout
    assert ("2 trial(s) had run there: 1 finished there (kept), 1 continued on other nodes from their last "
            "checkpoints") in proc.stdout, proc.stdout
    assert (f"1 trial(s) retried: {lost} TERMINATED after 1 failure(s), nodes {ids['b'][:8]} (lost) -> "
            f"{ids['a'][:8]}") in proc.stdout, proc.stdout
    assert (sweep_dir / "best.json").is_file()


@pytest.fixture(scope="module")
def trained(root, data) -> Path:
    run = root / "runs" / "lamemo"
    train_in_process("lamemo", data, run, train__steps=4)
    return run


def test_extrapolation_loses_a_node(cluster, root, trained, tmp_path):
    from memlm.trainer.inference.evaluate import evaluate_run

    started = time.monotonic()
    out = tmp_path / "out"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["extrapolate", str(trained), "--mult", "1-4", "--out", str(out), "--uri", uri, "--experiment", "extrap"]
    proc, loss, ids = run_with_node_loss(cluster, root, tmp_path, args)
    print(f"extrapolation with a node lost: {time.monotonic() - started:.1f} s, exit {proc.returncode}\n"
          f"{proc.stdout}")
    assert loss.killed_at is not None, f"node b never held a second task: {loss.b_holds}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    # b's holds name the memory lengths it ran: the first finished there, the second was lost with b.
    done_m, lost_m = (int(name.split("-")[1]) // N for name in loss.b_holds)
    summary = json.loads((out / "summary.json").read_text())
    rows = {row["m"]: row for row in summary["runs"]["lamemo"]["results"]}
    assert sorted(rows) == [1, 2, 3, 4] and summary["lost_nodes"] == [ids["b"]]
    assert rows[done_m]["node"] == ids["b"]  # kept: finished on b before the loss
    assert {m: row["node"] for m, row in rows.items() if m != done_m} == {m: ids["a"] for m in rows if m != done_m}
    for m, row in rows.items():  # every result, the retried one included, is the evaluation it should be
        ref = evaluate_run(trained, split="test", tgt_len=N, mem_len=m * N, json_path=tmp_path / f"ref{m}.json")
        assert row["nll"] == pytest.approx(ref["nll"], rel=1e-9), m
    assert f"lost 1 node(s) during the run: {ids['b'][:8]} (" in proc.stdout, proc.stdout
    assert "1 result(s) finished there before are kept" in proc.stdout
    assert (f"1 evaluation(s) retried and finished: lamemo m={lost_m} (attempt 2, on node {ids['a'][:8]})"
            in proc.stdout), proc.stdout
    assert f"m={lost_m} (memory {lost_m * N})" in proc.stdout and ", retry 1;" in proc.stdout
