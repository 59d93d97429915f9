"""The sweep file (`memlm sweep SWEEP.yaml`): typed settings, a search space of dotted run-config keys, and the
checks that make a typo fail in a second, before Ray starts.

    name: tiny-grid
    base: tiny/lamemo                   # run-config preset's name, or a file relative to this one
    overrides: {train.steps: 20}        # fixed for every trial (dotted keys of the run config)
    space:                              # dotted key -> one of choice / grid / uniform / loguniform / randint
      train.lr: {grid: [1.0e-3, 3.0e-3]}
      model.interp_eps: {choice: [1.0e-6, 1.0e-4]}
    num_samples: 1                      # random draws; Tune repeats the whole grid once per sample
    metric: valid_ppl                   # mode: min
    scheduler: {type: asha, grace_period: 10}
    resources: {cpus: 1, gpus: 0, workers: 1}

On the command line, dotted overrides of sweep-file keys (`resources.gpus=0`, `max_concurrent=1`) change this
file's settings; the others are run-config keys applied to every trial. Nothing here imports Ray: the file is
checked (and every trial's run config built) before Ray is started.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memlm.models.config import ConfigError
from memlm.trainer.config import presets
from memlm.trainer.config.run_config import RunConfig, apply_overrides, config_from_dict
from memlm.trainer.config.schema import (
    build,
    flatten_dict,
    key_type,
    load_tree,
    parse_yaml_value,
    read_yaml,
    set_dotted,
)

# Metrics every trial reports (trainer rows and validation rows); the sweep selects on one of them.
METRICS = ("valid_ppl", "valid_nll", "valid_bpc", "loss", "ppl")
MODES = ("min", "max")
SCHEDULERS = ("none", "asha")
# Kinds of search dimension: the listed ones enumerate values, the ranged ones draw from [low, high].
LISTED = ("choice", "grid")
RANGED = ("uniform", "loguniform", "randint")
KINDS = LISTED + RANGED


@dataclass
class SchedulerConfig:
    type: str = "none"  # none: every trial runs train.steps; asha: early stopping of the worse trials
    max_t: int = 0  # ASHA's longest trial in steps; 0: the base config's train.steps
    grace_period: int = 1  # steps a trial always gets before ASHA may stop it
    reduction_factor: int = 2  # ASHA keeps 1/reduction_factor of the trials at each rung

    def validate(self) -> "SchedulerConfig":
        if self.max_t < 0 or self.grace_period < 1 or self.reduction_factor < 2:
            raise ConfigError("scheduler: need max_t >= 0 (0 = train.steps), grace_period >= 1 and "
                              f"reduction_factor >= 2, got {self.max_t}, {self.grace_period}, {self.reduction_factor}")
        return self


@dataclass
class ResourcesConfig:
    cpus: float = 1.0  # per trial process (per worker when workers > 1)
    gpus: float = 0.0  # per trial process (per worker when workers > 1)
    workers: int = 1  # > 1: that many DeepSpeed ranks per trial through Ray Train (TorchTrainer)

    def validate(self) -> "ResourcesConfig":
        if self.cpus <= 0 or self.gpus < 0 or self.workers < 1:
            raise ConfigError(f"resources: need cpus > 0, gpus >= 0 and workers >= 1, got cpus {self.cpus}, "
                              f"gpus {self.gpus}, workers {self.workers}")
        return self


@dataclass
class SweepFile:
    """The sweep file's typed keys; `overrides` and `space` are mappings of dotted run-config keys and are
    checked against RunConfig separately (their keys are not fields here)."""

    base: str = ""
    name: str = ""  # empty: the sweep file's stem
    num_samples: int = 1
    metric: str = "valid_ppl"
    mode: str = "min"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    max_failures: int = 2  # retries of a failed trial, each from that trial's last checkpoint
    max_concurrent: int = 0  # 0: as many trials at once as the cluster's resources allow
    seed: int = 0  # random draws of the search space
    experiment: str = ""  # MLflow experiment; empty: tracking.experiment if overridden, else sweep-<name>
    tracking_uri: str = ""  # MLflow store; empty: the base config's, else $MLFLOW_TRACKING_URI, else ./mlflow.db


CHOICES = {"metric": METRICS, "mode": MODES, "scheduler.type": SCHEDULERS}


@dataclass
class Dimension:
    key: str  # dotted run-config key
    kind: str  # one of KINDS
    values: list  # the listed values, or [low, high]

    def candidates(self) -> list:
        """Values that exercise this dimension's extremes when checking configs before Ray starts."""
        if self.kind == "randint":  # Tune's randint excludes the upper bound
            return [self.values[0], self.values[1] - 1]
        return list(self.values)

    def describe(self) -> str:
        return f"{self.kind}{self.values}"


