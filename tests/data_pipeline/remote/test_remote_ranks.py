"""Two ranks over the network: `torchrun --nproc_per_node 2 -m memlm train` from a loopback HTTP server whose every
train shard resets mid-body on its first request, SIGKILLed mid-step 5 on rank 1 (trainer/runtime/faults.py's
MEMLM_TEST_KILL), then resumed from the same URL with the resets armed again: exactly the losses of the same 2-rank
run from the local folder, uninterrupted. Three launches (the local reference, the killed run, the resume), the tiny
preset, 6 steps."""

from __future__ import annotations

import pytest

from memlm.data_pipeline.shards import load_manifest
from support.http_shards import Fault, ShardServer
from support.training import losses, make_data, torchrun

COMMON = {"train__steps": 6, "train__save_every": 2, "train__keep_last": 3}


def arm(server: ShardServer, data) -> None:
    """Every train shard breaks off halfway through on its next request (whichever rank reads it)."""
    for shard in load_manifest(data)["splits"]["train"]["shards"]:
        server.faults[shard["path"]] = Fault(reset_after=shard["bytes"] // 2)


@pytest.mark.slow
def test_two_ranks_from_http_killed_and_resumed_give_the_local_losses(tmp_path):
    data = make_data(tmp_path, shard_tokens=1000)
    local, remote = tmp_path / "local", tmp_path / "remote"
    torchrun("txl", data, local, **COMMON)
    far = {"data__remote__backoff_s": 0.01, **COMMON}
    with ShardServer(data) as server:
        arm(server, data)
        killed = torchrun("txl", server.url, remote, env_extra={"MEMLM_TEST_KILL": "step:5:1"}, check=False, **far)
        assert killed.returncode != 0, "the run was never killed at step 5"
        assert "retry 1 of 5" in killed.stderr, killed.stderr[-3000:]  # the resets were met and retried
        assert not (remote / "checkpoints" / "global_step6").exists()
        before = len(server.requests)
        arm(server, data)
        resumed = torchrun("txl", server.url, remote, resume=True, **far)
        shards_read = {path for path, _, _ in server.requests[before:] if path.endswith(".tar")}
    assert "at step 4" in resumed.stderr and "retry 1 of 5" in resumed.stderr, resumed.stderr[-3000:]
    assert shards_read  # the resumed ranks read their shards over HTTP again
    assert losses(remote) == losses(local) and sorted(losses(local)) == list(range(1, 7))
