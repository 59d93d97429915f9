"""`memlm analyze`: the views the papers use to show why memory helps, for a trained run (docs/design.md §8).

    result = analyze_run("runs/demo/runs/lamemo", split="test", segments=64)   # JSON + plots in RUN_DIR/analysis

Over the first S segments of the split (one lane, per-document memory as in evaluation):
* Transformer-XL and LaMemo (LaMemo paper, Figure 1): for each target token and each context interval (the memory
  and the current segment cut into intervals of N/4 key positions), the largest attention weight any key of the
  interval gets, averaged over heads, tokens and segments, per layer; and the same maximum over the whole memory
  against the whole current segment, plus the attention mass each receives. A context interval that a token cannot
  see (an empty memory slot at a document start, a future key) does not count for that token.
* LaMemo (Figure 6): the memorising coefficient alpha (the share of a memory position's attention that stays on its
  past keys when it looks ahead, eq. 10-11) per layer against memory index (0 = oldest slot), averaged over heads and
  segments over valid slots.
* RMT (Figure 6): the attention map of the [read | tokens | write] rows over [cache | read | tokens | write] keys,
  averaged over heads and segments, per layer; the read and write rows are also written out on their own.
The models hand their attention weights and alpha to `model.recorder` only while this runs (models/backbone.py);
otherwise nothing is recorded and nothing is paid. The JSON and PNG files go to RUN_DIR/analysis/ and, when the
run is tracked, to its MLflow run under the artifact folder `analysis/`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from memlm.data_pipeline.stream import LaneStream
from memlm.models.attention import causal_allowed
from memlm.models.config import ConfigError
from memlm.models.registry import ARCHITECTURES, arch_spec
from memlm.models.rmt import rmt_allowed
from memlm.models.txl import reset_valid
from memlm.trainer.checkpoint.pretrained import is_export
from memlm.trainer.checkpoint.run_loader import load_run, open_run
from memlm.trainer.runtime import heartbeat
from memlm.trainer.runtime.process import prepare_process
from memlm.trainer.tracking.client import open_client
from memlm.trainer.tracking.tracker import RUN_ID_FILE, URI_FILE, error_reason

from .analyze_plots import write_plots
from .evaluate import write_json

log = logging.getLogger(__name__)


class Recorder:
    """Receives (kind, layer, tensor) from the models during one forward; `take` hands them over and clears."""

    def __init__(self):
        self.items: dict[tuple[str, int], torch.Tensor] = {}

    def add(self, kind: str, layer: int, tensor: torch.Tensor) -> None:
        self.items[(kind, layer)] = tensor.detach().float().cpu()

    def take(self) -> dict[tuple[str, int], torch.Tensor]:
        items, self.items = self.items, {}
        return items


def interval_edges(mem_len: int, seg_len: int) -> list[tuple[str, int, int]]:
    """(label, first key, end key) of each context interval: the memory (keys 0..M-1, oldest first) and the current
    segment (keys M..M+N-1), each cut into pieces of N/4 positions (at least 1)."""
    width = max(1, seg_len // 4)
    edges = []
    for name, base, length in (("mem", 0, mem_len), ("cur", mem_len, seg_len)):
        for lo in range(0, length, width):
            hi = min(lo + width, length)
            edges.append((f"{name} {lo}-{hi - 1}", base + lo, base + hi))
    return edges


class CausalStats:
    """LaMemo Figure 1 for the current tokens' attention over [memory | current segment] keys."""

    def __init__(self, n_layer: int, mem_len: int, seg_len: int):
        self.M, self.N = mem_len, seg_len
        self.edges = interval_edges(mem_len, seg_len)
        shape = (n_layer, len(self.edges))
        self.max_sum, self.max_count = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
        self.split_sum = torch.zeros(n_layer, 2, 2, dtype=torch.float64)  # [L, memory|current, max|mass]
        self.split_count = torch.zeros(n_layer, 2, dtype=torch.float64)

    def add(self, layer: int, probs: torch.Tensor, allowed: torch.Tensor, scored: torch.Tensor) -> None:
        """probs [1, H, N, K], allowed [N, K] bool, scored [N] bool (targets that are not padding)."""
        p = probs[0].double()  # [H, N, K]
        for j, (_, lo, hi) in enumerate(self.edges):
            seen = allowed[:, lo:hi].any(dim=1) & scored  # [N]: tokens that can see this interval
            peak = p[:, :, lo:hi].amax(dim=2).mean(dim=0)  # [N]: max over keys, mean over heads
            self.max_sum[layer, j] += peak[seen].sum()
            self.max_count[layer, j] += seen.sum()
        for side, keys in enumerate((slice(0, self.M), slice(self.M, self.M + self.N))):
            if keys.stop == keys.start:
                continue
            seen = allowed[:, keys].any(dim=1) & scored
            block = p[:, :, keys]
            self.split_sum[layer, side, 0] += block.amax(dim=2).mean(dim=0)[seen].sum()
            self.split_sum[layer, side, 1] += block.sum(dim=2).mean(dim=0)[seen].sum()
            self.split_count[layer, side] += seen.sum()

    def result(self) -> dict[str, Any]:
        mean = (self.max_sum / self.max_count.clamp(min=1)).tolist()
        split = self.split_sum / self.split_count.clamp(min=1)[..., None]
        return {
            "intervals": [{"label": label, "keys": [lo, hi]} for label, lo, hi in self.edges],
            "max_weight": _masked(mean, self.max_count),  # [L][intervals]; None where no token saw the interval
            "tokens_counted": self.max_count.tolist(),
            "memory_max_weight": _masked(split[:, 0, 0].tolist(), self.split_count[:, 0]),
            "current_max_weight": _masked(split[:, 1, 0].tolist(), self.split_count[:, 1]),
            "memory_mass": _masked(split[:, 0, 1].tolist(), self.split_count[:, 0]),
            "current_mass": _masked(split[:, 1, 1].tolist(), self.split_count[:, 1]),
        }


