"""The run configuration: typed sections, YAML presets with `inherit:`, dotted overrides, one validation.

    cfg = load_config("tiny/txl", ["model.mem_len=16", "train.lr=1e-3"])               # a preset, or a YAML path
    cfg = config_from_dict({"model": {"arch": "lamemo"}}, {"train.steps": 50})          # sweeps: dicts and values
    flatten(cfg)["model.mem_len"]                                                       # MLflow params
    dump_yaml(cfg, run_dir / "config.yaml")                                             # reloads to an equal config

Every user mistake is a ConfigError (a ValueError) whose one-line message names the dotted key.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from memlm.data_pipeline.config import DataConfig
from memlm.models.config import ATTENTION_KERNELS, BPTT_MODES, RPE_KINDS, ConfigError, ModelConfig
from memlm.models.registry import ARCHITECTURES, arch_spec

from . import presets
from .schema import (
    build,
    convert,
    field_types,
    flatten_dict,
    key_type,
    load_tree,
    parse_yaml_value,
    set_dotted,
    to_dict,
    to_yaml,
)

SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adam", "adamw")
COMPILE_SCOPES = ("model", "layer")  # what train.compile compiles: the whole forward, or one layer's work
PRECISIONS = ("fp32", "bf16", "fp16")
SPLITS = ("valid", "test")


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps
    lr: float = 2.5e-4
    min_lr_ratio: float = 0.0  # cosine/linear decay ends at lr * min_lr_ratio (the papers decay to 0)
    warmup_steps: int = 0  # linear warmup from 0, then the schedule
    schedule: str = "cosine"
    optimizer: str = "adam"
    weight_decay: float = 0.0  # L2 for adam, decoupled for adamw
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    clip: float = 0.25  # gradient-norm clipping (Transformer-XL's default); 0 disables it
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 1111  # parameters, dropout
    save_every: int = 1000  # steps between checkpoints; 0 saves only at the end
    keep_last: int = 3  # checkpoints kept on disk
    eval_every: int = 1000  # steps between validation passes; 0 never validates during training
    eval_batches: int = 0  # per-rank batches per validation pass; 0 reads the whole valid split
    log_every: int = 10  # steps between metrics lines / MLflow points
    deterministic: bool = False  # torch.use_deterministic_algorithms (slower; bit-reproducible on GPU too)
    # torch.compile the model's forward (and so its backward) in place: every segment has the same shapes (memory
    # buffers are full-length from step 0, masked by validity), so it compiles once, at the first steps.
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend ("aot_eager": traced, not code-generated)
    # What is compiled: "model" (the whole forward, one graph of n_layer unrolled layers) or "layer" (one layer's
    # work, one graph every layer reuses: compile time of one layer, not n_layer; embedding, masks and head eager).
    compile_scope: str = "model"
    # A step whose loss or gradient norm is not finite (on any rank) is skipped; this many in a row stop the run
    max_bad_steps: int = 10
    # After SIGTERM (a scheduler's preemption) the run saves at the next step boundary; if none comes within this
    # many seconds it leaves without (0: wait for it however long). SLURM's and Kubernetes' default grace is 30 s.
    stop_grace_s: float = 30.0
    # With several ranks: a rank silent this long (SIGKILLed, its node lost) ends the whole job, with one line naming
    # it; a rank's error ends the others at once (trainer/runtime/peer_watch.py). 0 turns the watch off.
    peer_timeout_s: float = 60.0
    # A run folder whose latest checkpoint's model weights start this run (optimizer, schedule, data stream and
    # memory start fresh): a curriculum stage from the previous stage (`memlm curriculum`), a fine-tune. "" = none.
    # A resumed run restores its own checkpoint and ignores it.
    init_from: str = ""

    def validate(self) -> "TrainConfig":
        _at_least(self, "train", steps=1, grad_accum=1, keep_last=1, log_every=1, max_bad_steps=1)
        _at_least(self, "train", warmup_steps=0, save_every=0, eval_every=0, eval_batches=0, seed=0,
                  weight_decay=0.0, clip=0.0, stop_grace_s=0.0,
                  peer_timeout_s=0.0)
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps > self.steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} exceeds train.steps={self.steps}")
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ConfigError(f"train.adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        if self.adam_eps <= 0:
            raise ConfigError(f"train.adam_eps must be > 0, got {self.adam_eps}")
        return self


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0  # ZeRO 0-3
    precision: str = "fp32"
    offload_optimizer: bool = False  # optimizer state on the CPU (ZeRO >= 1)
    offload_params: bool = False  # parameters on the CPU (ZeRO-3 only)
    loss_scale: float = 0.0  # fp16 only: 0 means dynamic loss scaling
    # DeepSpeed's torch Adam instead of its fused/cpu Adam: identical maths, and no minutes-long JIT build of
    # fused_adam / cpu_adam on first use (docs/design.md §9). Turn off on GPUs for the fused kernels' speed.
    torch_adam: bool = True
    # Gradient reduction bucket, in elements (ZeRO >= 1); 0 keeps DeepSpeed's default of 5e8. Under ZeRO-3 the
    # bucket's buffer is allocated at this size and keeps a model's worth of gradients resident on every rank
    # (bench/README.md, Memory): a few million elements bring ZeRO-3 to its sharded footprint.
    reduce_bucket_size: int = 0
    # ZeRO-3: parameters of at most this many elements stay whole on every rank (no gather per use); -1 keeps
    # DeepSpeed's default of 1e5, 0 shards every parameter.
    param_persistence_threshold: int = -1

    def validate(self) -> "DeepSpeedConfig":
        if not 0 <= self.zero_stage <= 3:
            raise ConfigError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.reduce_bucket_size < 0:
            raise ConfigError(f"deepspeed.reduce_bucket_size must be >= 0 elements (0: DeepSpeed's default), "
                              f"got {self.reduce_bucket_size}")
        if self.reduce_bucket_size > 0 and self.zero_stage == 0:
            raise ConfigError("deepspeed.reduce_bucket_size needs deepspeed.zero_stage >= 1 (ZeRO-0 has no reduction "
                              "bucket), got zero_stage 0")
        if self.param_persistence_threshold < -1:
            raise ConfigError(f"deepspeed.param_persistence_threshold must be >= 0 elements, or -1 for DeepSpeed's "
                              f"default, got {self.param_persistence_threshold}")
        if self.param_persistence_threshold >= 0 and self.zero_stage != 3:
            raise ConfigError(f"deepspeed.param_persistence_threshold needs deepspeed.zero_stage: 3 (only ZeRO-3 "
                              f"shards parameters), got zero_stage {self.zero_stage}")
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError(
                f"deepspeed.offload_params needs deepspeed.zero_stage: 3 (parameter offload is ZeRO-3 only), "
                f"got zero_stage {self.zero_stage}"
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ConfigError("deepspeed.offload_optimizer needs deepspeed.zero_stage >= 1, got zero_stage 0")
        if self.loss_scale < 0:
            raise ConfigError(f"deepspeed.loss_scale must be >= 0 (0 means dynamic), got {self.loss_scale}")
        if self.loss_scale > 0 and self.precision != "fp16":
            raise ConfigError(f"deepspeed.loss_scale only applies to precision fp16 (precision is {self.precision!r})")
        return self


@dataclass
class TrackingConfig:
    enabled: bool = True
    experiment: str = "memlm"
    uri: str = ""  # empty: $MLFLOW_TRACKING_URI, else a SQLite file mlflow.db in the working folder
    run_name: str = ""  # empty: the folder's name (led by the arch) plus the MLflow run id's first 6 characters
    parent_run_id: str = ""  # an MLflow run to nest this one under (a sweep's parent run); empty: top level

    def validate(self) -> "TrackingConfig":
        if self.enabled and not self.experiment:
            raise ConfigError("tracking.experiment must not be empty while tracking.enabled is true")
        return self

    def resolved_uri(self, cwd: str | Path | None = None) -> str:
        """The MLflow tracking URI this run uses. The SQLite path is absolute so Ray workers in other folders
        write to the same store."""
        if self.uri:
            return self.uri
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        return f"sqlite:///{(Path(cwd or os.getcwd()) / 'mlflow.db').resolve()}"


@dataclass
class EvalConfig:
    """Settings of `memlm eval`; each unset value means the trained model's own."""

    split: str = "valid"
    tgt_len: int = 0  # 0: model.tgt_len
    mem_len: int = -1  # -1: model.mem_len (0 is a real choice: no memory)
    mem_mult: float = 0.0  # > 0: mem_len = round(mem_mult * tgt_len) (the extrapolation runs' m)
    clamp_len: Optional[int] = None  # None: model.clamp_len
    same_length: Optional[bool] = None  # None: model.same_length

    def validate(self) -> "EvalConfig":
        if self.tgt_len < 0:
            raise ConfigError(f"eval.tgt_len must be >= 0 (0 means model.tgt_len), got {self.tgt_len}")
        if self.mem_len < -1:
            raise ConfigError(f"eval.mem_len must be >= 0, or -1 for model.mem_len, got {self.mem_len}")
        if self.mem_mult < 0:
            raise ConfigError(f"eval.mem_mult must be >= 0 (0 means unset), got {self.mem_mult}")
        return self


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# Fields limited to a fixed set of strings, by dotted key (the type checker reads this table). The archs are the
# registry's own keys, read when a config is checked: an entry is all an arch needs (models/README.md).
CHOICES: dict[str, Collection[str]] = {
    "model.arch": ARCHITECTURES.keys(),
    "model.rpe": RPE_KINDS,
    "model.bptt_mode": BPTT_MODES,
    "model.attention": ATTENTION_KERNELS,
    "train.schedule": SCHEDULES,
    "train.optimizer": OPTIMIZERS,
    "train.compile_scope": COMPILE_SCOPES,
    "deepspeed.precision": PRECISIONS,
    "eval.split": SPLITS,
}

