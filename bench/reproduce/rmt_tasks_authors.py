"""The RMT authors' own Figure 4 runs, as their repository reports them: the reference rmt_tasks.py compares with.

Source: booydar/LM-RMT, experiment_results/short_synthetic+MT.csv (column `test acc`, one row per run), grouped by
dataset, n_chunks (segments) and model: `transformer` has mem_len 0 and no memory tokens, `txl` a cache (mem_len =
segment length), `rmt` memory tokens (= segment length) and no cache. Every row has mem_backprop_depth 0, batch 32,
the run_*.sh models. Values are test per-character accuracy (their evaluation: greedy generation for copy and
reverse when the answer spans more than one segment, teacher-forced otherwise); chance is 0.1 (10 symbols).
Runs of one group differ in seed and steps (`steps`: the max_step values among them).
"""

from __future__ import annotations

# (task, segments, arch) -> (test accuracy of every run, the max_step values of those runs)
AUTHORS = {
    ("copy", 1, "transformer"): ([1.0, 1.0, 1.0], (400000,)),
    ("copy", 3, "transformer"): ([0.12, 0.12, 0.115], (400000,)),
    ("copy", 3, "txl"): ([1.0, 1.0, 0.999, 0.832], (400000, 500000)),
    ("copy", 3, "rmt"): ([1.0, 1.0, 1.0, 1.0, 0.117, 0.118, 0.123], (400000, 500000)),
    ("copy", 6, "transformer"): ([0.102], (900000,)),
    ("copy", 6, "txl"): ([0.657, 0.298, 0.355, 0.856, 0.998, 0.904, 1.0], (700000, 900000)),
    ("copy", 6, "rmt"): ([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.101, 0.1, 0.101], (700000, 900000)),
    ("copy", 9, "transformer"): ([0.102, 0.102, 0.102, 0.101, 0.102], (900000,)),
    ("copy", 9, "txl"): ([0.189, 0.451, 0.451, 0.189, 0.259, 0.218, 0.186], (400000, 900000)),
    ("copy", 9, "rmt"): ([1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.099], (900000,)),
    ("reverse", 1, "transformer"): ([1.0, 1.0, 1.0], (250000,)),
    ("reverse", 2, "transformer"): ([0.102, 0.102, 0.102], (400000,)),
    ("reverse", 2, "txl"): ([0.959, 0.899, 0.394, 0.881, 0.996], (400000, 500000)),
    ("reverse", 2, "rmt"): ([1.0, 1.0, 1.0, 1.0, 1.0, 0.102, 0.102, 0.102], (400000, 500000)),
    ("reverse", 4, "transformer"): ([0.102, 0.1], (850000,)),
    ("reverse", 4, "txl"): ([0.877, 0.872, 0.833, 0.832, 0.8, 0.782, 0.784], (850000,)),
    ("reverse", 4, "rmt"): ([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.099, 0.1, 0.1], (850000, 900000)),
    ("reverse", 6, "transformer"): ([0.102, 0.101, 0.101, 0.102, 0.102, 0.102], (700000,)),
    ("reverse", 6, "txl"): ([0.627, 0.696, 0.68, 0.66, 0.627, 0.696, 0.68, 0.66], (700000,)),
    ("reverse", 6, "rmt"): ([1.0, 0.701, 0.702, 1.0, 1.0, 1.0, 0.1, 0.102, 0.102], (700000, 900000)),
    ("retrieval", 1, "transformer"): ([1.0, 1.0], (400000,)),
    ("retrieval", 2, "transformer"): ([0.496], (1000000,)),
    ("retrieval", 2, "txl"): ([1.0, 1.0, 1.0], (1000000,)),
    ("retrieval", 2, "rmt"): ([0.999, 0.963, 0.998, 0.998, 0.182, 0.201, 0.189], (700000, 1000000)),
    ("retrieval", 3, "transformer"): ([0.496], (1000000,)),
    ("retrieval", 3, "txl"): ([1.0, 1.0, 1.0], (1000000,)),
    ("retrieval", 3, "rmt"): ([0.999, 1.0, 0.999], (1000000,)),
    ("retrieval", 4, "transformer"): ([0.099], (1000000,)),
    ("retrieval", 4, "txl"): ([0.669, 0.905, 0.973], (1000000,)),
    ("retrieval", 4, "rmt"): ([0.986, 0.994, 0.996, 0.141, 0.148, 0.128], (1000000,)),
    ("retrieval", 5, "transformer"): ([0.099], (1000000,)),
    ("retrieval", 5, "txl"): ([0.965, 0.999, 0.999, 0.965, 0.999, 0.999], (1000000,)),
    ("retrieval", 5, "rmt"): ([0.989, 0.922, 0.984, 0.109, 0.109, 0.109], (1000000,)),
}


def summary(task: str, segments: int, arch: str) -> dict | None:
    """The authors' runs of one cell: median, best, and how many of them ended below 0.25 (near chance: 0.1)."""
    hit = AUTHORS.get((task, segments, arch))
    if hit is None:
        return None
    runs, steps = hit
    ordered = sorted(runs)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {"runs": runs, "median": round(median, 3), "best": max(runs),
            "near_chance": sum(r < 0.25 for r in runs), "steps": list(steps)}
