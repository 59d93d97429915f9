"""The README.md of an export folder: what the model is, what it was trained on, how long, how well it scores.

Scores are the run's own `memlm eval` results (RUN_DIR/eval/{split}-step{N}-tgt{T}-mem{M}.json) at the exported
step; the validation passes during training (eval/step{N}.json) read only train.eval_batches batches and are not
quoted. A run never evaluated on its test split says so rather than showing another number in its place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from memlm.data_pipeline.remote.location import redact
from memlm.models.pretrained.shape import backbone_shape

# `memlm eval`'s file names (trainer/inference/evaluate.py); training's own passes are step{N}.json.
_EVAL_NAME = re.compile(r"^(valid|test)-step(\d+)-tgt(\d+)-mem(\d+)\.json$")
_KEPT = ("split", "ppl", "nll", "bpc", "tokens", "documents", "tgt_len", "mem_len", "accuracy")


def eval_results(run_dir: Path, step: int | None) -> list[dict[str, Any]]:
    """The run's full evaluations of checkpoint `step`, test first, each with the fields a card quotes."""
    found = []
    for path in sorted((Path(run_dir) / "eval").glob("*.json")):
        match = _EVAL_NAME.match(path.name)
        if not match or int(match.group(2)) != step:
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a damaged result is not quoted; the card says what it has
        found.append({key: result[key] for key in _KEPT if key in result} | {"file": f"eval/{path.name}"})
    return sorted(found, key=lambda r: (r.get("split") != "test", r.get("tgt_len", 0), r.get("mem_len", 0)))


def model_card(cfg, marker: dict, manifest: dict, weights_bytes: int) -> str:
    """Markdown: model, data, training, evaluation, files and how to use them."""
    m, tok = cfg.model, marker["tokenizer"]
    corpus = manifest.get("corpus") or {}
    splits = manifest.get("splits") or {}
    tokens = ", ".join(f"{name} {entry.get('tokens', 0):,}" for name, entry in splits.items())
    lines = [
        f"# {m.arch} memory language model (memlm)",
        "",
        "## Model",
        _architecture_line(m, marker),
        f"- segment (target) length {m.tgt_len}, memory length {m.mem_len}"
        + (f", {m.num_mem_tokens} memory tokens" if m.num_mem_tokens else ""),
        f"- parameters: {marker['parameters']:,} ({marker['dtype']} weights, {weights_bytes:,} bytes)",
        f"- vocabulary: {marker['vocab_size']} ids, {tok.get('kind')} tokenizer (files in `tokenizer/`)",
        "",
        "## Data",
        f"- corpus: {corpus.get('kind', 'unknown')} ({corpus.get('input', 'unknown input')}), prepared at "
        f"`{redact(cfg.data.path)}`",
        f"- tokens per split: {tokens or 'unknown'}",
        "",
        "## Training",
        f"- steps: {marker['step']} of train.steps {cfg.train.steps} (checkpoint `{marker['checkpoint']}`)",
        f"- batch {cfg.data.batch_size} x grad_accum {cfg.train.grad_accum}, lr {cfg.train.lr} "
        f"({cfg.train.schedule}), precision {cfg.deepspeed.precision}, ZeRO stage {cfg.deepspeed.zero_stage}",
        f"- run folder: `{marker['source_run']}`",
        "",
        "## Evaluation",
        *_evaluation_lines(marker.get("evaluations") or []),
        "",
        "## Use",
        "```",
        "memlm generate THIS_DIR --prompt 'The '",
        "memlm eval THIS_DIR --split test [--data DATA_DIR]   # data: config.yaml's data.path unless --data",
        "python -c 'from memlm import load_pretrained; model, tokenizer = load_pretrained(\"THIS_DIR\")'",
        "```",
        "Files: `model.safetensors` (weights), `config.yaml` (the run's config), `tokenizer/`, `memlm-export.json` "
        "(format, arch, step, tokenizer identity)"
        + (", `backbone/config.json` (the backbone's transformers config)" if marker.get("backbone") else "")
        + ". None is a pickle.",
        "",
    ]
    return "\n".join(lines)


def _architecture_line(m, marker: dict) -> str:
    """memlm's own layers' widths, or a pretrained backbone's (read from its config, models/pretrained/shape.py)."""
    if not marker.get("backbone"):
        return (f"- architecture: `{m.arch}`, {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads x {m.d_head}, "
                f"d_inner {m.d_inner}")
    shape, source = backbone_shape(m), marker["backbone"]
    source = "its config given inline" if source.startswith("inline") else f"from {source}"
    return (f"- architecture: `{m.arch}` on a {shape.model_type} backbone ({source}; model.backbone_train "
            f"{m.backbone_train}): {shape.n_layer} layers, width {shape.d_model}, {shape.n_head} heads, inner width "
            f"{shape.d_inner}")


def _evaluation_lines(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    if not any(r.get("split") == "test" for r in results):
        lines.append("- test perplexity: not evaluated (run `memlm eval RUN_DIR --split test` before exporting)")
    if results:
        lines += ["", "| split | tgt_len | mem_len | tokens | ppl | nll | bpc |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r.get('split')} | {r.get('tgt_len')} | {r.get('mem_len')} | {r.get('tokens', 0):,} | "
                  f"{r.get('ppl', float('nan')):.3f} | {r.get('nll', float('nan')):.4f} | "
                  f"{r.get('bpc', float('nan')):.4f} |" for r in results]
    return lines