# "dotted.key=value" strings from a command line, or {dotted key: value} from code (sweeps).
Overrides = Union[Iterable[str], Mapping[str, Any]]


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path, overrides: Overrides = ()) -> RunConfig:
    """The validated RunConfig of a YAML file or a preset's name (with its `inherit:` chain) and dotted overrides.

    An existing file wins over a preset of the same name; `inherit:` values may name presets too (presets.py)."""
    return config_from_dict(load_tree(presets.find(path), find_parent=presets.find), overrides)


def config_from_dict(data: Mapping[str, Any], overrides: Overrides = ()) -> RunConfig:
    """The validated RunConfig of a nested dict (sections -> keys) and dotted overrides."""
    tree = apply_overrides(data, overrides)
    return validate_config(build(RunConfig, tree, choices=CHOICES))


def override_config(cfg: RunConfig, overrides: Overrides) -> RunConfig:
    """A new validated RunConfig: `cfg` with dotted overrides applied (cfg itself is unchanged)."""
    return config_from_dict(config_to_dict(cfg), overrides)


def apply_overrides(data: Mapping[str, Any], overrides: Overrides) -> dict[str, Any]:
    """A copy of `data` with each override set; unknown keys and wrong types are refused here, by name."""
    tree = copy.deepcopy(dict(data))
    if isinstance(overrides, Mapping):
        items = [(str(key), value, False, f"{key}={value!r}") for key, value in overrides.items()]
    else:
        items = [(*_split_override(text), True, text) for text in overrides]
    for key, value, from_text, shown in items:
        try:
            tp = key_type(RunConfig, key)
        except ConfigError as exc:
            raise ConfigError(f"override '{shown}': {exc}") from None
        if dataclasses.is_dataclass(tp):
            raise ConfigError(f"override '{shown}': '{key}' is a section; set its keys one by one ({key}.KEY=VALUE)")
        if from_text and tp is not str:  # str fields keep the text as typed: experiment=2024 stays "2024"
            value = parse_yaml_value(value, f"override '{shown}'")
        set_dotted(tree, key, convert(tp, value, key, CHOICES))
    return tree