class AlphaStats:
    """LaMemo Figure 6: alpha [1, M, H] per layer, averaged over heads and segments at valid memory slots."""

    def __init__(self, n_layer: int, mem_len: int):
        self.sum = torch.zeros(n_layer, mem_len, dtype=torch.float64)
        self.count = torch.zeros(n_layer, mem_len, dtype=torch.float64)

    def add(self, layer: int, alpha: torch.Tensor, valid: torch.Tensor) -> None:
        self.sum[layer] += torch.where(valid[0], alpha[0].double().mean(dim=-1), 0.0)
        self.count[layer] += valid[0]

    def result(self) -> dict[str, Any]:
        mean = (self.sum / self.count.clamp(min=1)).tolist()
        return {"alpha": _masked(mean, self.count), "slots_counted": self.count.tolist(),
                "memory_index": "0 = oldest memory slot, M-1 = the position just before the segment"}


class MapStats:
    """RMT Figure 6: the mean attention map [Q, K] per layer (heads and segments averaged)."""

    def __init__(self, n_layer: int, n_query: int, n_key: int):
        self.sum = torch.zeros(n_layer, n_query, n_key, dtype=torch.float64)
        self.segments = 0

    def add(self, layer: int, probs: torch.Tensor) -> None:
        self.sum[layer] += probs[0].double().mean(dim=0)

    def mean(self) -> torch.Tensor:
        return self.sum / max(self.segments, 1)


def _masked(values, counts) -> Any:
    """Nested lists with None where nothing was counted (JSON has no NaN)."""
    counts = torch.as_tensor(counts)
    if counts.dim() == 0:
        return values if counts > 0 else None
    return [_masked(v, c) for v, c in zip(values, counts)]


# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def collect(model: torch.nn.Module, batches, segments: int) -> dict[str, Any]:
    """Run the model over up to `segments` single-lane batches with the recorder attached; the statistics."""
    cfg = model.cfg
    L, N, M = cfg.n_layer, cfg.tgt_len, cfg.mem_len
    arch = cfg.arch
    # The registry's has_memory, not its cache rule: ARMT has no Transformer-XL cache and carries a memory
    has_memory = arch_spec(arch).has_memory
    if not has_memory:
        log.info(f"arch {arch!r} has no memory: only the current segment's attention is analysed")
    recorder = Recorder()
    # Statistics for what the model records (models/backbone.py record_to): "causal" attention weights, LaMemo's
    # "alpha", RMT's "rmt" maps; each is started by the first segment that reports it.
    causal = alpha = maps = None
    R = cfg.num_mem_tokens
    memory = model.init_memory(batch_size=1)
    done = 0
    model.recorder = recorder
    try:
        for batch in batches:
            if done >= segments:
                break
            reset = batch.reset
            scored = batch.targets[0] != -100
            valid = reset_valid(memory.key_valid, reset)  # [1, P]: every cached key (compressed slots too)
            out = model(batch.tokens, memory, reset=reset)
            memory = out.memory
            items = recorder.take()
            if causal is None and ("causal", 0) in items:
                causal = CausalStats(L, valid.shape[1], N)  # "memory": every cached key before the segment
            if alpha is None and ("alpha", 0) in items:
                alpha = AlphaStats(L, M)
            if maps is None and ("rmt", 0) in items:
                maps = MapStats(L, 2 * R + N, M + 2 * R + N)
            for l in range(L):
                if causal is not None:
                    allowed = causal_allowed(N, valid.shape[1], valid, cfg.same_length)[0]
                    causal.add(l, items[("causal", l)], allowed, scored)
                if alpha is not None:
                    alpha.add(l, items[("alpha", l)], valid)
                if maps is not None:
                    maps.add(l, items[("rmt", l)])
            if maps is not None:
                maps.segments += 1
            done += 1
    finally:
        model.recorder = None
    result: dict[str, Any] = {"arch": arch, "has_memory": has_memory, "segments": done, "tgt_len": N, "mem_len": M,
                              "n_layer": L}
    if causal is not None:
        result["attention_intervals"] = causal.result()
    if alpha is not None:
        result["lamemo_alpha"] = alpha.result()
    if maps is not None:
        mean = maps.mean()
        blocks = {"cache": [0, M], "read": [M, M + R], "tokens": [M + R, M + R + N],
                  "write": [M + R + N, M + 2 * R + N]}
        result["rmt_attention"] = {
            "num_mem_tokens": R, "key_blocks": blocks,
            "query_blocks": {"read": [0, R], "tokens": [R, R + N], "write": [R + N, 2 * R + N]},
            # 6 decimals: the maps are L x (2R + N) x (M + 2R + N) numbers (~1M at the WikiText-103 shape)
            "read_rows": mean[:, :R].round(decimals=6).tolist(),
            "write_rows": mean[:, R + N :].round(decimals=6).tolist(),
            "mean_map": mean.round(decimals=6).tolist(),
            "allowed": rmt_allowed(R, N, torch.ones(1, M, dtype=torch.bool), cfg.same_length,
                                   cfg.read_mem_from_cache, cfg.write_mem_from_cache)[0].tolist(),
        }
    return result


def check_layers_recorded(arch: str) -> None:
    """The statistics are recorded inside memlm's own layers (models/backbone.py); a pretrained backbone's layers
    are a transformers model's, which records nothing: refused in one line rather than an analysis without them."""
    if not arch_spec(arch).memlm_layers:
        recorded = ", ".join(name for name, spec in ARCHITECTURES.items() if spec.memlm_layers)
        raise ConfigError(f"analyze records attention inside memlm's own layers ({recorded}); arch {arch!r} runs a "
                          "transformers backbone's layers, which record none: evaluate it with memlm eval or memlm "
                          "longeval")


