"""Memory extrapolation (LaMemo Figure 5) on the WikiText-2 runs: Transformer-XL and LaMemo trained with
N = M = 64, evaluated on test with N = 64 and memory 64 x m, m = 1..10, through `memlm extrapolate` (one Ray task
per run and m).

    .venv/bin/python bench/reproduce/extrapolate.py                  # after wikitext2.py --profile cpu
    .venv/bin/python bench/reproduce/extrapolate.py --profile smoke  # CI: the smoke runs, m = 1, 2

Reads the runs bench/reproduce/wikitext2.py left in runs/reproduce/wt2-PROFILE/runs (seed --seed of
Transformer-XL and LaMemo), writes bench/results/reproduce_extrapolate_PROFILE.json (the table, per m: both
perplexities and LaMemo's gap) and the figure. The paper's expectation: LaMemo below Transformer-XL at every m,
the gap not shrinking as m grows.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT, load_average, write_result
from memlm.bench.reproduce.experiment import (
    FIGURES,
    ExperimentError,
    add_stop_options,
    machine,
    memlm,
    read_json,
    run_experiment,
    shown,
    supervise,
)

MULTS = {"cpu": "1-10", "cpu_long": "1,4,10", "gpu": "1-10", "smoke": "1,2"}
ARCHS = ("txl", "lamemo")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(MULTS), default="cpu")
    parser.add_argument("--work", type=Path, help="the wikitext2.py work folder (default runs/reproduce/wt2-PROFILE)")
    parser.add_argument("--seed", type=int, default=1, help="which seed's runs (default 1)")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray (default 2)")
    parser.add_argument("--out", type=Path,
                        help="results JSON (default bench/results/reproduce_extrapolate_PROFILE.json)")
    add_stop_options(parser)
    args = parser.parse_args(argv)
    supervise(args)
    work = (args.work or ROOT / "runs" / "reproduce" / f"wt2-{args.profile}").resolve()
    runs = [work / "runs" / f"{arch}-s{args.seed}" for arch in ARCHS]
    missing = [str(r) for r in runs if not (r / "checkpoints" / "latest").is_file()]
    if missing:
        print(f"extrapolate: error: no trained run at {', '.join(missing)}: run bench/reproduce/wikitext2.py "
              f"--profile {args.profile} first", file=sys.stderr)
        return 1
    out_dir = work / "extrapolation"
    load_start = load_average()
    try:
        seconds = memlm(["extrapolate", *map(str, runs), "--mult", MULTS[args.profile], "--tgt-len", "64"
                         if args.profile != "smoke" else "8", "--split", "test", "--out", str(out_dir),
                         "--num-cpus", str(args.num_cpus), "--uri", f"sqlite:///{work / 'mlflow.db'}",
                         "--experiment", f"memlm-reproduce-extrapolate-{args.profile}"],
                        work / "logs" / "extrapolate.log", threads=1, name="extrapolation")
    except ExperimentError as err:
        print(f"extrapolate: error: {err}", file=sys.stderr)
        return 1
    summary = read_json(out_dir / "summary.json")
    by_arch = {body["arch"]: body for body in summary["runs"].values()}
    table = []
    for m in summary["mults"]:
        row = {"m": m, "mem_len": None}
        for arch in ARCHS:
            hit = [r for r in by_arch[arch]["results"] if r["m"] == m]
            row[f"{arch}_ppl"] = hit[0]["ppl"] if hit else None
            row["mem_len"] = hit[0]["mem_len"] if hit else row["mem_len"]
            row["tokens"] = hit[0]["tokens"] if hit else None
        if row["txl_ppl"] and row["lamemo_ppl"]:
            row["lamemo_minus_txl"] = row["lamemo_ppl"] - row["txl_ppl"]
        table.append(row)
    results, figures = (work, work) if args.profile == "smoke" else (RESULTS, FIGURES)
    figure = figures / f"reproduce_extrapolate_{args.profile}.png"
    figure.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out_dir / "extrapolation.png", figure)
    out = args.out or results / f"reproduce_extrapolate_{args.profile}.json"
    write_result(out, {"experiment": "extrapolate", "profile": args.profile, "machine": machine(),
                     "command": f"python bench/reproduce/extrapolate.py --profile {args.profile}",
                     "runs": [shown(r) for r in runs], "split": summary["split"], "tgt_len": summary["tgt_len"],
                     "wall_seconds": round(seconds, 1), "load_start": load_start, "load_end": load_average(),
                     "figure": shown(figure), "table": table})
    print("| m | M | Transformer-XL ppl | LaMemo ppl | LaMemo - TXL |\n|---|---|---|---|---|")
    for r in table:
        gap = f"{r['lamemo_minus_txl']:+.2f}" if "lamemo_minus_txl" in r else "-"
        print(f"| {r['m']} | {r['mem_len']} | {r['txl_ppl']:.2f} | {r['lamemo_ppl']:.2f} | {gap} |")
    print(f"wrote {out} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(run_experiment(main, again="rerun the same command to extrapolate again"))
