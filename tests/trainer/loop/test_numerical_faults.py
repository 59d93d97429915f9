"""Numerical faults: a non-finite loss or gradient norm is skipped in lockstep (weights, optimizer state and schedule
exactly as before, memory emptied, counted as skipped_steps), train.max_bad_steps in a row stop the run with one
line and the last good checkpoint untouched; LaMemo's log-normalisers and alpha stay finite in bf16 with scores far
beyond exp's range. Poison comes from the trainer's MEMLM_TEST_POISON hook (a NaN batch loss, an inf weight) or a
gradient hook (an inf gradient under a finite loss).
"""

from __future__ import annotations

import math

import pytest
import torch

from memlm.cli import main
from support.training import losses, make_data, metrics, overrides, preset, torchrun


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("nonfinite_data"))


def _trainer(data, tmp_path, zero: int, **extra):
    """A built Trainer (real DeepSpeed engine, one process) whose steps the test drives itself."""
    from memlm.data_pipeline.shards import load_manifest
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.train import Trainer
    from memlm.trainer.runtime import distributed

    cfg = load_config(preset("txl"), overrides(data, deepspeed__zero_stage=zero, train__steps=8, **extra))
    trainer = Trainer(cfg, tmp_path / "run", distributed.setup_env(), {}, load_manifest(data))
    trainer.build()
    return trainer


def _snapshot(trainer) -> dict:
    engine = trainer.engine
    return {"params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            # ZeRO's state dict also holds `overflow`, the last step's status (True after a skip), not state
            "optimizer": _clone({k: v for k, v in engine.optimizer.state_dict().items() if k != "overflow"}),
            "lr": engine.get_lr()[0],
            "scheduler": engine.lr_scheduler.last_epoch}


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clone(v) for v in x]
    return x


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


@pytest.mark.parametrize("zero", [0, 2])
@pytest.mark.parametrize("poison", ["batch", "gradient"])
def test_a_bad_step_is_skipped_exactly(zero, poison, data, tmp_path, monkeypatch):
    """The skipped step changes nothing but the step counter, skipped_steps and the (emptied) memory; the next
    step trains normally. 'batch': the loss is NaN; 'gradient': the loss is finite, one gradient is inf (ZeRO-0:
    memlm's own norm check; ZeRO-2: DeepSpeed's, seen through engine.skipped_steps)."""
    from memlm.trainer.runtime import faults

    trainer = _trainer(data, tmp_path, zero, train__grad_accum=2)
    for _ in range(2):
        assert not trainer.train_step()["skipped"]
    before = _snapshot(trainer)
    tokens = trainer.tokens_seen
    if poison == "batch":
        monkeypatch.setenv(faults.POISON_HOOK, "3:0:batch")
        trainer.poison = faults.Poison(0)
        hook = None
    else:
        weight = next(trainer.engine.module.parameters())
        hook = weight.register_hook(lambda g: g + float("inf"))
    result = trainer.train_step()
    if hook is not None:
        hook.remove()
    assert result["skipped"] and result["loss"] is None
    assert trainer.step == 3 and trainer.skipped_steps == 1 and trainer.bad_streak == 1
    assert trainer.tokens_seen == tokens
    after = _snapshot(trainer)
    assert _same(after["params"], before["params"])
    assert _same(after["optimizer"], before["optimizer"])
    assert (after["lr"], after["scheduler"]) == (before["lr"], before["scheduler"])
    assert not trainer.recurrence.memory.valid.any()  # every lane's memory emptied
    for p in trainer.engine.module.parameters():
        assert p.grad is None or not p.grad.any()  # nothing of the bad step waits in the gradients

    monkeypatch.delenv(faults.POISON_HOOK, raising=False)
    trainer.poison = faults.Poison(0)  # the hook is read once per Trainer: read it again, now empty
    good = trainer.train_step()
    assert not good["skipped"] and math.isfinite(good["loss"]) and math.isfinite(good["grad_norm"])
    assert trainer.bad_streak == 0 and trainer.skipped_steps == 1
    assert not _same(_snapshot(trainer)["params"], before["params"])