def analyze_run(run_dir: str | os.PathLike, split: str = "test", segments: int = 64, tag: str | None = None,
                out_dir: str | os.PathLike | None = None, track: bool = True) -> dict[str, Any]:
    """Analyse RUN_DIR's checkpoint on `split`; write analysis JSON + plots; log them to the run's MLflow run.
    RUN_DIR may be an export folder when out_dir names where the files go: an export is not written into."""
    if segments < 1:
        raise ConfigError(f"--segments must be >= 1, got {segments}")
    run_dir = Path(run_dir)
    if out_dir is None and is_export(run_dir):
        raise ConfigError(f"{run_dir} is an export folder, which analyze does not write into: analyze its run "
                          "folder, or call analyze_run(DIR, out_dir=FOLDER) from Python")
    check_layers_recorded(open_run(run_dir, tag=tag).config.model.arch)  # before the weights are read
    heartbeat.phase(f"loading the weights of {run_dir}")  # each slow step named: a line within 10 s (start_watch.py)
    model, _, run = load_run(run_dir, tag=tag)
    cfg = run.config
    data_dir, _ = run.data(split=split)
    stream = LaneStream(data_dir, split, lanes=1, seg_len=model.cfg.tgt_len, mode="eval",
                        continuous=cfg.data.continuous)
    heartbeat.phase(f"running {segments} {split} segment(s) with their attention recorded")
    result = collect(model, stream, segments)
    result.update(split=split, step=run.step)
    out = Path(out_dir) if out_dir else run_dir / "analysis"
    files = [write_json(result, out / f"analysis-{split}.json")]
    title = f"{run_dir.name} ({result['arch']}, {split}, {result['segments']} segments)"
    heartbeat.phase(f"drawing the plots into {out}")
    files += write_plots(result, out, title=title)
    result["files"] = [str(f) for f in files]
    if track:
        heartbeat.phase("logging the analysis to the run's MLflow run")
        result["mlflow"] = log_to_mlflow(cfg, run_dir, files)
    heartbeat.phase(None)
    return result


def log_to_mlflow(config, run_dir: Path, files: list[Path]) -> bool:
    """Add the files to the training run's MLflow run under `analysis/` (False when the run is not tracked or
    MLflow fails: the files in the run folder stand, as for `memlm eval`)."""
    id_file = run_dir / RUN_ID_FILE
    if not config.tracking.enabled or not id_file.is_file():
        return False
    uri_file = run_dir / URI_FILE
    uri = uri_file.read_text().strip() if uri_file.is_file() else config.tracking.resolved_uri()
    run_id = id_file.read_text().strip()
    try:
        client = open_client(uri, create=False)
        client.get_run(run_id)
        for path in files:
            client.log_artifact(run_id, str(path), "analysis")
    except Exception as exc:  # noqa: BLE001 - the analysis is written; tracking must not undo it
        log.warning("MLflow logging of the analysis of %s failed (%s); the files are in %s", run_dir,
                    error_reason(exc), files[0].parent)
        return False
    return True


def main(args) -> int:
    prepare_process(who="analyze")  # threads that fit the cores
    result = analyze_run(args.run_dir, split=args.split, segments=args.segments)
    print(f"{args.run_dir}: {result['arch']}, {result['segments']} {args.split} segments")
    summary = result.get("attention_intervals")
    if summary:
        rows = zip(summary["memory_mass"], summary["memory_max_weight"], summary["current_max_weight"])
        for l, (mass, mem, cur) in enumerate(rows):
            mass_text = "n/a" if mass is None else f"{100 * mass:.0f}%"
            mem_text = "n/a" if mem is None else f"{mem:.3f}"
            cur_text = "n/a" if cur is None else f"{cur:.3f}"
            print(f"  layer {l}: attention on the memory {mass_text}; mean max attention weight  memory {mem_text}  "
                  f"current segment {cur_text}")
    alphas = result.get("lamemo_alpha", {}).get("alpha")
    if alphas:
        for l, row in enumerate(alphas):
            seen = [a for a in row if a is not None]
            if seen:
                print(f"  layer {l}: alpha mean {sum(seen) / len(seen):.3f} (oldest slot {seen[0]:.3f}, "
                      f"newest {seen[-1]:.3f})")
    for path in result["files"]:
        print(f"  wrote {path}")
    if result.get("mlflow"):
        print("  logged to the run's MLflow run under analysis/")
    return 0
