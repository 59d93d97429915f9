"""Two "nodes" on loopback, one rank each, under both launchers (issue 25; README "Beyond one machine"):

    torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT -m memlm train ...
    deepspeed --hostfile H --no_ssh --node_rank R --master_addr 127.0.0.1 --master_port PORT --module memlm train ...

each started once per node, as a user starts them on two machines. They must train to exactly the losses of one
node with 2 ranks; a node SIGKILLed mid-run must end the job (no rank left waiting) with the last checkpoint
intact, and the job restarted with --resume on both nodes must end on the weights of the uninterrupted run. A
fault on one rank (an exception, a full disk, a frozen process) ends every rank with one line naming the rank and
the cause (trainer/runtime/peer_watch.py). Every launch here is guarded by a wait limit: a hang fails the test.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.training import DEEPSPEED, REPO, child_env, losses, make_data, overrides, preset

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multinode")]

ARCH = "txl"
STEPS, SAVE_EVERY = 6, 2
HANG_GUARD_S = 240  # a launch still running after this long is a hang (the test fails)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("multinode_data"))


def _port() -> int:
    from memlm.trainer.runtime.distributed import free_port

    return free_port()


def node_commands(launcher: str, out: Path, train_args: list[str], tmp: Path) -> list[list[str]]:
    """The command each of the two nodes runs, as the README shows them."""
    port = str(_port())
    if launcher == "torchrun":
        return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "memlm", "train",
                 *train_args, "--out", str(out)] for _ in range(2)]
    hostfile = tmp / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    return [[str(DEEPSPEED), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank), "--master_addr",
             "127.0.0.1", "--master_port", port, "--module", "memlm", "train", *train_args, "--out", str(out)]
            for rank in range(2)]


def two_nodes(launcher: str, data: Path, out: Path, tmp: Path, *, resume: bool = False, env: dict | None = None,
              lost_node: bool = False, **extra) -> list[dict]:
    """Start both nodes and wait for both; per node: returncode, output, seconds from start to its exit.

    lost_node: one node stands for a machine that is gone (its rank frozen): once the other node's command has
    ended, the test removes it (rc None), as its owner would."""
    args = [preset(ARCH), *overrides(data, train__steps=STEPS, train__save_every=SAVE_EVERY,
                                     deepspeed__zero_stage=2, **extra)] + (["--resume"] if resume else [])
    started, ended = time.monotonic(), {}
    logs = [tmp / f"{launcher}-node{rank}-{int(started * 1000)}.log" for rank in range(2)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=child_env(env), stdout=log.open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
             for cmd, log in zip(node_commands(launcher, out, args, tmp), logs)]
    try:
        while len(ended) < 2 and time.monotonic() - started < HANG_GUARD_S:
            for rank, proc in enumerate(procs):
                if rank not in ended and proc.poll() is not None:
                    ended[rank] = time.monotonic() - started
            if lost_node and ended:
                break
            time.sleep(0.2)
    finally:
        for proc in procs:  # the lost node, or a hang: every process of the node goes
            kill_tree(proc.pid)
            proc.wait()
    assert ended, f"neither node ended within {HANG_GUARD_S} s"
    return [{"rc": proc.returncode if rank in ended else None, "output": log.read_text(),
             "seconds": ended.get(rank)} for rank, (proc, log) in enumerate(zip(procs, logs))]


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it: torchrun starts its ranks in sessions of their own, so a
    frozen rank outlives a kill of the launcher's process group (each kept 500 MB until the machine restarted)."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def weights(run_dir: Path) -> dict:
    from memlm.trainer.checkpoint.store import find_checkpoint
    from memlm.trainer.checkpoint.weights import load_weights

    return load_weights(*find_checkpoint(run_dir))


def torchrun_one_node(data: Path, out: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "memlm",
           "train", preset(ARCH), *overrides(data, train__steps=STEPS, train__save_every=SAVE_EVERY,
                                             deepspeed__zero_stage=2), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def one_node(data, tmp_path_factory) -> Path:
    """The reference: one node, 2 ranks, ZeRO-2, uninterrupted."""
    out = tmp_path_factory.mktemp("one_node") / "run"
    torchrun_one_node(data, out)
    return out


def test_two_nodes_train_as_one_node(data, one_node, tmp_path):
    """Under torchrun; the deepspeed launcher's two nodes train the same run in the kill-and-resume test below (its
    losses of every step and its final weights are the one node's too)."""
    out = tmp_path / "run"
    for node in two_nodes("torchrun", data, out, tmp_path):
        assert node["rc"] == 0, node["output"][-4000:]
    two, one = losses(out), losses(one_node)
    assert sorted(two) == list(range(1, STEPS + 1))
    assert two == one  # the same ranks reduce the same numbers in the same order: exactly equal
    final_two, final_one = weights(out), weights(one_node)
    assert all(final_two[k].equal(final_one[k]) for k in final_one)


