"""Two ranks over the network: `torchrun --nproc_per_node 2 -m memlm train` from a loopback HTTP server, and from
S3 (moto's server behind tests/support/http_shards.py's FaultProxy), whose every train shard resets mid-body on its
first request, SIGKILLed mid-step 5 on rank 1 (trainer/runtime/faults.py's MEMLM_TEST_KILL), then resumed from the
same URL with the resets armed again: exactly the losses of the same 2-rank run from the local folder, uninterrupted.
Five launches (the local reference, shared; per source the killed run and the resume), the tiny preset, 6 steps."""

from __future__ import annotations

import pytest

from support.remote_sources import arm, served
from support.s3_server import S3Server
from support.training import losses, make_data, torchrun

COMMON = {"train__steps": 6, "train__save_every": 2, "train__keep_last": 3}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(the local folder, the losses of its uninterrupted 2-rank run)."""
    root = tmp_path_factory.mktemp("ranks")
    data = make_data(root, shard_tokens=1000)
    torchrun("txl", data, root / "local", **COMMON)
    return data, losses(root / "local")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["http", "s3"])
def test_two_ranks_killed_and_resumed_over_the_network_give_the_local_losses(reference, kind, tmp_path):
    data, want = reference
    remote = tmp_path / "remote"
    far = {"data__remote__backoff_s": 0.01, **COMMON}
    with served(kind, data) as (url, env, server, prefix):
        arm(server, prefix, data)
        killed = torchrun("txl", url, remote, env_extra={**env, "MEMLM_TEST_KILL": "step:5:1"}, check=False, **far)
        assert killed.returncode != 0, "the run was never killed at step 5"
        assert "retry 1 of 5" in killed.stderr, killed.stderr[-3000:]  # the resets were met and retried
        assert not (remote / "checkpoints" / "global_step6").exists()
        before = len(server.requests)
        arm(server, prefix, data)
        resumed = torchrun("txl", url, remote, resume=True, env_extra=env, **far)
        shards_read = {path for path, _, _ in server.requests[before:] if path.endswith(".tar")}
    assert "at step 4" in resumed.stderr and "retry 1 of 5" in resumed.stderr, resumed.stderr[-3000:]
    assert shards_read  # the resumed ranks read their shards over the network again
    assert S3Server.SECRET not in killed.stderr + resumed.stderr
    assert losses(remote) == want and sorted(want) == list(range(1, 7))
