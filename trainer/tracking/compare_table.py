"""The comparison table: one row per training run, columns after the LaMemo paper's Table 1 (#Params, Mem size,
#FLOPS, dev ppl, test ppl) plus the throughput and length of each run, and, when some run has one, its test
perplexities at other lengths than trained (`memlm eval --mem-mult 4` logs test_ppl_tgt8_mem32: a different
measurement, never the run's test ppl). Pure functions of RunRecords: no MLflow.

    rows = [build_row(record) for record in records]
    to_markdown(rows), to_csv(rows)

Parameters and FLOPs are analytic (models/flops.py) from the run's model config, which is rebuilt from its logged
`model.*` params through the config machinery, so each value gets its declared type back ("[20, 40]" a list,
"False" a bool). FLOPs are forward FLOPs per predicted token at the trained lengths (2 per multiply-add; the paper's
"#FLOPS" counts multiply-adds, so it reads about half of ours). The CSV holds exact numbers (floats as Python
writes them, which read back bit for bit); the Markdown rounds them for reading, as the paper does.
"""

from __future__ import annotations

import csv
import io
import math
import re
import statistics
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from memlm.models.config import ARCHS, ConfigError, ModelConfig
from memlm.models.flops import flops_per_token, param_count
from memlm.models.registry import arch_spec
from memlm.trainer.config.run_config import CHOICES, apply_overrides
from memlm.trainer.config.schema import build

from .compare_runs import RunRecord
from .tracker import tokenizer_kind


@dataclass
class Row:
    run: str
    run_id: str
    arch: str
    status: str
    params: Optional[int]  # analytic parameter count (tied weights once)
    mem_len: Optional[int]  # Transformer-XL cache length M
    mem_tokens: Optional[int]  # RMT memory tokens R (0 for the other archs)
    flops_per_token: Optional[float]  # forward FLOPs per predicted token
    dev_ppl: Optional[float]  # the latest valid_ppl (training's validation or `memlm eval --split valid`)
    test_ppl: Optional[float]  # test_ppl from `memlm eval --split test`, at the lengths the run was trained with
    # `memlm eval --split test` at other settings than trained (--mem-mult, --mem-len, --tgt-len, ...), each logged
    # under its own metric (test_ppl_tgt8_mem32: trainer.tracking.tracker._eval_suffix): [("tgt8_mem32", ppl)], ordered
    # by
    # target and memory length
    test_ppl_other: list[tuple[str, float]]
    dev_bpc: Optional[float]  # bits per character: byte-level data only (blank for words or subword pieces)
    test_bpc: Optional[float]
    tokens_per_s: Optional[float]  # median over the logged steps: robust to the slow first steps and to stalls
    steps: Optional[int]  # last logged training step
    tokens: Optional[int]  # training tokens seen at the last logged step
    note: str = ""  # why a column is blank, when it is


CSV_COLUMNS = [f.name for f in fields(Row)]
OTHER_HEADER = "test ppl, other lengths"  # shown, as every column, only when some run has a value
OTHER_TEST_PPL = re.compile(r"^test_ppl_((?:tgt\d+_mem\d+)?(?:_?clamp\d+)?(?:_?(?:not)?same)?)$")
# (header, Row attribute, formatter) for the Markdown table
MARKDOWN_COLUMNS = [
    ("run", "run", str),
    ("arch", "arch", str),
    ("params", "params", lambda v: si(v)),
    ("mem", "mem_len", None),  # formatted with mem_tokens below
    ("FLOPs/token", "flops_per_token", lambda v: si(v)),
    ("dev ppl", "dev_ppl", lambda v: f"{v:.2f}"),
    ("test ppl", "test_ppl", lambda v: f"{v:.2f}"),
    (OTHER_HEADER, "test_ppl_other", lambda v: "; ".join(f"{ppl:.2f} ({setting_label(k)})" for k, ppl in v)),
    ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
    ("steps", "steps", lambda v: f"{v:,}"),
]


def model_config_from_params(params: dict[str, str]) -> ModelConfig:
    """The run's ModelConfig from its logged `model.*` params (strings), typed and validated; ConfigError when a
    param cannot be read back (a run logged by another memlm version with keys this one does not know)."""
    pairs = [f"{key}={value}" for key, value in params.items() if key.startswith("model.")]
    tree = apply_overrides({}, pairs)
    return build(ModelConfig, tree.get("model", {}), prefix="model", choices=CHOICES).validate()