@dataclass
class Sweep:
    """A checked sweep: everything a trial needs to build its run config, as plain data (sent to Ray workers)."""

    file: SweepFile
    path: Path  # the sweep file
    base_path: Path  # the base preset
    base_tree: dict  # the base preset's merged tree (inherit: resolved)
    fixed: dict  # dotted key -> value: the sweep file's overrides, then the command line's, then the sweep's own
    space: list[Dimension]

    @property
    def name(self) -> str:
        return self.file.name or self.path.stem

    def trial_config(self, sampled: dict[str, Any], extra: dict[str, Any] | None = None) -> RunConfig:
        """The validated run config of one trial: base + fixed overrides + sampled values (+ extra)."""
        return config_from_dict(self.base_tree, {**self.fixed, **plain_values(sampled), **(extra or {})})

    def signature(self) -> dict:
        """What must stay the same for an interrupted sweep to be resumed (compared on rerun)."""
        return {"base": str(self.base_path), "fixed": self.fixed, "space": {d.key: d.describe() for d in self.space},
                "num_samples": self.file.num_samples, "metric": self.file.metric, "mode": self.file.mode,
                "seed": self.file.seed}


def load_sweep(path: str | Path, cli_overrides: list[str] | tuple[str, ...] = (), num_samples: int | None = None,
               forced: dict[str, Any] | None = None) -> Sweep:
    """Read and check a sweep file; ConfigError (one line naming the key) on any mistake.

    forced: dotted values the sweep itself sets for every trial (absolute data path, tracking): checked too.
    """
    path = presets.find(path)
    tree = read_yaml(path)
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (name, base, space, ...), "
                          f"got {type(tree).__name__}")
    cli_overrides, tree = _apply_sweep_keys(list(cli_overrides), dict(tree))
    overrides = _mapping(tree.pop("overrides", None), "overrides", path)
    space_tree = _mapping(tree.pop("space", None), "space", path)
    try:
        file = build(SweepFile, tree, choices=CHOICES)
    except ConfigError as exc:
        if "unknown key" in str(exc):
            # The valid list printed by build lacks the two mappings popped above: name them too.
            raise ConfigError(f"{path}: {exc}, overrides, space") from None
        raise ConfigError(f"{path}: {exc}") from None
    if num_samples is not None:
        file.num_samples = num_samples
    _check_settings(file, path)
    if not file.base:
        raise ConfigError(f"{path}: 'base' is missing: name the run config the trials start from, e.g. "
                          "base: tiny/lamemo (a preset, or a file relative to the sweep file)")
    try:
        base_path = presets.find(file.base, relative_to=path.parent).resolve()
    except ConfigError as exc:
        raise ConfigError(f"{path}: 'base: {file.base}': {exc}") from None

    base_tree = load_tree(base_path, find_parent=presets.find)
    # Typed dotted values: apply_overrides names a bad key/type; flatten_dict gives them back dotted.
    fixed = flatten_dict(apply_overrides({}, overrides))
    cli = flatten_dict(apply_overrides({}, list(cli_overrides)))
    space = [_dimension(key, spec, path) for key, spec in space_tree.items()]
    if not space:
        raise ConfigError(f"{path}: 'space' is empty: give at least one dotted key to search, e.g. "
                          "space: {train.lr: {choice: [1.0e-4, 2.5e-4]}}")
    for source, values in (("overrides", fixed), ("the command line", cli), ("the sweep", forced or {})):
        both = sorted(set(values) & {d.key for d in space})
        if both:
            raise ConfigError(f"{path}: {', '.join(both)} is searched in 'space' and also fixed by {source}; "
                              "keep one")
    sweep = Sweep(file, path.resolve(), base_path, base_tree, {**fixed, **cli, **(forced or {})}, space)
    _check_trials(sweep)
    return sweep