def _split_override(text: str) -> tuple[str, str]:
    key, sep, value = str(text).partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like dotted.key=value, e.g. model.mem_len=16")
    return key.strip(), value


# ---------------------------------------------------------------------------------------------------------------
# Validation: the one place


def validate_config(cfg: RunConfig) -> RunConfig:
    """Check types and choices, every section's validate(), then the cross-section rules; return cfg.

    Also for configs built or edited in code (dataclasses.replace), so types are checked again here.
    """
    for name, tp in field_types(RunConfig).items():
        if not isinstance(getattr(cfg, name), tp):
            raise ConfigError(f"{name}: expected a {tp.__name__}, got {type(getattr(cfg, name)).__name__}")
    build(RunConfig, config_to_dict(cfg), choices=CHOICES)
    for name in field_types(RunConfig):
        try:
            getattr(cfg, name).validate()
        except ConfigError:
            raise
        except ValueError as exc:  # data_pipeline cannot import ConfigError: it raises plain ValueErrors
            message = str(exc)
            raise ConfigError(message if message.startswith(f"{name}.") else f"{name}: {message}") from exc
    _check_across_sections(cfg)
    return cfg


def _check_across_sections(cfg: RunConfig) -> None:
    if cfg.data.num_workers > 0:
        # The stream supports loader workers for other consumers, but a training lane's memory must follow its
        # own batches, and in-process reading (~40M tokens/s, bench/results/stream_cpu.json) is already
        # thousands of times any model's training rate: workers would only add inter-process copies.
        raise ConfigError(f"data.num_workers={cfg.data.num_workers}: memlm train and eval read the shards in the "
                          "training process (the data loader is never the bottleneck); set data.num_workers: 0")
    ev = cfg.eval
    if ev.mem_len >= 0 and ev.mem_mult > 0:
        raise ConfigError(
            f"eval.mem_len={ev.mem_len} and eval.mem_mult={ev.mem_mult} are both set; "
            "set one (eval.mem_len: -1 and eval.mem_mult: 0 mean unset)"
        )
    tokens_key = arch_spec(cfg.model.arch).memory_tokens
    if tokens_key and cfg.model.mem_len == 0 and (ev.mem_len > 0 or ev.mem_mult > 0):
        # For an arch whose memory is memory tokens (RMT), mem_len is the optional Transformer-XL cache: a run
        # trained without one never learned to read it.
        raise ConfigError(f"this {cfg.model.arch} run was trained without the Transformer-XL cache (model.mem_len: "
                          "0), so --mem-len/--mem-mult would add a cache it never learned; its memory is "
                          f"model.{tokens_key} memory tokens: evaluate without --mem-len/--mem-mult")
    try:
        eval_model_config(cfg).validate()
    except ConfigError as exc:
        changed = ", ".join(f"eval.{k}={v}" for k, v in _set_eval_keys(ev).items())
        raise ConfigError(f"evaluating with {changed} is impossible: {exc}") from exc