def test_node_killed_mid_run_then_resumed_ends_on_the_uninterrupted_weights(data, one_node, tmp_path):
    """Rank 1's node dies (SIGKILL) in step 3: both nodes' commands end, the step-2 checkpoint is intact, and both
    nodes rerun with --resume finish on exactly the uninterrupted run's losses and weights. Under the deepspeed
    launcher (torchrun's two nodes are the test above): its steps 1-2 before the kill and 3-6 after the resume are
    the one node's, so this is also the deepspeed launcher's two nodes training as one."""
    out = tmp_path / "run"
    killed = two_nodes("deepspeed", data, out, tmp_path, env={"MEMLM_TEST_KILL": "step:3:1"})
    assert all(node["rc"] != 0 for node in killed), [node["output"][-2000:] for node in killed]
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step2"
    for node in two_nodes("deepspeed", data, out, tmp_path, resume=True):
        assert node["rc"] == 0, node["output"][-4000:]
    assert losses(out) == losses(one_node)
    final, reference = weights(out), weights(one_node)
    assert all(final[k].equal(reference[k]) for k in reference)


@pytest.mark.parametrize("launcher, hook, cause", [
    ("torchrun", {"MEMLM_TEST_KILL": "enospc:4:1"}, "No space left on device"),
    ("deepspeed", {"MEMLM_TEST_KILL": "error:3:1"}, "fault injected at step 3 on rank 1"),
    ("torchrun", {"MEMLM_TEST_KILL": "step:3:1", "MEMLM_TEST_SIGNAL": "STOP"}, "no sign of life for 5 s"),
], ids=["full-disk", "exception", "frozen"])
def test_fault_on_one_rank_ends_every_rank_with_one_line(launcher, hook, cause, data, tmp_path):
    """Rank 1 fails (a full disk at the step-4 save, an exception, a process frozen as a lost node is): rank 0,
    waiting in a collective for it, ends too, with one `memlm: error:` line that names rank 1 and the cause; the
    step-2 checkpoint is intact. The frozen rank is silent, so the watch's timeout (5 s here) is what ends it."""
    out = tmp_path / "run"
    frozen = hook.get("MEMLM_TEST_SIGNAL") == "STOP"
    nodes = two_nodes(launcher, data, out, tmp_path, env=hook, lost_node=frozen, train__peer_timeout_s=5)
    output = "\n".join(node["output"] for node in nodes)
    print(f"{launcher} {hook}: nodes ended after {[node['seconds'] for node in nodes]} s")
    assert all(node["rc"] != 0 for node in nodes if not (frozen and node["rc"] is None)), output[-4000:]
    lines = [line for line in output.splitlines() if "memlm: error: rank 1" in line]
    assert len(lines) == 1 and cause in lines[0], output[-4000:]
    assert "global_step2" in lines[0]  # it names the last checkpoint, which is intact:
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step2"
    assert weights(out)