def _apply_sweep_keys(cli_overrides: list[str], tree: dict) -> tuple[list[str], dict]:
    """Split the command line's dotted overrides: those naming a sweep-file key (resources.gpus=0,
    max_concurrent=1, ...) are set in the sweep file's tree, the rest (run-config keys) are returned for the
    trials. The two sets of keys never overlap: a run config's sections are model, data, train, ..."""
    from dataclasses import fields

    sweep_keys = {f.name for f in fields(SweepFile)}
    rest = []
    for text in cli_overrides:
        key, sep, value = str(text).partition("=")
        key = key.strip()
        if not sep or key.split(".")[0] not in sweep_keys:
            rest.append(text)
            continue
        try:
            tp = key_type(SweepFile, key)
        except ConfigError as exc:
            raise ConfigError(f"override '{text}': {exc}") from None
        set_dotted(tree, key, value if tp is str else parse_yaml_value(value, f"override '{text}'"))
    return rest, tree


def _mapping(value: Any, what: str, path: Path) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: '{what}' must be a mapping of dotted run-config keys, got {value!r}")
    return value


def _check_settings(file: SweepFile, path: Path) -> None:
    try:
        file.scheduler.validate()
        file.resources.validate()
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if file.num_samples < 1:
        raise ConfigError(f"{path}: num_samples must be >= 1, got {file.num_samples}")
    if file.max_failures < 0 or file.max_concurrent < 0:
        raise ConfigError(f"{path}: max_failures and max_concurrent must be >= 0 (max_concurrent 0 = no limit)")


def _dimension(key: Any, spec: Any, path: Path) -> Dimension:
    key = str(key)
    where = f"{path}: space.{key}"
    try:
        tp = key_type(RunConfig, key)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ConfigError(f"{where} must be one of {{{' | '.join(f'{k}: [...]' for k in KINDS)}}}, got {spec!r}")
    (kind, values), = spec.items()
    if kind not in KINDS:
        close = difflib.get_close_matches(str(kind), KINDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{where}: unknown kind '{kind}'{hint}; use one of {', '.join(KINDS)}")
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}.{kind} must be a non-empty list, got {values!r}")
    if kind in RANGED:
        # uniform/loguniform draw floats (float keys only); randint draws ints (int keys, or float keys)
        allowed = (int, float) if kind == "randint" else (float,)
        if tp not in allowed:
            raise ConfigError(f"{where}.{kind}: {key} is not a {' or '.join(t.__name__ for t in allowed)} key; "
                              "use choice or grid for it")
        if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) \
                or not values[0] < values[1]:
            raise ConfigError(f"{where}.{kind} must be [low, high] with low < high, got {values!r}")
        if kind == "loguniform" and values[0] <= 0:
            raise ConfigError(f"{where}.loguniform needs low > 0, got {values!r}")
        if kind == "randint" and not all(isinstance(v, int) for v in values):
            raise ConfigError(f"{where}.randint needs integers [low, high) , got {values!r}")
    return Dimension(key, kind, values)


def _check_trials(sweep: Sweep) -> None:
    """Build and validate the run config at every listed value and range end of each dimension (the others at
    their first value), plus the all-first and all-last corners: wrong types, impossible values (warmup longer
    than the run, ...) and a metric the runs never report are found here rather than in trial 7 an hour in."""
    first = {d.key: d.candidates()[0] for d in sweep.space}
    last = {d.key: d.candidates()[-1] for d in sweep.space}
    probes = [first, last] + [{**first, d.key: v} for d in sweep.space for v in d.candidates()]
    for sampled in probes:
        try:
            cfg = sweep.trial_config(sampled)
        except ConfigError as exc:
            shown = ", ".join(f"{k}={v!r}" for k, v in sampled.items())
            raise ConfigError(f"{sweep.path}: the trial with {shown} is not a valid run config: {exc}") from None
        metric = sweep.file.metric
        if metric.startswith("valid_") and not 0 < cfg.train.eval_every <= cfg.train.steps:
            raise ConfigError(f"{sweep.path}: metric {metric} needs validation during training: set "
                              f"train.eval_every between 1 and train.steps ({cfg.train.steps}), got "
                              f"{cfg.train.eval_every}")


def plain_values(sampled: dict[str, Any]) -> dict[str, Any]:
    """Tune may hand numpy scalars (randint, uniform); the run config takes Python ints and floats only."""
    out = {}
    for key, value in sampled.items():
        if hasattr(value, "item") and not isinstance(value, (list, dict, str)):
            value = value.item()
        out[key] = value
    return out
