"""`memlm train`: one DeepSpeed engine (world size 1 included) over LaneStream batches with recurrent memory.

Units. A step is one optimizer step = train.grad_accum micro-batches. A micro-batch is the next segment of this
rank's data.batch_size lanes (RMT's default window BPTT replays the lanes' last bptt_depth segments before it in
the same graph; RMT's `bptt_mode: chunk` takes bptt_depth + 1 new segments instead): trainer/recurrence.py.
Loss of a micro-batch = summed NLL over the scored targets / their count (+ RMT's aux loss, once per scored
segment); engine.backward once per micro-batch and engine.step after each (DeepSpeed steps the optimizer and the
client LambdaLR only on the accumulation boundary).

Memory. It lives per rank outside the engine, in the recurrence object, and is carried from segment to segment and
from micro-batch to micro-batch, so every lane reads one continuous stream across accumulation and step
boundaries; a lane's memory is cleared by the model where batch.reset is true (a new document). Between
micro-batches it is cut from the graph.

Resume. A checkpoint holds the engine state plus, per rank, the recurrent state (memory, RMT's replay window),
stream cursor and RNG states, so a resumed run takes exactly the steps an uninterrupted run would (bit-identical
in fp32 on CPU).

ZeRO-3 works because the models read every parameter through a module call (see models/backbone.py
LearnedTensors); ZeRO 0-3 with 2 ranks give the same losses (tests/test_checkpoint.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from . import checkpoint, distributed, runtime


def run(cfg, out: str | os.PathLike | None = None, resume: bool = False, reshard: bool = False,
        stop_at: int | None = None, reporter: Callable[[dict], None] | None = None) -> Path:
    """Train `cfg` (a validated RunConfig) into run folder `out`; returns the run folder.

    stop_at: leave after that step with a checkpoint, as a preempted job would (the schedule still spans
    train.steps, so `--resume` continues the same trajectory).
    reporter: called on rank 0 with every metrics row (the metrics.jsonl line) and, after each validation pass,
    with {"step", "valid_nll", "valid_ppl", "valid_bpc"}; a Ray Tune trial forwards them to tune.report.
    """
    from data_pipeline.shards import check_vocab_size, load_manifest

    manifest = load_manifest(cfg.data.path)  # DataError before any process group or build
    check_vocab_size(manifest, cfg.model.vocab_size)
    run_dir = Path(out or Path("runs") / cfg.model.arch)
    ckpt_dir = run_dir / "checkpoints"
    info = distributed.setup_env()
    runtime.prepare_process(who="train")  # threads that fit this rank's cores; the op cache of this environment
    if cfg.deepspeed.precision == "fp16" and info.device == "cpu":
        from models.config import ConfigError

        # DeepSpeed's CPU accelerator has no fp16 and says so only deep inside initialize, as a traceback.
        raise ConfigError("deepspeed.precision=fp16 needs CUDA GPUs (DeepSpeed's CPU accelerator has no fp16); "
                          "use deepspeed.precision=bf16 or fp32 on this machine")
    meta = {"world_size": info.world_size, "arch": cfg.model.arch, "tokenizer": _tokenizer_id(manifest),
            "seed": cfg.train.seed}
    tag = checkpoint.latest_tag(ckpt_dir) if resume else None
    if tag is not None and not reshard:  # refuse before the (slow) engine build
        checkpoint.check_compatible(checkpoint.read_meta(ckpt_dir, tag), meta, ckpt_dir / tag)
    if tag is None and resume and info.rank == 0:
        print(f"memlm train: no checkpoint in {ckpt_dir}; starting from step 0", file=sys.stderr)
    return Trainer(cfg, run_dir, info, meta, manifest, reporter).fit(tag, reshard, stop_at)


def _tokenizer_id(manifest: dict) -> dict:
    tok = manifest["tokenizer"]
    return {k: tok.get(k) for k in ("kind", "vocab_size", "sha256")}


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg, run_dir: Path, info, meta: dict, manifest: dict,
                 reporter: Callable[[dict], None] | None = None):
        self.cfg, self.run_dir, self.info, self.meta, self.manifest = cfg, run_dir, info, meta, manifest
        self.reporter = reporter if info.rank == 0 else None
        self.rank = info.rank
        self.ckpt_dir = run_dir / "checkpoints"

    # -- setup -------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        import deepspeed
        import torch

        from data_pipeline.stream import LaneStream
        from models import build_model

        from .config import dump_yaml
        from .ds_config import deepspeed_config
        from .recurrence import make_recurrence
        from .schedule import make_scheduler

        cfg = self.cfg
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        distributed.init(self.info)
        # Every rank seeds the same: identical initial weights, then the rank offsets dropout streams.
        seed_everything(cfg.train.seed)
        model = build_model(cfg.model)
        seed_everything(cfg.train.seed + 1000 * self.rank)
        self.ds_conf = deepspeed_config(cfg, self.info.world_size)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "eval").mkdir(exist_ok=True)
            dump_yaml(cfg, self.run_dir / "config.yaml")
            (self.run_dir / "ds_config.json").write_text(json.dumps(self.ds_conf, indent=2) + "\n")
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.ds_conf, lr_scheduler=lambda opt: make_scheduler(opt, cfg.train))
        if self.info.world_size == 1 and cfg.deepspeed.zero_stage == 0:
            # One rank has nothing to average, yet DeepSpeed would still flatten every gradient into buckets,
            # all-reduce them over gloo and copy them back (~5% of a CPU step, bench/bench_trainer.py). DeepSpeed
            # takes this same path itself when it has no process group. ZeRO >= 1 partitions through the
            # reduction, so it keeps it.
            self.engine.enable_backward_allreduce = False
        self.device = self.engine.device
        self.stream = LaneStream.from_config(cfg.data, "train", mode="train", seg_len=cfg.model.tgt_len,
                                             rank=self.rank, world_size=self.info.world_size)
        self.recurrence = make_recurrence(cfg.model, model.init_memory(cfg.data.batch_size, device=self.device),
                                          self.device)
        self.step, self.tokens_seen = 0, 0
        self.norm_wanted = True

    def _restore(self, tag: str, reshard: bool) -> None:
        from .recurrence import RecurrenceStateError

        if reshard:
            self._load_resharded(tag)
            return
        path, client = self.engine.load_checkpoint(str(self.ckpt_dir), tag=tag)
        if path is None:
            raise checkpoint.ResumeError(f"DeepSpeed could not load {self.ckpt_dir / tag}")
        state = checkpoint.load_rank_state(self.ckpt_dir, tag, self.rank)
        try:
            # Checkpoints written before the recurrence objects held the memory at the top level.
            self.recurrence.load_state_dict(state.get("recurrence") or {"memory": state["memory"]})
        except RecurrenceStateError as exc:
            raise checkpoint.ResumeError(f"cannot resume from {self.ckpt_dir / tag}: {exc}") from None
        self.stream.load_state_dict(state["stream"])
        checkpoint.set_rng_state(state["rng"])
        self.step, self.tokens_seen = state["step"], state["tokens"]

    def _load_resharded(self, tag: str) -> None:
        # Only the consolidated fp32 weights: the optimizer, schedule position and data cursor start over.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(self.ckpt_dir), tag=tag)
        if self.cfg.deepspeed.zero_stage == 3:
            from deepspeed import zero

            params = list(self.engine.module.parameters())
            with zero.GatheredParameters(params, modifier_rank=0):
                if self.rank == 0:
                    self.engine.module.load_state_dict(state, strict=False)
        else:
            self.engine.module.load_state_dict(state, strict=False)
        if self.rank == 0:
            # Printed, not warnings.warn: it must be seen every time, whatever the warning filters say.
            print(f"memlm train: warning: --reshard loaded only the weights of {self.ckpt_dir / tag}; optimizer "
                  "state, lr schedule and data position start over", file=sys.stderr)

    # -- one step ----------------------------------------------------------------------------------------------
    def _micro_batch(self) -> tuple[float, int, int]:
        """Forward the next micro-batch (trainer/recurrence.py), backward once; returns (nll sum, scored targets,
        input tokens) of its new data."""
        import torch

        batch = self.recurrence.step(self.engine, lambda: next(self.stream))
        self.engine.backward(batch.loss)
        if (self.engine.is_gradient_accumulation_boundary() and self.cfg.deepspeed.zero_stage == 0
                and self.norm_wanted):
            # DeepSpeed records the grad norm only for ZeRO / mixed precision; at stage 0 the gradients are
            # already averaged over ranks here, so their norm is the global one (before clipping, as ZeRO reports).
            # A full pass over the gradients: only on steps whose metrics row is written.
            grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
            self.stage0_grad_norm = float(torch.stack(grads).norm()) if grads else 0.0
        self.engine.step()
        self.recurrence.advance()
        return float(batch.nll), batch.count, batch.inputs

    def _train_step(self) -> dict:
        import torch
        import torch.distributed as dist

        lr = self.engine.get_lr()[0]  # the rate this step uses (the scheduler advances inside engine.step)
        nll, count, inputs = 0.0, 0, 0
        for _ in range(self.cfg.train.grad_accum):
            n, c, i = self._micro_batch()
            nll, count, inputs = nll + n, count + c, inputs + i
        # Loss over every rank's scored targets (one small all-reduce per step).
        summed = torch.tensor([nll, count, inputs], dtype=torch.float64)
        if self.info.world_size > 1:
            dist.all_reduce(summed)
        self.step += 1
        self.tokens_seen += int(summed[1])
        loss = float(summed[0] / max(summed[1], 1))
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            grad_norm = getattr(self, "stage0_grad_norm", None)
        return {"loss": loss, "inputs": int(summed[2]), "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan")}

    # -- loop --------------------------------------------------------------------------------------------------
    def fit(self, tag: str | None, reshard: bool, stop_at: int | None = None) -> Path:
        from .progress import Progress

        self._build()
        if tag is not None:
            self._restore(tag, reshard)
        tracker = self._tracker()
        cfg = self.cfg.train
        progress = Progress(self.rank, self.step, cfg.steps)
        metrics_path = self.run_dir / "metrics.jsonl"
        status = "FAILED"
        end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        try:
            def logged(step: int) -> bool:  # steps that write a metrics row (and so need their grad norm)
                return step % cfg.log_every == 0 or step == end

            window_start, window_inputs = time.perf_counter(), 0
            while self.step < end:
                self.norm_wanted = logged(self.step + 1)
                result = self._train_step()
                window_inputs += result["inputs"]
                if logged(self.step):
                    elapsed = max(time.perf_counter() - window_start, 1e-9)
                    row = {"step": self.step, "loss": result["loss"], "ppl": math.exp(min(result["loss"], 50.0)),
                           "lr": result["lr"], "grad_norm": result["grad_norm"],
                           "tokens_per_s": window_inputs / elapsed, "tokens": self.tokens_seen,
                           "peak_mem_mb": peak_memory_mb(self.device)}
                    if self.rank == 0:
                        with metrics_path.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                    tracker.log_metrics(self.step, {k: v for k, v in row.items() if k != "step"})
                    progress.update(row)
                    if self.reporter is not None:
                        self.reporter(row)
                    window_start, window_inputs = time.perf_counter(), 0
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    self._evaluate(tracker)
                if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == end:
                    self.save()
            status = "FINISHED"
        finally:
            progress.close()
            tracker.finish(status)
        return self.run_dir

    def save(self) -> str:
        state = {"recurrence": self.recurrence.state_dict(), "stream": self.stream.state_dict(),
                 "rng": checkpoint.rng_state(), "step": self.step, "tokens": self.tokens_seen,
                 **self.meta}
        return checkpoint.save(self.engine, self.ckpt_dir, self.step, self.rank, state, self.meta,
                               self.cfg.train.keep_last)

    def _tracker(self):
        try:
            from .tracking import Tracker
        except ImportError:
            return _NoTracker()
        tracker = Tracker(self.cfg.tracking, self.run_dir, self.rank, self.cfg)
        tracker.set_tags({"arch": self.cfg.model.arch})
        if self.rank == 0:
            for name in ("config.yaml", "ds_config.json"):
                tracker.log_artifact(self.run_dir / name)
        return tracker

    def _evaluate(self, tracker) -> None:
        try:
            from .evaluate import evaluate
        except ImportError:
            if self.rank == 0:
                warnings.warn("trainer.evaluate is not available: skipping validation", RuntimeWarning)
            return
        import torch

        # Evaluation draws no random numbers we rely on, but keep the training RNG untouched regardless.
        rng = checkpoint.rng_state()
        self.engine.eval()
        with torch.no_grad():
            result = evaluate(self.engine.module, self.cfg.data.path, "valid", lanes=self.cfg.data.eval_lanes,
                              seg_len=self.cfg.model.tgt_len, rank=self.rank, world_size=self.info.world_size,
                              device=self.device, max_batches=self.cfg.train.eval_batches,
                              continuous=self.cfg.data.continuous)
        self.engine.train()
        checkpoint.set_rng_state(rng)
        if self.rank == 0:
            eval_json = self.run_dir / "eval" / f"step{self.step}.json"
            eval_json.write_text(json.dumps({**result, "step": self.step}) + "\n")
            tracker.log_artifact(eval_json, "eval")
        valid = {f"valid_{k}": result[k] for k in ("nll", "ppl", "bpc") if k in result}
        tracker.log_metrics(self.step, valid)
        if self.reporter is not None:
            self.reporter({"step": self.step, **valid})


def peak_memory_mb(device) -> float:
    """This rank's peak memory so far in MiB: allocated GPU memory on CUDA, else the process's peak RSS."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class _NoTracker:
    def log_metrics(self, step, metrics):
        pass

    def log_artifact(self, path):
        pass

    def set_tags(self, tags):
        pass

    def finish(self, status="FINISHED"):
        pass
