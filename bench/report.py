"""Render every benchmark and reproduction JSON in bench/results/ into bench/REPORT.md.

    .venv/bin/python bench/report.py            # -> bench/REPORT.md
    .venv/bin/python bench/report.py --check    # exit 1 when REPORT.md is not what the JSONs render to

The reproduction experiments (bench/reproduce/*.py) get their tables and figures; every other JSON gets one entry
with its command or benchmark name, machine, load average and its top-level figures, so nothing measured is left
out of the report. Numbers are rendered, never edited here: to change the report, re-run the experiment.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT
from memlm.bench.interrupt import stop_in_one_line

REPORT = ROOT / "bench" / "REPORT.md"
REPRODUCE_ORDER = ("reproduce_wt2", "reproduce_extrapolate", "reproduce_rmt_tasks", "reproduce_tasks",
                   "reproduce_longctx")


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def machine_line(data: dict) -> str:
    m = data.get("machine")
    if isinstance(m, dict):
        parts = [f"{k} {m[k]}" for k in ("cpu", "cores", "python", "torch", "date") if k in m]
        return "; ".join(parts)
    # The benchmark's own keys win; the date (and torch, where a script does not record it) come from the
    # provenance that memlm.bench.common.write_result adds.
    fields = {**{k: v for k, v in data.get("provenance", {}).items() if k in ("torch", "date")}, **data}
    bits = [f"{k} {fields[k]}" for k in ("cpu", "device", "device_name", "torch", "nproc", "cpu_count", "date")
            if isinstance(fields.get(k), (str, int, float))]
    return "; ".join(bits) or (str(m) if m else "not recorded")


def load_line(data: dict) -> str:
    def plain(v) -> bool:
        return isinstance(v, (float, int)) or (isinstance(v, list) and all(isinstance(x, (float, int)) for x in v))

    keys = [k for k in data if "load" in k]
    shown = [f"{k} {[round(x, 2) for x in data[k]] if isinstance(data[k], list) else data[k]}" for k in keys
             if plain(data[k])]
    if any(not plain(data[k]) for k in keys):
        shown.append(f"per block in the JSON ({', '.join(k for k in keys if not plain(data[k]))})")
    return ", ".join(shown) or "not recorded"


def render_wt2(data: dict) -> list[str]:
    lines = [f"**WikiText-2, word level, {data['steps']:,} equal steps per run** (profile `{data['profile']}`, "
             f"preset `{data['preset']}`, {data['jobs']} runs at a time, one thread each)", "",
             "| model | test ppl | valid ppl | seeds | params | MFLOPs/token | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for r in data["table"]:
        per_seed = ", ".join(f"{x:.1f}" for x in r["test_ppl_per_seed"])
        lines.append(f"| {r['label']} | {r['test_ppl']:.1f} ± {r['test_ppl_spread']:.1f} ({per_seed}) | "
                     f"{r['valid_ppl']:.1f} ± {r['valid_ppl_spread']:.1f} | {len(r['seeds'])} | {r['params']:,} | "
                     f"{r['flops_per_token'] / 1e6:.2f} | {r['tokens_per_s']:,.0f} |")
    lines += ["", "± is half the range over seeds. tokens/s is the median of each run's logged windows while the "
              "machine was shared (see the load average): read it as relative cost at best.", ""]
    return lines


def render_extrapolate(data: dict) -> list[str]:
    lines = [f"**Memory extrapolation** (N = {data['tgt_len']}, memory {data['tgt_len']} x m, split "
             f"{data['split']}; runs {', '.join(data['runs'])})", "",
             "| m | memory | Transformer-XL ppl | LaMemo ppl | LaMemo - TXL |", "|---|---|---|---|---|"]
    for r in data["table"]:
        gap = f"{r['lamemo_minus_txl']:+.2f}" if r.get("lamemo_minus_txl") is not None else "-"
        lines.append(f"| {r['m']} | {r['mem_len']} | {r['txl_ppl']:.2f} | {r['lamemo_ppl']:.2f} | {gap} |")
    return lines + [""]


def render_tasks(data: dict) -> list[str]:
    archs = []
    for r in data["runs"]:
        if r["label"] not in archs:
            archs.append(r["label"])
    lines = [f"**Copy and reverse** (segments of N = {data['segment_len']}, {data['steps']:,} steps per run; "
             "per-token answer accuracy on test)", "",
             "| task | segments | L | " + " | ".join(archs) + " |", "|---|---|---|" + "---|" * len(archs)]
    keys = sorted({(r["task"], r["segments"], r["task_length"]) for r in data["runs"]})
    for task, segments, length in keys:
        cells = []
        for label in archs:
            hit = [r for r in data["runs"] if (r["task"], r["segments"], r["label"]) == (task, segments, label)]
            cells.append(f"{hit[0]['accuracy']:.3f}" if hit else "-")
        lines.append(f"| {task} | {segments} | {length} | " + " | ".join(cells) + " |")
    return lines + [""]


def render_rmt_tasks(data: dict) -> list[str]:
    labels = {}
    for r in data["runs"]:
        labels.setdefault(r["arch"], r["label"])
    authors = {(a["task"], a["segments"], a["arch"]): a for a in data.get("authors", [])}
    lines = [f"**RMT Figure 4 in the paper's setting** (profile `{data['profile']}`: {data['steps']:,} optimizer "
             "steps of 32 samples per run, the same for every model; memory = segment length N; test per-character "
             "answer accuracy, teacher-forced; chance 0.1). In brackets, the authors' own runs of the cell "
             "(experiment_results/short_synthetic+MT.csv, 250k-1M steps): median, and how many ended below 0.25.", "",
             "| task | segments | N | " + " | ".join(labels.values()) + " |", "|---|---|---|" + "---|" * len(labels)]
    for task, segments, n in sorted({(r["task"], r["segments"], r["segment_len"]) for r in data["runs"]}):
        cells = []
        for arch in labels:
            hit = [r for r in data["runs"] if (r["task"], r["segments"], r["arch"]) == (task, segments, arch)]
            ref = authors.get((task, segments, arch))
            cell = f"{hit[0]['accuracy']:.3f}" if hit else "-"
            cells.append(cell + (f" ({ref['median']:.2f}; {ref['near_chance']}/{len(ref['runs'])})" if ref else ""))
        lines.append(f"| {task} | {segments} | {n} | " + " | ".join(cells) + " |")
    return lines + [""]


def render_longctx(data: dict) -> list[str]:
    if data.get("version", 1) >= 2:
        return render_longctx_segments(data)
    spec = data["spec"]
    lines = [f"**Long-context accuracy** (profile `{data['profile']}`: curriculum over {spec['segments']} segments "
             f"per sample, {spec['steps']:,} steps per stage, equal for every arch; exact-match answer accuracy on "
             f"fresh test samples, {spec['depths']} depth windows x {spec['samples']} samples per length; "
             "BABILong-style qa1 on WikiText-2 background, chance 1/8; passkey of 5 digits).", ""]
    for task, summary in data["results"].items():
        lengths = summary["lengths"]
        lines += [f"{task}, accuracy (%) by sample length in tokens:", "",
                  "| arch | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for run in summary["runs"].values():
            acc = {r["length"]: r["accuracy"] for r in run["results"]}
            lines.append(f"| {run['arch']} | " + " | ".join(f"{100 * acc[n]:.0f}" if n in acc else "-"
                                                          for n in lengths) + " |")
        lines.append("")
    for stem, path in data.get("figures", {}).items():
        figure = Path(path)
        lines += [f"![{stem}]({figure.relative_to('bench') if figure.parts[0] == 'bench' else figure})", ""]
    return lines


def render_longctx_segments(data: dict) -> list[str]:
    """bench/reproduce/longctx.py since issue 35: accuracy by segments from fact to question, with baselines."""
    from memlm.bench.reproduce.longctx import markdown

    spec = data["spec"]
    lines = [f"**What memory does on long-context tasks** (profile `{data['profile']}`, preset `{data['preset']}` "
             f"with {', '.join(spec['overrides']) or 'no overrides'}: `memlm curriculum` over {spec['segments']} "
             f"segments per sample, stage caps {spec['steps']} steps, a stage ending when learned (99% held-out exact "
             f"match), on a plateau ({spec['patience']} checks of {spec['check_every']} steps without a gain, from "
             f"step {spec['min_steps']}) or at its cap; exact-match accuracy by segments from fact to question, "
             "both counted, each sample bucketed by its measured distance; BABILong-style tasks, a smaller setting "
             "than the papers').", "", *markdown(data["results"], data["labels"]).splitlines(), ""]
    for stem, path in data.get("figures", {}).items():
        figure = Path(path)
        lines += [f"![{stem}]({figure.relative_to('bench') if figure.parts[0] == 'bench' else figure})", ""]
    return lines


RENDERERS = {"reproduce_wt2": render_wt2, "reproduce_extrapolate": render_extrapolate,
             "reproduce_rmt_tasks": render_rmt_tasks, "reproduce_tasks": render_tasks,
             "reproduce_longctx": render_longctx}


def generic(data: dict) -> list[str]:
    scalars = {k: v for k, v in data.items() if isinstance(v, (int, float, str)) and k not in ("machine",)}
    lines = [f"- {k}: {fmt(v)}" for k, v in list(scalars.items())[:12]]
    nested = [k for k, v in data.items() if isinstance(v, (dict, list)) and k != "machine"]
    if nested:
        lines.append(f"- further figures in: {', '.join(nested)}")
    return lines + [""]


def render() -> str:
    files = sorted(RESULTS.glob("*.json"))
    reproduce = [p for prefix in REPRODUCE_ORDER for p in files if p.stem.startswith(prefix + "_")]
    others = [p for p in files if p not in reproduce]
    out = ["# memlm benchmark and reproduction report", "",
           "Rendered by `python bench/report.py` from the JSON files in `bench/results/` (do not edit by hand). "
           "Each section names the command that wrote it.", "", "## Reproductions of the papers' results", ""]
    for path in reproduce:
        data = json.loads(path.read_text())
        prefix = next(p for p in REPRODUCE_ORDER if path.stem.startswith(p + "_"))
        out += [f"### `{path.name}`", "", f"Command: `{data.get('command', '?')}`  ",
                f"Machine: {machine_line(data)}  ",
                f"Load average: {load_line(data)}", ""]
        out += RENDERERS[prefix](data)
        if data.get("figure"):
            figure = Path(data["figure"])
            out += [f"![{path.stem}]({figure.relative_to('bench') if figure.parts[0] == 'bench' else figure})", ""]
    out += ["## Benchmarks", ""]
    for path in others:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            continue
        title = data.get("benchmark") or data.get("command") or path.stem
        command = data.get("provenance", {}).get("command")  # JSON written through memlm.bench.common names its command
        out += [f"### `{path.name}`: {title}", "", *([f"Command: `{command}`  "] if command else []),
                f"Machine: {machine_line(data)}  ", f"Load average: {load_line(data)}", ""]
        out += generic(data)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with bench/REPORT.md instead of writing it")
    parser.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"report: {args.out} is out of date: run python bench/report.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
