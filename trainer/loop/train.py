"""`memlm train`: one DeepSpeed engine (world size 1 included) over LaneStream batches with recurrent memory.

Units. A step is one optimizer step = train.grad_accum micro-batches. A micro-batch is the next segment of this
rank's data.batch_size lanes (RMT's default window BPTT replays the lanes' last bptt_depth segments before it in
the same graph; RMT's `bptt_mode: chunk` takes bptt_depth + 1 new segments instead): trainer/loop/recurrence.py.
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
LearnedTensors); ZeRO 0-3 with 2 ranks give the same losses (tests/trainer/checkpoint/test_checkpoint.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from memlm.data_pipeline.hf_tokenizer import check_backbone_tokenizer
from memlm.data_pipeline.remote.fetch import FetchFailed
from memlm.data_pipeline.remote.location import location_of
from memlm.data_pipeline.shards import check_vocab_size, load_manifest
from memlm.data_pipeline.stream import LaneStream
from memlm.models import build_model
from memlm.models.config import ConfigError
from memlm.trainer.checkpoint import config_record, disk_full, resume_policy, run_folder, run_lock
from memlm.trainer.checkpoint import store as checkpoint
from memlm.trainer.checkpoint.errors import ResumeError
from memlm.trainer.checkpoint.rng import RNGState, rng_preserved
from memlm.trainer.checkpoint.safe_load import verify_folder
from memlm.trainer.checkpoint.store import find_checkpoint
from memlm.trainer.checkpoint.weights import load_weights
from memlm.trainer.config.run_config import flatten
from memlm.trainer.inference.evaluate import evaluate
from memlm.trainer.runtime import distributed, faults, heartbeat
from memlm.trainer.runtime import process as runtime
from memlm.trainer.runtime.lean_import import import_deepspeed
from memlm.trainer.runtime.peer_watch import PeerWatch
from memlm.trainer.runtime.quiet import route_library_loggers
from memlm.trainer.tracking.tracker import Tracker

from . import nonfinite
from .ds_config import deepspeed_config, trainer_clips
from .preemption import Interrupted, Preempted, StopRequest
from .progress import Progress
from .recurrence import make_recurrence
from .schedule import make_scheduler, rebase
from .step_figures import StepFigures

# The dtype of the carried memory state per deepspeed.precision: the dtype of the layer inputs it caches (torch's
# names: torch itself is imported when a run builds).
MEMORY_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class TrainingStopped(ResumeError):
    """train.max_bad_steps steps in a row were skipped (non-finite loss or gradient): the run stops, exit 2 (the
    command line prints the message, which names the last good checkpoint, as one line)."""


def run(cfg, out: str | os.PathLike | None = None, resume: bool = False, reshard: bool = False,
        stop_at: int | None = None, reporter: Callable[[dict], None] | None = None, overwrite: bool = False,
        stop_when: Callable[["Trainer", dict], str | None] | None = None) -> Path:
    """Train `cfg` (a validated RunConfig) into run folder `out`; returns the run folder.

    A folder that already holds a run is refused unless `resume` (continue it) or `overwrite` (delete it first):
    trainer/checkpoint/run_folder.py. A SIGTERM saves at the next step boundary and raises Preempted
    (trainer/loop/preemption.py).

    stop_at: leave after that step with a checkpoint, as a preempted job would (the schedule still spans
    train.steps, so `--resume` continues the same trajectory).
    reporter: called on rank 0 with every metrics row (the metrics.jsonl line) and, after each validation pass,
    with {"step", "valid_nll", "valid_ppl", "valid_bpc"}; a Ray Tune trial forwards them to tune.report.
    stop_when: early stopping, asked after each validation pass (train.eval_every) with the trainer and that pass's
    figures (as the reporter gets them): a reason (a non-empty string) ends training at this step as reaching
    train.steps would (a checkpoint, the MLflow run FINISHED), said in one line. Every rank asks it and must get the
    same answer (`memlm curriculum`: one rank; its held-out answer accuracy, trainer/loop/curriculum_stop.py).
    """
    run_dir = Path(out or Path("runs") / cfg.model.arch)
    try:
        with disk_full.full_disk_is_one_line(run_dir):  # anywhere: one line naming the file and the last checkpoint
            return open_trainer(cfg, run_dir, resume=resume, reshard=reshard, overwrite=overwrite,
                                reporter=reporter, stop_when=stop_when).fit(stop_at)
    finally:  # also when the start was refused
        heartbeat.stop()
        run_lock.release(run_dir)  # claim() took it


def open_trainer(cfg, out: str | os.PathLike | None = None, *, resume: bool = False, reshard: bool = False,
                 overwrite: bool = False, reporter: Callable[[dict], None] | None = None,
                 stop_when: Callable[["Trainer", dict], str | None] | None = None) -> "Trainer":
    """Everything `run` does before training, for callers that step the trainer themselves (benchmarks): the data
    and the checkpoint to resume from checked, the run folder claimed, this process set up. Then `build()` and
    `train_step()`, or `fit()`."""
    data = location_of(cfg.data)  # a folder, or a URL with data.remote's retries (data_pipeline/remote/)
    manifest = load_manifest(data)  # DataError before any process group or build
    check_vocab_size(manifest, cfg.model.vocab_size)
    check_backbone_tokenizer(manifest, cfg.model.backbone, data)  # a backbone's own tokenizer.json
    run_dir = Path(out or Path("runs") / cfg.model.arch)
    ckpt_dir = run_dir / "checkpoints"
    info = distributed.setup_env()
    _check_device(cfg, info.device)
    run_folder.claim(run_dir, resume, overwrite, info.rank)
    runtime.prepare_process(who="train")  # threads that fit this rank's cores; the op cache of this environment
    if info.rank == 0:
        heartbeat.start("memlm train")  # a slow start says what it is doing (heartbeat.py)
    meta = run_meta(cfg, info.world_size, manifest)
    tag = checkpoint.latest_tag(ckpt_dir) if resume else None
    changes = []
    if tag is not None and not reshard:  # refuse before the (slow) engine build
        checkpoint.check_compatible(checkpoint.read_meta(ckpt_dir, tag), meta, ckpt_dir / tag)
        changes = resume_policy.check_resume(cfg, run_dir, ckpt_dir / tag, checkpoint.step_of(tag))
    if tag is not None:  # DeepSpeed unpickles its files in full: prove first that none of them can run code
        heartbeat.phase(f"checking checkpoint {ckpt_dir / tag}")
        verify_folder(ckpt_dir / tag)
    if tag is None and resume and info.rank == 0 and run_folder.existing_run(run_dir):
        print(f"memlm train: no checkpoint in {ckpt_dir}; starting from step 0", file=sys.stderr)
    trainer = Trainer(cfg, run_dir, info, meta, manifest, reporter, resume_tag=tag, reshard=reshard,
                      stop_when=stop_when)
    trainer.config_changes = changes
    return trainer


def load_initial_weights(model, run_dir: Path) -> None:
    """train.init_from: the model weights of run_dir's latest checkpoint, which must fit this model exactly."""
    ckpt_dir, tag = find_checkpoint(run_dir, None)
    state, own = load_weights(ckpt_dir, tag), model.state_dict()
    misfits = [f"{k}: {tuple(state[k].shape)} there, {tuple(v.shape)} here" for k, v in own.items()
               if k in state and state[k].shape != v.shape]
    misfits += [f"{k} missing there" for k in own if k not in state]
    misfits += [f"{k} not in this model" for k in state if k not in own]
    if misfits:
        more = f" and {len(misfits) - 1} more" if len(misfits) > 1 else ""
        raise ConfigError(f"train.init_from={run_dir}: its weights ({ckpt_dir / tag}) do not fit this model "
                          f"({misfits[0]}{more}); start from a run of the same model config")
    model.load_state_dict(state, strict=True)


