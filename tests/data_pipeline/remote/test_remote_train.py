"""`memlm train` with data.path at a loopback HTTP server whose URL carries a password and a token, each shard reset
mid-body on its first request: exactly the losses and validation of the same run on the local folder, and the
credentials never reach the console. (MLflow's side: tests/trainer/tracking/test_tracking_credentials.py.)"""

from __future__ import annotations

import json

import pytest

from memlm.data_pipeline.shards import load_manifest
from memlm.data_pipeline.stream import LaneStream
from support.http_shards import Fault, ShardServer
from support.remote_sources import arm, served
from support.s3_server import S3Server
from support.training import losses, make_data, metrics, overrides, preset, subprocess_train, train_in_process


@pytest.mark.slow
def test_memlm_train_from_http_gives_the_local_losses(tmp_path):
    secret, token = "pw-0f9e8d7c6b5a", "tok-a1b2c3d4e5f6"
    data = make_data(tmp_path, shard_tokens=1000)
    common = {"train__steps": 6, "train__save_every": 0, "train__eval_every": 3, "train__eval_batches": 2}
    subprocess_train("txl", data, tmp_path / "local", **common)
    with ShardServer(data, auth=("trainer", secret)) as server:
        for split in ("train", "valid"):
            for shard in load_manifest(data)["splits"][split]["shards"]:  # whichever shard is read first breaks once
                server.faults[shard["path"]] = Fault(reset_after=shard["bytes"] // 2)
        url = f"http://trainer:{secret}@{server.url[len('http://'):]}/?token={token}"
        far = subprocess_train("txl", url, tmp_path / "remote", data__remote__backoff_s=0.01, **common)
    assert "retry 1 of 5" in far.stderr
    assert losses(tmp_path / "remote") == losses(tmp_path / "local") and len(losses(tmp_path / "local")) == 6
    for step in (3, 6):  # validation read the valid split over HTTP too
        remote, local = (json.loads((tmp_path / run / "eval" / f"step{step}.json").read_text())
                         for run in ("remote", "local"))
        assert remote == local
    for text in (far.stdout, far.stderr):
        assert secret not in text and token not in text


@pytest.mark.slow
def test_a_shard_away_past_the_budget_ends_the_run_naming_the_last_checkpoint(tmp_path, capsys):
    """The run reads its first block of shards; every later shard answers 503 for good: the run ends with one line
    naming the shard's URL and the checkpoint that --resume continues from."""
    from memlm.cli import main
    from memlm.trainer.config.run_config import load_config

    data = make_data(tmp_path, shard_tokens=100)  # a document or two per shard: the first block ends early
    extra = {"train__steps": 400, "train__save_every": 4, "data__remote__retries": 1, "data__remote__backoff_s": 0.01}
    cfg = load_config(preset("txl"), overrides(data, **extra))
    stream = LaneStream.from_config(cfg.data, "train", mode="train", seg_len=cfg.model.tgt_len)
    first_block = stream.plan.blocks(0)[0][0].shard_ids
    out = tmp_path / "run"
    with ShardServer(data) as server:
        for shard_id, shard in enumerate(stream.source.shards):
            if shard_id not in first_block:
                server.faults[shard["path"]] = Fault(unavailable=10**6)
        rc = main(["train", preset("txl"), *overrides(server.url, **extra), "--out", str(out)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memlm: error:")]
    assert rc != 0 and len(errors) == 1, errors
    steps = [row["step"] for row in metrics(out)]
    assert 4 <= max(steps) < 400
    saved = max(step for step in steps if step % 4 == 0)
    assert f"cannot read {server.url}/train/train-" in errors[0] and "2 attempts (data.remote.retries=1)" in errors[0]
    assert (out / "checkpoints" / f"global_step{saved}").is_dir()  # DeepSpeed's tag for the step's folder
    assert f"the last checkpoint is {out / 'checkpoints' / f'global_step{saved}'}: `memlm train ... --resume`" \
        in errors[0]


@pytest.mark.slow
def test_a_run_started_on_the_local_folder_resumes_from_the_url(tmp_path, capfd):
    """The cursor refers to the manifest, not to where the shards are: stopped at step 4 on the local folder and
    resumed from the HTTP URL of the same folder, the run writes the losses of one uninterrupted local run; memlm eval
    reads the run's URL as it reads the folder."""
    from memlm.cli import main

    data = make_data(tmp_path, shard_tokens=1000)
    common = {"train__steps": 8, "train__save_every": 4}
    whole = train_in_process("txl", data, tmp_path / "whole", **common)
    train_in_process("txl", data, tmp_path / "moved", stop_at=4, **common)
    capfd.readouterr()
    with ShardServer(data, auth=("mover", "pw-resume-7f3a")) as server:
        url = f"http://mover:pw-resume-7f3a@{server.url[len('http://'):]}"
        train_in_process("txl", url, tmp_path / "moved", resume=True, **common)
        assert any(path.endswith(".tar") for path, _, _ in server.requests)
        # memlm eval of the run (its config.yaml now names the URL) scores what it scores on the local folder
        assert main(["eval", str(tmp_path / "moved"), "--json", str(tmp_path / "far.json")]) == 0
    assert main(["eval", str(tmp_path / "moved"), "--data", str(data), "--json", str(tmp_path / "near.json")]) == 0
    printed = capfd.readouterr().err
    assert "resumed from" in printed and "at step 4" in printed  # resumed, not started over
    assert "data.path" in printed and "pw-resume-7f3a" not in printed  # the change is said, redacted
    far, near = (json.loads((tmp_path / name).read_text()) for name in ("far.json", "near.json"))
    assert far["nll"] == near["nll"] and far["tokens"] == near["tokens"] > 0
    assert losses(tmp_path / "moved") == {row["step"]: row["loss"] for row in whole} and len(whole) == 8


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["http", "s3"])
def test_one_rank_stopped_and_resumed_over_the_network_gives_the_local_losses(kind, tmp_path, monkeypatch, capfd):
    """One rank, in process, from HTTP and from S3 (through the fault proxy), every train shard reset mid-body on
    its first request: stopped at step 4 and resumed from the same URL with the resets armed again, the run writes
    the losses of the uninterrupted run on the local folder. (Two ranks, SIGKILLed: test_remote_ranks.py.)"""
    data = make_data(tmp_path, shard_tokens=1000)
    common = {"train__steps": 8, "train__save_every": 4, "data__remote__backoff_s": 0.01}
    whole = train_in_process("txl", data, tmp_path / "local", **common)
    with served(kind, data) as (url, env, server, prefix):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        arm(server, prefix, data)
        train_in_process("txl", url, tmp_path / "remote", stop_at=4, **common)
        arm(server, prefix, data)
        train_in_process("txl", url, tmp_path / "remote", resume=True, **common)
    printed = capfd.readouterr().err
    assert printed.count("retry 1 of 5") >= 2 and "at step 4" in printed, printed[-3000:]
    assert S3Server.SECRET not in printed
    assert losses(tmp_path / "remote") == {row["step"]: row["loss"] for row in whole} and len(whole) == 8