def _set_eval_keys(ev: EvalConfig) -> dict[str, Any]:
    unset = EvalConfig()
    return {k: getattr(ev, k) for k in ("tgt_len", "mem_len", "mem_mult", "clamp_len", "same_length")
            if getattr(ev, k) != getattr(unset, k)}


def eval_model_config(cfg: RunConfig) -> ModelConfig:
    """The model settings `memlm eval` uses: cfg.model with the eval section's lengths and options applied."""
    model, ev = cfg.model, cfg.eval
    tgt_len = ev.tgt_len or model.tgt_len
    if ev.mem_len >= 0:
        mem_len = ev.mem_len
    elif ev.mem_mult > 0:
        mem_len = round(ev.mem_mult * tgt_len)
    else:
        mem_len = model.mem_len
    return dataclasses.replace(
        model,
        tgt_len=tgt_len,
        mem_len=mem_len,
        clamp_len=model.clamp_len if ev.clamp_len is None else ev.clamp_len,
        same_length=model.same_length if ev.same_length is None else ev.same_length,
    )


def _at_least(obj: Any, section: str, **minimums: float) -> None:
    for name, low in minimums.items():
        if getattr(obj, name) < low:
            raise ConfigError(f"{section}.{name} must be >= {low}, got {getattr(obj, name)}")


# ---------------------------------------------------------------------------------------------------------------
# Writing


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Nested plain dict, sections in declaration order."""
    return to_dict(cfg)


def flatten(cfg: RunConfig) -> dict[str, Any]:
    """{"model.arch": "txl", "train.adam_betas": [0.9, 0.999], ...}: every key, dotted (MLflow params)."""
    return flatten_dict(config_to_dict(cfg))


def config_to_yaml(cfg: RunConfig) -> str:
    return to_yaml(config_to_dict(cfg))


def dump_yaml(cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config; load_config(path) gives back an equal RunConfig."""
    path = Path(path)
    path.write_text(config_to_yaml(cfg), encoding="utf-8")
    return path


__all__ = [
    "CHOICES", "ConfigError", "DataConfig", "DeepSpeedConfig", "EvalConfig", "ModelConfig", "RunConfig",
    "TrackingConfig", "TrainConfig", "apply_overrides", "config_from_dict", "config_to_dict", "config_to_yaml",
    "dump_yaml", "eval_model_config", "flatten", "load_config", "override_config", "validate_config",
]