def _check_device(cfg, device: str) -> None:
    """Settings this device or this torch cannot train with, refused in one line before anything starts."""
    if cfg.deepspeed.precision == "fp16" and device == "cpu":
        # DeepSpeed's CPU accelerator has no fp16 and says so only deep inside initialize, as a traceback.
        raise ConfigError("deepspeed.precision=fp16 needs CUDA GPUs (DeepSpeed's CPU accelerator has no fp16); "
                          "use deepspeed.precision=bf16 or fp32 on this machine")
    if cfg.model.attention == "flex" and device == "cpu":
        raise ConfigError("model.attention=flex trains on CUDA GPUs only (FlexAttention has no CPU backward); use "
                          "model.attention=auto (FlexAttention on GPUs, einsums here) or eager")
    if cfg.train.compile:
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if cfg.train.compile_backend not in backends:  # torch.compile would say so only at the first step
            raise ConfigError(f"train.compile_backend: torch.compile has no backend {cfg.train.compile_backend!r}; "
                              f"try inductor (the default) or aot_eager (valid: {', '.join(backends)})")


def run_meta(cfg, world_size: int, manifest: dict) -> dict:
    """What a checkpoint must match to be resumed without --reshard (meta.json; checkpoint.check_compatible)."""
    tokenizer = {k: manifest["tokenizer"].get(k) for k in ("kind", "vocab_size", "sha256")}
    # "config": what trained up to the checkpoint, which a resume compares with its own (resume_policy.py)
    return {"world_size": world_size, "arch": cfg.model.arch, "tokenizer": tokenizer, "seed": cfg.train.seed,
            "config": flatten(cfg)}


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """One rank's training: the DeepSpeed engine, the stream, the recurrent memory and the counters below.

    Its own saved state (`state_dict`): the step, the tokens trained on and the steps skipped. A checkpoint holds
    that and the other pieces `checkpointed()` names, each saved by the object that owns it."""

    def __init__(self, cfg, run_dir: Path, info, meta: dict, manifest: dict,
                 reporter: Callable[[dict], None] | None = None, resume_tag: str | None = None,
                 reshard: bool = False, stop_when: Callable[["Trainer", dict], str | None] | None = None):
        self.cfg, self.run_dir, self.info, self.meta, self.manifest = cfg, run_dir, info, meta, manifest
        self.reporter = reporter if info.rank == 0 else None
        self.stop_when = stop_when  # early stopping after a validation pass (run's docstring)
        self.rank = info.rank
        self.resume_tag, self.reshard = resume_tag, reshard
        self.ckpt_dir = run_dir / "checkpoints"
        self.stop = StopRequest(cfg.train.stop_grace_s, self.rank, self._last_checkpoint)
        self.step, self.tokens_seen = 0, 0
        self.skipped_steps, self.bad_streak = 0, 0  # steps skipped for a non-finite loss/gradient: all, in a row
        self.built = False
        self.config_changes: list = []  # what a resume changed in the config (resume_policy.py), from open_trainer
        self.watch = None  # the peer watch of a multi-rank run (trainer/runtime/peer_watch.py), from build()

    # -- saved state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen, self.skipped_steps = state["step"], state["tokens"], state["skipped_steps"]
        self.bad_streak = 0  # a checkpoint is only written after a good step

    def checkpointed(self) -> dict:
        """This rank's state outside the DeepSpeed engine, by the name it is saved under in rank{r}.pt."""
        return {"trainer": self, "recurrence": self.recurrence, "stream": self.stream, "rng": RNGState()}

    # -- setup -------------------------------------------------------------------------------------------------
    def build(self) -> None:
        """The engine, the stream and the empty memory; once (fit() calls it when the caller has not)."""
        if self.built:
            return
        import torch

        deepspeed = import_deepspeed()  # without the autotuner's MLflow import (runtime/lean_import.py)

        cfg = self.cfg
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        distributed.init(self.info, log_dir=self.run_dir)  # DeepSpeed's set-up prints go to RUN_DIR/library.log
        self.watch = PeerWatch.start(self.rank, self.info.world_size, cfg.train.peer_timeout_s, self._last_checkpoint)
        # Every rank seeds the same: identical initial weights, then the rank offsets dropout streams.
        seed_everything(cfg.train.seed)
        model = build_model(cfg.model)
        if cfg.train.init_from and self.resume_tag is None:
            load_initial_weights(model, Path(cfg.train.init_from))
        if cfg.train.compile:
            # In place: parameter names and checkpoints stay those of the plain model.
            compile_in_place = model.compile_layers if cfg.train.compile_scope == "layer" else model.compile
            compile_in_place(dynamic=False, backend=cfg.train.compile_backend)
        seed_everything(cfg.train.seed + 1000 * self.rank)
        self.ds_conf = deepspeed_config(cfg, self.info.world_size)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "eval").mkdir(exist_ok=True)
        route_library_loggers(self.run_dir)  # DeepSpeed's INFO lines to RUN_DIR/library.log, warnings to the console
        heartbeat.phase("building the DeepSpeed engine")
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.ds_conf, lr_scheduler=lambda opt: make_scheduler(opt, cfg.train))
        if self.info.world_size == 1 and cfg.deepspeed.zero_stage == 0:
            # One rank has nothing to average, yet DeepSpeed would still flatten every gradient into buckets,
            # all-reduce them over gloo and copy them back (~5% of a CPU step, bench/benchmarks/bench_trainer.py).
            # DeepSpeed
            # takes this same path itself when it has no process group. ZeRO >= 1 partitions through the
            # reduction, so it keeps it.
            self.engine.enable_backward_allreduce = False
        self.device = self.engine.device
        self.stream = LaneStream.from_config(cfg.data, "train", mode="train", seg_len=cfg.model.tgt_len,
                                             rank=self.rank, world_size=self.info.world_size)
        # The memory in the dtype the engine computes in (DeepSpeed's bf16/fp16 cast the model): a state that
        # began fp32 and came back bf16 from the first segment would recompile a compiled forward at the second.
        dtype = getattr(torch, MEMORY_DTYPES[cfg.deepspeed.precision])
        memory = model.init_memory(cfg.data.batch_size, device=self.device, dtype=dtype)
        self.recurrence = make_recurrence(cfg.model, memory, self.device)
        self.poison = faults.Poison(self.rank)
        self.built = True
        heartbeat.phase(None)

    def _restore(self, tag: str, reshard: bool) -> None:
        if reshard:
            self._load_resharded(tag)
            return
        path, _ = self.engine.load_checkpoint(str(self.ckpt_dir), tag=tag)
        if path is None:
            raise ResumeError(f"DeepSpeed could not load {self.ckpt_dir / tag}")
        checkpoint.restore_rank(self.ckpt_dir, tag, self.rank, self.checkpointed())

    def _load_resharded(self, tag: str) -> None:
        # Only the consolidated fp32 weights: the optimizer, schedule position and data cursor start over.
        # load_weights reads any ZeRO stage (zero_to_fp32 alone fails on a ZeRO-0 folder, which holds no optimizer
        # partitions) and refuses a file that could run code.
        state = load_weights(self.ckpt_dir, tag)
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
    def train_step(self, log: bool = True) -> dict:
        """One optimizer step: train.grad_accum micro-batches (recurrence.py), engine.backward once each, engine.step
        after each (DeepSpeed steps the optimizer on the last). Before that last engine.step one all-reduce adds every
        rank's NLL, target and token counts and its non-finite flags (StepFigures; loss, and at ZeRO-0 the gradient
        norm, which the optimizer does not check there): any flag skips the update on every rank alike
        (nonfinite.py). ZeRO 1-3 also skip on a non-finite global gradient norm inside DeepSpeed, seen here as
        engine.skipped_steps. Returns the step's row figures: loss, inputs, lr, grad_norm, skipped, stop.

        Host reads of device values (each one drains a GPU's queue): one per step, the figures, because the skip is
        decided on the host before the optimizer runs (DeepSpeed's own optimizers read their overflow flag on the
        host too). Batches go to the device without one (batch_transfer.py). `log=False`, for a step that writes no
        metrics row, leaves out the only other read: DeepSpeed's gradient norm (ZeRO 1-3, bf16), grad_norm None."""
        import torch

        engine, device = self.engine, self.device
        lr = engine.get_lr()[0]  # the rate this step uses (the scheduler advances inside engine.step)
        faults.at("error", step=self.step + 1, rank=self.rank)  # test hook: a bug on one rank
        self.poison.param(self.step + 1, engine.module)
        nll, count, inputs = [], 0, 0
        bad_loss = torch.zeros((), dtype=torch.bool, device=device)
        ds_skipped_before, skip = engine.skipped_steps, False
        for micro in range(self.cfg.train.grad_accum):
            batch = self.recurrence.step(engine, lambda: next(self.stream))
            loss = self.poison.loss(self.step + 1, micro, batch.loss)
            engine.backward(loss)
            faults.at("step", step=self.step + 1, rank=self.rank)  # test hook: a preemption mid-step
            bad_loss |= ~torch.isfinite(loss.detach())  # stays on the device: no sync per micro-batch
            nll.append(batch.nll)
            count, inputs = count + batch.count, inputs + batch.inputs
            if engine.is_gradient_accumulation_boundary():
                figures = self._agree(torch.stack(nll).sum(), count, inputs, bad_loss, self.stop.requested)
                skip = figures.skip
                if skip:
                    with nonfinite.skipped_update(engine.optimizer):
                        engine.step()
                else:
                    engine.step()
            else:
                engine.step()
            self.recurrence.advance()
            if micro < self.cfg.train.grad_accum - 1:  # test hook: a preemption between micro-batches
                faults.at("micro", step=self.step + 1, rank=self.rank)
        ds_skipped = engine.skipped_steps > ds_skipped_before
        if skip and not ds_skipped:  # the skip is the whole point: never let it pass silently
            raise RuntimeError(f"DeepSpeed applied step {self.step + 1}, which memlm asked it to skip "
                               f"(optimizer {type(engine.optimizer).__name__})")
        self.step += 1
        if skip or ds_skipped:
            return {**self._skipped(figures), "stop": figures.stop > 0}
        self.bad_streak = 0
        self.tokens_seen += int(figures.targets)
        return {"loss": figures.nll / max(figures.targets, 1), "inputs": int(figures.inputs), "lr": lr,
                "grad_norm": self._grad_norm(figures) if log else None, "skipped": False, "stop": figures.stop > 0}

    def _grad_norm(self, figures: StepFigures) -> float:
        """What the optimizer computed in its step (ZeRO 1-3, DeepSpeed's bf16 optimizer), else the ZeRO-0 check's
        (read with the figures). DeepSpeed's is a device value here: reading it waits for the optimizer's kernels."""
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else figures.grad_norm

    def _agree(self, nll, count: int, inputs: int, bad_loss, stop: bool) -> StepFigures:
        """This step's figures summed over ranks, with the ZeRO-0 gradient norm (StepFigures: the step's one
        all-reduce and its one host read)."""
        import torch

        grad_norm = None
        bad_grad = torch.zeros((), dtype=torch.bool, device=self.device)
        if self.cfg.deepspeed.zero_stage == 0:
            # The gradients are whole (and averaged over ranks) here, so their norm is the global one, before
            # clipping, as ZeRO reports it. One pass over them: the check a plain torch optimizer lacks.
            params = [p for p in self.engine.module.parameters() if p.grad is not None]
            norm = (torch.nn.utils.get_total_norm([p.grad for p in params]) if params else
                    torch.zeros((), device=self.device))
            bad_grad, grad_norm = ~torch.isfinite(norm), norm
            if params and trainer_clips(self.cfg):  # DeepSpeed's clip_grad_norm_ rule from this norm: no host value
                torch.nn.utils.clip_grads_with_norm_(params, self.cfg.train.clip, norm)
        return StepFigures.summed(nll, count, inputs, bad_loss, bad_grad, stop, self.info.world_size, grad_norm)

    def _skipped(self, figures: StepFigures) -> dict:
        """After a skipped step: count it, empty the memory, say so on rank 0; the metrics row holds no loss."""
        self.skipped_steps += 1
        self.bad_streak += 1
        # The memory this step carried forward came from a forward that went wrong (it may hold inf/NaN); going
        # back to the memory before the step would hand a lane that started a new document inside the skipped
        # segments its previous document's memory. Empty memory is what every lane has at a document start.
        self.recurrence.clear()
        world = self.info.world_size
        if figures.bad_loss > 0:
            why = f"the loss was not finite on {int(figures.bad_loss)} of {world} rank(s)"
        else:
            why = "the gradient norm was not finite"
        if self.rank == 0:
            print(f"memlm train: warning: step {self.step} skipped: {why}; weights, optimizer state and learning-rate "
                  f"schedule unchanged, memory emptied ({self.bad_streak} in a row, train.max_bad_steps="
                  f"{self.cfg.train.max_bad_steps})", file=sys.stderr, flush=True)
        return {"loss": None, "inputs": int(figures.inputs), "lr": self.engine.get_lr()[0], "grad_norm": None,
                "skipped": True}

    # -- loop --------------------------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> Path:
        """Train to train.steps (or `stop_at`), resuming from `resume_tag` first; returns the run folder.

        With several ranks, an error here is posted for the peers, which end at once (peer_watch.py); an error that
        is a peer's death seen through a collective becomes one PeerFailure line naming that peer. Preemption,
        Ctrl-C and TrainingStopped happen on every rank alike and pass as they are."""
        try:
            self.build()
            return self._fit(stop_at)
        except (Preempted, KeyboardInterrupt, SystemExit, TrainingStopped):
            raise
        except Exception as exc:
            named = self._with_last_checkpoint(exc)
            raised = self.watch.failed(named) if self.watch is not None else named
            if raised is exc:
                raise
            raise raised from None
        finally:
            if self.watch is not None:
                self.watch.stop()
            heartbeat.stop()
            run_lock.release(self.run_dir)

    def _with_last_checkpoint(self, exc: Exception) -> Exception:
        """A data source that stayed away past data.remote.retries (a URL's shard, data_pipeline/remote/fetch.py) ends
        the run with the checkpoint that `--resume` continues from, in the same line."""
        if not isinstance(exc, FetchFailed):
            return exc
        tag = checkpoint.latest_tag(self.ckpt_dir)
        where = (f"the last checkpoint is {self.ckpt_dir / tag}: `memlm train ... --resume` continues from it"
                 if tag else "no checkpoint was saved yet: the run starts over")
        return FetchFailed(f"{exc}; {where}")

    def _fit(self, stop_at: int | None) -> Path:
        tag, reshard = self.resume_tag, self.reshard
        if tag is not None:
            heartbeat.phase(f"loading checkpoint {self.ckpt_dir / tag}")
            self._restore(tag, reshard)
            self._say(f"resumed from {self.ckpt_dir / tag} at step {self.step}" if not reshard else
                      f"weights of {self.ckpt_dir / tag} loaded; training from step 0")
            if self.config_changes and not reshard:  # the new values take effect from here, said in one line
                lr = rebase(self.engine.lr_scheduler, self.cfg.train)
                self._say(resume_policy.applied_line(self.config_changes, self.step, lr))
        if self.rank == 0:  # what the folder says now matches the step training continues from
            run_folder.rewind(self.run_dir, self.step, reshard=reshard and tag is not None)
            # Only now, the checkpoint restored: config.yaml says what trains (config_record.py)
            config_record.write_run_config(self.run_dir, self.cfg, self.ds_conf, self.config_changes, self.step, tag)
        heartbeat.phase("opening MLflow tracking")
        tracker = self._tracker()
        if self.watch is not None:  # ended by a peer's fault from the watch thread: the MLflow run says FAILED
            self.watch.on_abort.append(lambda: tracker.finish("FAILED"))
        cfg = self.cfg.train
        progress = Progress(self.rank, self.step, cfg.steps)
        metrics_path = self.run_dir / "metrics.jsonl"
        status = "FAILED"
        end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        first_row = min((self.step // cfg.log_every + 1) * cfg.log_every, end)
        heartbeat.phase(f"training: the first metrics row comes at step {first_row}")
        try:
            with self.stop.installed():
                self._loop(tracker, progress, metrics_path, end)
            status = "FINISHED"
        except Preempted:
            status = "KILLED"
            raise
        except KeyboardInterrupt:
            status = "KILLED"
            raise Interrupted(f"at step {self.step}; {self._last_checkpoint()}") from None
        except SystemExit:
            # Ray Tune stops a trial (ASHA, a stop criterion) by sys.exit(0) inside tune.report, in the trial's
            # thread: the run was ended from outside, not failed. The sweep also marks it KILLED once the trial
            # is over; this side must agree, whichever of the two writes last.
            status = "KILLED"
            raise
        finally:
            progress.close()
            tracker.finish(status)
        return self.run_dir

    def _loop(self, tracker, progress, metrics_path: Path, end: int) -> None:
        cfg = self.cfg.train

        def logged(step: int) -> bool:  # steps that write a metrics row (and so need their grad norm)
            return step % cfg.log_every == 0 or step == end

        window_start, window_inputs = time.perf_counter(), 0
        while self.step < end:
            runtime.refit_threads()  # fewer threads while other processes keep this rank's cores busy
            result = self.train_step(log=logged(self.step + 1))
            window_inputs += result["inputs"]
            if logged(self.step) or result["skipped"]:
                elapsed = max(time.perf_counter() - window_start, 1e-9)
                loss = result["loss"]  # None on a skipped step: a row never reports a NaN
                row = {"step": self.step, "loss": loss,
                       "ppl": math.exp(min(loss, 50.0)) if loss is not None else None,
                       "lr": result["lr"], "grad_norm": result["grad_norm"],
                       "tokens_per_s": window_inputs / elapsed, "tokens": self.tokens_seen,
                       "skipped_steps": self.skipped_steps, "peak_mem_mb": peak_memory_mb(self.device)}
                if self.rank == 0:
                    with metrics_path.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                tracker.log_metrics(self.step, {k: v for k, v in row.items() if k != "step" and v is not None})
                if not result["skipped"]:  # a skipped step has said so in its own line
                    progress.update(row)
                if self.reporter is not None:
                    self.reporter(row)
                window_start, window_inputs = time.perf_counter(), 0
            if self.bad_streak >= cfg.max_bad_steps:
                raise TrainingStopped(self._stop_message())
            stop = result["stop"] and self.step < end  # a SIGTERM during the last step: the run is complete
            # A validation due at this step runs even when stopping: a resume continues after the step and would
            # never run it (the grace period must cover it; train.eval_batches bounds it).
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                valid = self._evaluate(tracker)
                reason = self.stop_when(self, {"step": self.step, **valid}) if self.stop_when is not None else None
                if reason and self.step < end and not stop:
                    # Ends here as train.steps would: this step's checkpoint below, the run FINISHED.
                    self._say(f"stopping at step {self.step} of {end}: {reason}")
                    end = self.step
            if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == end or stop:
                self._save_unless_skipped(progress)
            if stop:
                raise Preempted(f"stopped by SIGTERM after step {self.step}; {self._last_checkpoint()}")

    def _save_unless_skipped(self, progress) -> None:
        if self.bad_streak == 0:
            self.save()
            progress.note(f"checkpoint saved at step {self.step}: {self.ckpt_dir / checkpoint.tag_for(self.step)}")
        elif self.rank == 0:  # the weights may be what goes wrong: keep the last good checkpoint
            print(f"memlm train: warning: no checkpoint at step {self.step}: the last step was skipped",
                  file=sys.stderr, flush=True)

    def _last_checkpoint(self) -> str:
        tag = checkpoint.latest_tag(self.ckpt_dir)
        return (f"the last checkpoint is {self.ckpt_dir / tag}: rerun with --resume to continue" if tag else
                "no checkpoint was written: the run starts over")

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"memlm train: {message}", file=sys.stderr, flush=True)

    def _stop_message(self) -> str:
        tag = checkpoint.latest_tag(self.ckpt_dir)
        last = (f"the last good checkpoint {self.ckpt_dir / tag} is untouched; resume from it" if tag else
                "no checkpoint was written; start again")
        return (f"training stopped at step {self.step}: {self.bad_streak} steps in a row had a non-finite loss or "
                f"gradient norm (train.max_bad_steps={self.cfg.train.max_bad_steps}); {last} with a lower train.lr "
                "or train.clip, or look for bad data or weights near this step")

    def save(self) -> str:
        return checkpoint.save(self.engine, self.ckpt_dir, self.step, self.rank, self.checkpointed(), self.meta,
                               self.cfg.train.keep_last)

    def _tracker(self):
        tracker = Tracker(self.cfg.tracking, self.run_dir, self.rank, self.cfg)
        tracker.set_tags({"arch": self.cfg.model.arch})
        if self.rank == 0:
            for name in ("config.yaml", "ds_config.json", config_record.HISTORY):
                if (self.run_dir / name).is_file():
                    tracker.log_artifact(self.run_dir / name)
        return tracker

    def _evaluate(self, tracker) -> dict:
        import torch

        # Evaluation draws no random numbers we rely on, but keep the training RNG untouched regardless.
        with rng_preserved(), torch.no_grad():
            self.engine.eval()
            result = evaluate(self.engine.module, location_of(self.cfg.data), "valid", lanes=self.cfg.data.eval_lanes,
                              seg_len=self.cfg.model.tgt_len, rank=self.rank, world_size=self.info.world_size,
                              device=self.device, max_batches=self.cfg.train.eval_batches,
                              continuous=self.cfg.data.continuous)
            self.engine.train()
        faults.at("validation", step=self.step, rank=self.rank)  # test hook: before the pass is recorded
        if self.rank == 0:
            eval_json = self.run_dir / "eval" / f"step{self.step}.json"
            eval_json.write_text(json.dumps({**result, "step": self.step}) + "\n")
            tracker.log_artifact(eval_json, "eval")
        valid = {f"valid_{k}": result[k] for k in ("nll", "ppl", "bpc") if k in result}
        tracker.log_metrics(self.step, valid)
        if self.reporter is not None:
            self.reporter({"step": self.step, **valid})
        return valid


def peak_memory_mb(device) -> float:
    """This rank's peak memory so far in MiB: allocated GPU memory on CUDA, else the process's peak RSS."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
