"""Trainer end to end on real DeepSpeed (CPU accelerator, gloo): tiny presets learn, the run folder is complete,
configs that cannot work are refused up front.

Cost and CI: DeepSpeed JIT-compiles its `deepspeed_shm_comm` op at the first CPU `initialize` (measured 26 s on
this 2-core machine, ~1 min on others per docs/design.md §9), then loads it from TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions). CI pays it once: the first test here that builds an engine absorbs it; `.ci/run` may
keep TORCH_EXTENSIONS_DIR in its cache, keyed by CPU model (the build uses -march=native, never share it across
CPU models). No other op is built: the optimizer is DeepSpeed's torch Adam (`deepspeed.torch_adam: true`).
After that build, test_train.py + test_checkpoint.py take ~1 min on 2 cores: single-process runs share the
pytest process (no interpreter or DeepSpeed start-up per run); multi-process runs and the killed run are
subprocesses (`torchrun --standalone`, a free port each) and take most of that minute.
"""

from __future__ import annotations

import json
import os

import pytest

from support.training import ARCHS, make_data, metrics, overrides, preset, train_in_process

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")  # minutes: a deadlocked collective fails fast


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("train_data"))


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_preset_trains_and_loss_falls(arch, data, tmp_path):
    rows = train_in_process(arch, data, tmp_path / "run", train__steps=30, train__lr="3e-3",
                            train__save_every=0)
    assert [r["step"] for r in rows] == list(range(1, 31))
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.3, (first, last)


@pytest.mark.slow
@pytest.mark.parametrize("scope,precision", [("model", "fp32"), ("layer", "fp32"), ("model", "bf16")])
def test_a_compiled_run_trains_like_the_eager_one_and_compiles_once(data, tmp_path, scope, precision):
    """train.compile=true, the whole forward or one layer's work (train.compile_scope): the same losses as the
    uncompiled run (to rounding) over steps whose memory goes from empty to full and through document resets,
    with no graph break and one graph: the memory buffers have one shape and one dtype from step 0 (under bf16 the
    engine computes in bf16, and a memory begun in fp32 recompiled the forward at step 2). Checkpoints keep the
    plain model's parameter names. Traced with the aot_eager backend: the same capture as inductor's (graph breaks,
    guards, recompiles) without a minute of C++ code generation on CI's 2 cores; bench/ measures inductor."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    eager = train_in_process("txl", data, tmp_path / "eager", train__steps=6, train__save_every=0,
                             deepspeed__precision=precision)
    torch._dynamo.reset()
    counters.clear()
    compiled = train_in_process("txl", data, tmp_path / "compiled", train__steps=6, train__save_every=0,
                                train__compile="true", train__compile_backend="aot_eager",
                                train__compile_scope=scope, deepspeed__precision=precision)
    rel = 1e-4 if precision == "fp32" else 2e-2  # bf16: one rounding of the activations differs per fused op
    for want, got in zip(eager, compiled, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=rel), (got["step"], got["loss"], want["loss"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, counters["stats"]["unique_graphs"]
    from memlm.trainer.checkpoint.weights import load_weights

    names = set(load_weights(tmp_path / "compiled" / "checkpoints", "global_step6"))
    assert names == set(load_weights(tmp_path / "eager" / "checkpoints", "global_step6"))
    assert not any("_orig_mod" in n for n in names)


def test_run_folder_contents(data, tmp_path):
    out = tmp_path / "run"
    train_in_process("txl", data, out, train__steps=4, train__save_every=2, train__keep_last=1, train__grad_accum=2)
    row = metrics(out)[-1]
    for key in ("step", "loss", "lr", "tokens_per_s", "grad_norm", "ppl", "tokens"):
        assert key in row
    # grad_accum 2 x 2 lanes x 8 targets per step (every target scored: documents are longer than segments,
    # except padding at document ends, hence <=)
    assert 0 < row["tokens"] <= 4 * 2 * 2 * 8
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["gradient_accumulation_steps"] == 2 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["optimizer"]["params"]["torch_adam"] is True and "scheduler" not in ds
    assert (out / "config.yaml").is_file() and (out / "eval").is_dir()
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "global_step4"
    assert sorted(p.name for p in ckpts.iterdir()) == ["global_step4", "latest"]  # keep_last 1, no .tmp left


def test_vocab_mismatch_refused(data, tmp_path, capsys):
    from memlm.cli import main

    rc = main(["train", preset("txl"), *overrides(data, model__vocab_size=300), "--out", str(tmp_path / "r")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("memlm: error:") and "model.vocab_size=300" in err and "256" in err
    assert not (tmp_path / "r").exists()


def test_arch_and_tokenizer_change_refused_on_resume(data, tmp_path, capsys):
    from memlm.cli import main

    out = tmp_path / "run"
    train_in_process("txl", data, out, train__steps=2)
    capsys.readouterr()
    rc = main(["train", preset("lamemo"), *overrides(data), "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "arch was 'txl', now 'lamemo'" in err and "Traceback" not in err
    # A checkpoint of data prepared with another tokenizer (its identity differs).
    meta_path = out / "checkpoints" / "global_step2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["tokenizer"]["sha256"] = "0" * 64
    meta["tokenizer"]["kind"] = "word"
    meta_path.write_text(json.dumps(meta))
    rc = main(["train", preset("txl"), *overrides(data), "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer was word" in err and "now bytes" in err


def test_schedule_shapes():
    from memlm.trainer.loop.schedule import lr_factor

    kw = dict(steps=10, warmup_steps=2, min_lr_ratio=0.1)
    assert lr_factor(0, schedule="cosine", **kw) == 0.5 and lr_factor(1, schedule="cosine", **kw) == 1.0
    assert lr_factor(2, schedule="cosine", **kw) == 1.0
    assert lr_factor(10, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(6, schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(9, schedule="constant", **kw) == 1.0


def test_ds_config_from_run_config(data):
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.ds_config import deepspeed_config

    cfg = load_config(preset("txl"), overrides(data, deepspeed__zero_stage=2, deepspeed__offload_optimizer="true",
                                               deepspeed__precision="bf16", train__optimizer="adamw",
                                               train__grad_accum=3, train__clip=0.5))
    ds = deepspeed_config(cfg, world_size=4)
    assert ds["train_batch_size"] == 2 * 3 * 4
    assert ds["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["type"] == "AdamW" and ds["zero_force_ds_cpu_optimizer"] is False
    # ZeRO-3's bucket and persistence threshold reach DeepSpeed's zero_optimization block; unset, they are absent
    zero3 = load_config(preset("txl"), overrides(data, deepspeed__zero_stage=3, deepspeed__reduce_bucket_size=2000000,
                                                 deepspeed__param_persistence_threshold=0))
    assert deepspeed_config(zero3, world_size=2)["zero_optimization"] == {
        "stage": 3, "reduce_bucket_size": 2000000, "stage3_param_persistence_threshold": 0}
