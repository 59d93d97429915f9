"""Exact-match accuracy by segments between fact and question, for one `memlm curriculum` folder: what
bench/reproduce/longctx.py runs after each (arch, task) curriculum, as a child process.

    python bench/reproduce/longctx_eval.py CURRICULUM_OUT --json OUT.json [--threads 1]

The samples are each stage's own test split, read back from the stage's shards (never trained on; fresh stories,
the stage's length and depth window, so the fact lies S segments before the answer in an S-segment stage). Per
stage S:
    own    the model the curriculum ended stage S with, on the S-segment test samples (what the stage learned);
    final  the last stage's model on them (what the finished curriculum still does at S segments).
Each sample is bucketed by its own measured distance (trainer/loop/curriculum_samples.py: segments from the one
reading the fact to the one predicting the answer, both counted), so a sample whose fact strayed is counted where it
lies. Beside the accuracies, the baselines of a reader that does not learn, on the very same samples
(trainer/inference/longeval_baselines.py: chance, last / most frequent place mentioned). An answer counts as
`memlm longeval` counts it: every answer byte the most likely next byte (greedy decoding).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from memlm.bench.interrupt import stop_in_one_line


def load_model(run_dir: Path):
    """The run's latest weights in the model `memlm eval` builds (on the GPU when there is one), its config and
    step."""
    from memlm.trainer.checkpoint.run_loader import open_run

    run = open_run(run_dir)  # memlm's one run loader (eval, generate, longeval, export and analyze use it)
    return run.load_model(device()), run.config, run.step


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def score(model, cfg, task: str, samples: list, boundary_id: int) -> dict:
    """Accuracy over `samples`, overall and by measured segments from fact to answer."""
    from memlm.trainer.inference.longeval import answer_correct
    from memlm.trainer.loop.curriculum_samples import fact_start, segments_apart

    right = answer_correct(model, samples, lanes=cfg.data.eval_lanes, boundary_id=boundary_id, device=device())
    by_apart: dict[int, list[bool]] = defaultdict(list)
    for (tokens, answer_len), ok in zip(samples, right):
        text = bytes(tokens.astype("uint8")).decode("ascii")
        prompt, answer = text[:len(text) - answer_len - 1], text[len(text) - answer_len:]
        fact = fact_start(task, prompt, answer)
        if fact is not None:
            by_apart[segments_apart(fact, len(prompt) + 1, model.cfg.tgt_len)].append(ok)
    return {"samples": len(right), "accuracy": sum(right) / len(right),
            "by_apart": {str(k): {"samples": len(v), "accuracy": sum(v) / len(v)} for k, v in sorted(by_apart.items())}}


def baselines_of(task: str, options: dict, samples: list) -> dict:
    from memlm.trainer.inference.longeval_baselines import baselines, task_labels_and_chance

    pairs = []
    for tokens, answer_len in samples:
        text = bytes(tokens.astype("uint8")).decode("ascii")
        pairs.append((text[:len(text) - answer_len - 1], text[len(text) - answer_len:]))
    labels, chance = task_labels_and_chance(task, options)
    return baselines(task, pairs, labels, chance)


def evaluate(curriculum: Path) -> dict:
    from memlm.data_pipeline.shards import load_manifest
    from memlm.trainer.loop.curriculum_samples import read_split

    summary = json.loads((curriculum / "curriculum.json").read_text())
    task, stages = summary["task"], summary["stages"]
    final_model, final_cfg, final_step = load_model(Path(stages[-1]["run_dir"]))
    rows = []
    for stage in stages:
        model, cfg, step = load_model(Path(stage["run_dir"]))
        manifest = load_manifest(cfg.data.path)  # the stage's own data: its test split was never trained on
        options, boundary = manifest["corpus"]["options"], int(manifest["tokenizer"]["boundary_id"])
        samples = read_split(cfg.data.path, "test")
        rows.append({"stage": stage["stage"], "segments": stage["segments"], "length": options["length"],
                     "stop": stage["stop"], "stop_step": stage["step"], "stop_reason": stage["reason"],
                     "held_out_accuracy": stage["accuracy"],
                     "own": {"step": step, **score(model, cfg, task, samples, boundary)},
                     "final": {"step": final_step, **score(final_model, final_cfg, task, samples, boundary)},
                     "baselines": baselines_of(task, options, samples)})
    return {"task": task, "tgt_len": summary["tgt_len"], "stages": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("curriculum", type=Path, help="a memlm curriculum --out folder")
    parser.add_argument("--json", type=Path, required=True, help="where to write the result")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    result = evaluate(args.curriculum)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["stages"]:
        print(f"{result['task']} {row['segments']} segment(s): own {100 * row['own']['accuracy']:.1f}%, final "
              f"{100 * row['final']['accuracy']:.1f}% of {row['own']['samples']}; baselines "
              + ", ".join(f"{k} {100 * v:.1f}%" for k, v in row["baselines"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))