def test_too_many_bad_steps_stop_the_run_and_keep_the_last_good_checkpoint(data, tmp_path, monkeypatch, capsys):
    from memlm.trainer.runtime import faults

    out = tmp_path / "run"
    monkeypatch.setenv(faults.POISON_HOOK, "3:0:param")  # an inf weight: every later step is bad
    capsys.readouterr()
    rc = main(["train", preset("txl"), *overrides(data, train__steps=10, train__save_every=2, train__max_bad_steps=3),
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    errors = [line for line in err.splitlines() if line.startswith("memlm: error:")]
    assert len(errors) == 1 and "training stopped at step 5: 3 steps in a row" in errors[0], err
    assert str(out / "checkpoints" / "global_step2") in errors[0] and "Traceback" not in err
    assert "step 4 skipped: the loss was not finite on 1 of 1 rank(s)" in err
    assert "no checkpoint at step 4" in err
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step2"
    assert not (out / "checkpoints" / "global_step4").exists()
    rows = {r["step"]: r for r in metrics(out)}
    assert [rows[s]["skipped_steps"] for s in (1, 2, 3, 4, 5)] == [0, 0, 1, 2, 3]
    assert all(rows[s]["loss"] is None for s in (3, 4, 5)) and math.isfinite(rows[2]["loss"])
    assert "NaN" not in (out / "metrics.jsonl").read_text()

    from memlm.trainer.checkpoint.weights import load_weights

    weights = load_weights(out / "checkpoints", "global_step2")
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


@pytest.mark.slow
def test_two_ranks_zero2_skip_in_lockstep_then_stop(data, tmp_path):
    """2 ranks, ZeRO-2: a NaN batch on rank 1 only is skipped by both ranks and training goes on; an inf weight on
    rank 1 stops both after train.max_bad_steps with the last good checkpoint as `latest`."""
    common = dict(deepspeed__zero_stage=2, train__steps=5, train__save_every=2)
    out = tmp_path / "transient"
    proc = torchrun("txl", data, out, env_extra={"MEMLM_TEST_POISON": "3:1:batch"}, **common)
    assert "step 3 skipped: the loss was not finite on 1 of 2 rank(s)" in proc.stderr
    rows = {r["step"]: r for r in metrics(out)}
    assert rows[3]["loss"] is None and rows[5]["skipped_steps"] == 1
    assert all(math.isfinite(rows[s]["loss"]) for s in (1, 2, 4, 5))
    for rank in (0, 1):  # both ranks counted it: their checkpoints agree
        state = torch.load(out / "checkpoints" / "global_step5" / f"rank{rank}.pt", weights_only=True)
        assert state["trainer"]["skipped_steps"] == 1 and state["trainer"]["step"] == 5

    out = tmp_path / "stuck"
    proc = torchrun("txl", data, out, check=False, env_extra={"MEMLM_TEST_POISON": "3:1:param"},
                    train__max_bad_steps=2, **common)
    assert proc.returncode != 0
    assert proc.stderr.count("memlm: error: training stopped at step 4: 2 steps in a row") == 2, proc.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step2"
    assert set(losses(out)) == {1, 2, 3, 4}


def test_lamemo_lognorms_and_alpha_stay_finite_in_bf16_with_huge_scores():
    """Attention scores of 1e3..1e5 (exp overflows past 88): under bf16 autocast every cached log-normaliser S
    and every alpha stays finite, alpha in [0, 1], and alpha equals the past mass exp(S) / (exp(S) + exp(F) + eps)
    computed in float64 from the same S and F."""
    from memlm.models import ModelConfig, build_model

    torch.manual_seed(0)
    cfg = ModelConfig(arch="lamemo", n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, vocab_size=50,
                      tgt_len=8, mem_len=8, dropout=0.0)
    model = build_model(cfg)
    with torch.no_grad():  # adversarially large activations: queries and keys scaled far up
        for module in model.modules():
            if hasattr(module, "q_net"):
                module.q_net.weight.mul_(300.0)
                module.kv_net.weight.mul_(300.0)
    seen = []
    original = model.interpolate

    def interpolate(ctx_past, lognorm_past, ctx_ahead, lognorm_ahead, record=None):
        out = original(ctx_past, lognorm_past, ctx_ahead, lognorm_ahead, record=lambda a: seen.append(
            (lognorm_past.double(), lognorm_ahead.double(), a.double())))
        return out

    model.interpolate = interpolate
    memory = model.init_memory(batch_size=2)
    tokens = torch.randint(0, 50, (3, 2, 8))
    peak = 0.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for segment in tokens:
            out = model(segment, memory, targets=segment)
            memory = out.memory
            for S in memory.lognorm:
                assert S.dtype == torch.float32 and torch.isfinite(S).all()
                peak = max(peak, float(S.abs().max()))
    assert peak > 1000.0, peak  # the scores really were far beyond exp's range
    assert len(seen) >= 2
    for S, F, alpha in seen:
        assert torch.isfinite(alpha).all() and (alpha >= 0).all() and (alpha <= 1).all()
        valid = torch.isfinite(S) & torch.isfinite(F)
        reference = 1.0 / (1.0 + torch.exp(F - S) + cfg.interp_eps * torch.exp(-S))
        assert torch.allclose(alpha[valid], reference[valid], atol=1e-5)