def build_row(record: RunRecord) -> Row:
    m = record.metrics
    loss = record.histories.get("loss", [])
    speeds = [value for _, value in record.histories.get("tokens_per_s", [])]
    row = Row(run=record.name, run_id=record.run_id, arch=record.params.get("model.arch", ""),
              status=record.status, params=None, mem_len=None, mem_tokens=None, flops_per_token=None,
              dev_ppl=m.get("valid_ppl"), test_ppl=m.get("test_ppl"), test_ppl_other=other_test_ppl(m),
              dev_bpc=m.get("valid_bpc") if byte_level(record) else None,
              test_bpc=m.get("test_bpc") if byte_level(record) else None,
              tokens_per_s=statistics.median(speeds) if speeds else None,
              steps=loss[-1][0] if loss else None,
              tokens=int(m["tokens"]) if m.get("tokens") is not None else None)
    try:
        cfg = model_config_from_params(record.params)
    except ConfigError as exc:
        row.note = f"model config not readable: {exc}"
        return row
    row.params, row.mem_len = param_count(cfg), cfg.mem_len
    counted_by = arch_spec(cfg.arch).memory_tokens  # the config key counting memory tokens, if the arch has them
    row.mem_tokens = getattr(cfg, counted_by) if counted_by else 0
    row.flops_per_token = flops_per_token(cfg)["total"]
    return row


def other_test_ppl(metrics: dict[str, float]) -> list[tuple[str, float]]:
    """[(setting, ppl)] of the run's test evaluations at other lengths than trained, by target then memory length."""
    found = [(match.group(1), value) for key, value in metrics.items()
             if (match := OTHER_TEST_PPL.match(key)) and match.group(1)]
    return sorted(found, key=lambda item: [int(n) for n in re.findall(r"\d+", item[0])] + [item[0]])


def setting_label(setting: str) -> str:
    """"tgt8_mem32" -> "N=8 M=32", "tgt8_mem32_clamp100_same" -> "N=8 M=32 clamp 100 same length"."""
    words = []
    for part in setting.split("_"):
        if match := re.fullmatch(r"tgt(\d+)", part):
            words.append(f"N={match.group(1)}")
        elif match := re.fullmatch(r"mem(\d+)", part):
            words.append(f"M={match.group(1)}")
        elif match := re.fullmatch(r"clamp(\d+)", part):
            words.append(f"clamp {match.group(1)}")
        elif part in ("same", "notsame"):
            words.append("same length" if part == "same" else "not same length")
        elif part:
            words.append(part)
    return " ".join(words)


def byte_level(record: RunRecord) -> bool:
    """Whether a token of the run is one byte, so that bits per token are bits per character. From the run's
    `tokenizer` tag (the Tracker sets it), else from the manifest at its logged data.path where that is readable."""
    kind = record.tags.get("tokenizer")
    if not kind or kind == "unknown":
        kind = tokenizer_kind(record.params.get("data.path", ""))
    return kind == "bytes"


def sort_rows(rows: list[Row]) -> list[Row]:
    """The paper's order (baseline, Transformer-XL, LaMemo, then RMT), then by run name: the same order whichever
    store or server the runs were read from."""
    order = {arch: i for i, arch in enumerate(ARCHS)}
    return sorted(rows, key=lambda r: (order.get(r.arch, len(order)), r.run, r.run_id))


# ---------------------------------------------------------------------------------------------------------------
# Rendering


def to_csv(rows: list[Row]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_value(v) for k, v in asdict(row).items()})
    return out.getvalue()


def to_markdown(rows: list[Row], title: str = "", footnotes: list[str] = ()) -> str:
    # A column no run has a value for is left out (issue 32: the demo's runs, which never validate, showed an empty
    # "dev ppl" column); the CSV keeps every column.
    columns = [c for c in MARKDOWN_COLUMNS if not rows or any(_markdown_cell(row, c[1], c[2]) for row in rows)]
    header = [name for name, _, _ in columns]
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        cells = [_markdown_cell(row, attr, fmt) for _, attr, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    notes = list(footnotes) + [f"{row.run}: {row.note}" for row in rows if row.note]
    if notes:
        lines.append("")
        lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def _markdown_cell(row: Row, attr: str, fmt: Any) -> str:
    if attr == "mem_len":
        if row.mem_len is None:
            return ""
        return f"{row.mem_len} + {row.mem_tokens} tokens" if row.mem_tokens else str(row.mem_len)
    value = getattr(row, attr)
    if value is None or value == [] or (isinstance(value, float) and math.isnan(value)):
        return ""
    return fmt(value).replace("|", "\\|")  # a run name with a pipe must not split the cell


def si(value: float) -> str:
    """151234567 -> "151M", 68384 -> "68.4K", 812 -> "812": three significant digits, as papers print sizes."""
    value = float(f"{value:.3g}")  # rounded first, so 999,950 reads "1M" rather than "1000K"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            scaled = value / scale
            break
    else:
        scaled, suffix = value, ""
    digits = 0 if abs(scaled) >= 100 else 1 if abs(scaled) >= 10 else 2
    text = f"{scaled:.{digits}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text + suffix


def _csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)  # shortest text that reads back to the same double
    if isinstance(value, list):  # test_ppl_other: "tgt8_mem32=33393.93...;tgt8_mem64=..."
        return ";".join(f"{key}={_csv_value(v)}" for key, v in value)
    return str(value)
