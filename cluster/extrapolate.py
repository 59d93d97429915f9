"""`memlm extrapolate RUN_DIR [RUN_DIR ...] --mult 1-10 [--tgt-len N]`: the LaMemo paper's Figure 5.

For every run folder and every m, one Ray task evaluates the split with target length N (default: the length the
runs were trained with) and memory m x N
(trainer.inference.evaluate.evaluate_run, one process, no process group). Results go to
OUT/<run>/<split>-tgt<N>-m<m>.json
as they arrive, then to OUT/summary.json, OUT/extrapolation.csv, the plot OUT/extrapolation.png and MLflow (one
run per RUN_DIR, metric extrapolate_ppl at step m). A rerun reuses every result of the same checkpoint already in
OUT, so after a crash only the missing (run, m) are evaluated.

Order of work, and why:
1. flags, multipliers and every RUN_DIR are checked (config, checkpoint, corpus): a mistake costs one line, not a
   Ray start and a wall of failing tasks;
2. the MLflow experiment is created in the driver, before anything runs in parallel (docs/design.md §9);
3. Ray: one task per (run, m), `num_cpus=--cpus-per-task`, so Ray runs as many at once as the cluster has CPUs;
   a task whose worker dies (killed, out of memory) or that raises a transient error is retried --max-retries
   times; a user error (ConfigError/DataError, both ValueError) is not retried: it would fail the same way again;
4. a task that still fails is reported by (run, m) and reason; the other results are kept and written, and the
   command exits 1. A node lost mid-run costs its running tasks one attempt each (Ray re-runs them on the other
   nodes); the summary names the lost nodes and the retried (run, m), summary.json the node of every result.
Only this package imports ray, and only inside functions (docs/design.md §1).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memlm.data_pipeline.progress import format_duration
from memlm.trainer.inference.evaluate import write_json
from memlm.trainer.runtime import heartbeat

from .errors import ClusterError
from .extrapolate_mlflow import log_run, open_experiment
from .extrapolate_outputs import build_summary, table, write_outputs
from .extrapolate_plan import Job, check_runs, parse_mult, plan_jobs, read_result, trained_tgt_len
from .extrapolate_task import evaluate_task
from .ray_flags import check_ray_flags
from .ray_runtime import (
    amount,
    connected_resources,
    dead_nodes,
    error_reason,
    local_resources,
    lost_since,
    missing,
    quiet_console_env,
    ray_session,
    short_node,
)

DEFAULT_OUT = "extrapolation"
# Errors worth another attempt: I/O hiccups on a shared filesystem, a runtime failure of torch (allocation on a
# crowded node). Worker deaths are retried by Ray regardless (max_retries). ValueError (ConfigError, DataError)
# is deterministic and is not in the list.
RETRY_EXCEPTIONS = [OSError, RuntimeError, MemoryError]


def main(args: argparse.Namespace) -> int:
    quiet_console_env()  # before anything imports ray
    check_ray_flags(args)
    if not args.address:  # what the local Ray will have is known before it starts
        _refuse_unless_tasks_fit(args, local_resources(args.num_cpus), "the local Ray would have")
    mults = parse_mult(args.mult)
    if args.tgt_len is None:  # the runs' own N: a model trained at N = 8 is extrapolated at N = 8
        args.tgt_len = trained_tgt_len(args.run_dirs)
    runs = check_runs(args.run_dirs, args.split, args.tgt_len, mults)
    out = Path(args.out or DEFAULT_OUT).resolve()
    jobs, results = plan_jobs(runs, mults, args.tgt_len, args.split, out)

    client, experiment_id, uri = open_experiment(args.experiment, args.uri)
    total = len(runs) * len(mults)
    heartbeat.phase(None)  # its first line (memlm/start_watch.py)
    print(f"extrapolate: {len(runs)} run(s) x m in {_mult_text(mults)} (N = {args.tgt_len}, {args.split} split): "
          f"{len(jobs)} evaluation(s) to run", flush=True)
    if results:
        print(f"extrapolate: reusing {len(results)} of {total} result(s) already in {out} (same checkpoint step); "
              "delete them to evaluate again", flush=True)

    seconds: dict[tuple[str, int], float] = {}
    failures: list[str] = []
    where = Where()
    if jobs:
        fresh, seconds, failures, where = run_on_ray(jobs, args)
        results.update(fresh)
    return finish(args, runs, mults, out, results, seconds, failures, client, experiment_id, uri, where)


@dataclass
class Where:
    """Where the evaluations ran: the node of each fresh result, the attempt that gave it (0: the first; more:
    Ray retried it after its worker or node was lost, or after a transient error) and the nodes lost meanwhile."""

    nodes: dict[tuple[str, int], str] = field(default_factory=dict)
    attempts: dict[tuple[str, int], int] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """The summary's lines about lost nodes and retried evaluations (none when nothing was retried)."""
        lines = []
        if self.lost:
            names = ", ".join(f"{short_node(n)} ({addr})" for n, addr in sorted(self.lost.items()))
            kept = sum(node in self.lost for node in self.nodes.values())
            lines.append(f"lost {len(self.lost)} node(s) during the run: {names}; {kept} result(s) finished there "
                         "before are kept, the evaluations under way there were retried on the other nodes")
        retried = sorted(key for key, attempt in self.attempts.items() if attempt)
        if retried:
            parts = [f"{name} m={m} (attempt {self.attempts[(name, m)] + 1}, on node "
                     f"{short_node(self.nodes.get((name, m), ''))})" for name, m in retried]
            lines.append(f"{len(retried)} evaluation(s) retried and finished: {', '.join(parts)}")
        return lines


def run_on_ray(jobs: list[Job], args: argparse.Namespace
               ) -> tuple[dict[tuple[str, int], dict], dict[tuple[str, int], float], list[str], Where]:
    """Submit every job, collect as they finish. Returns (results, seconds, failure lines, where they ran), keyed
    (run name, m)."""
    import ray

    results: dict[tuple[str, int], dict] = {}
    where = Where()
    seconds: dict[tuple[str, int], float] = {}
    failures: list[str] = []
    with ray_session(args.address, args.num_cpus):
        if args.address:  # a cluster's resources are known once connected
            _refuse_unless_tasks_fit(args, connected_resources(), f"the Ray cluster at {args.address} has")
        dead_before = dead_nodes()  # a cluster remembers nodes that died before this command
        task = ray.remote(evaluate_task)
        # Ray sets CUDA_VISIBLE_DEVICES per task (empty without GPUs), so evaluation picks CUDA exactly when the
        # task was given a GPU.
        options = {"num_cpus": args.cpus_per_task, "num_gpus": args.gpus_per_task, "max_retries": args.max_retries,
                   "retry_exceptions": RETRY_EXCEPTIONS}
        pending = {}
        for job in jobs:
            ref = task.options(**options, name=f"extrapolate:{job.run.name}:m{job.m}").remote(
                str(job.run.run_dir), args.split, args.tgt_len, job.mem_len, args.lanes, str(job.json_path),
                args.cpus_per_task)
            pending[ref] = job
        start = time.perf_counter()
        tokens = 0
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    job = pending.pop(ref)
                    key = (job.run.name, job.m)
                    try:
                        reply = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - any task failure is reported, the rest goes on
                        failures.append(f"{job.run.name} at m={job.m} (memory {job.mem_len}) failed "
                                        f"(retries allowed: {args.max_retries}): {error_reason(exc)}")
                        print(f"extrapolate: FAILED {failures[-1]}", file=sys.stderr, flush=True)
                        continue
                    results[key] = _keep(job, reply["result"])
                    seconds[key] = reply["seconds"]
                    where.nodes[key] = reply.get("node_id", "")
                    where.attempts[key] = reply.get("attempt", 0)
                    done = len(results) + len(failures)
                    elapsed = time.perf_counter() - start
                    tokens += int(reply["result"].get("tokens", 0))
                    # Tasks run side by side, so the ETA is the mean wall time per finished task so far.
                    eta = format_duration(elapsed / done * (len(jobs) - done))
                    print(f"[{done}/{len(jobs)} {elapsed:6.1f} s, eta {eta}] {job.run.name} m={job.m} "
                          f"(memory {job.mem_len}): {args.split} ppl {results[key]['ppl']:.4g} "
                          f"in {reply['seconds']:.1f} s{_on_node(where, key, short_node)}; {tokens:,} tokens "
                          "evaluated", flush=True)
        except BaseException:
            # Ctrl-C (or a driver error): do not leave tasks running on a cluster we do not own.
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        where.lost = lost_since(dead_before)
    return results, seconds, failures, where


def _on_node(where: Where, key: tuple[str, int], short_node) -> str:
    """" on node 1a2b3c4d" (", retry 1" added for a retried task) for a progress line; "" outside a cluster."""
    node = where.nodes.get(key)
    if not node:
        return ""
    attempt = where.attempts.get(key, 0)
    return f" on node {short_node(node)}" + (f", retry {attempt}" if attempt else "")


def finish(args, runs, mults, out: Path, results, seconds, failures, client, experiment_id: str, uri: str,
           where: Where) -> int:
    """Summary, CSV, plot, MLflow, the table; exit status 1 when some (run, m) failed."""
    summary = build_summary(runs, mults, args.split, args.tgt_len, results, seconds, where.nodes)
    summary["lost_nodes"] = sorted(where.lost)
    paths = write_outputs(out, summary)
    try:
        for run in runs:
            log_run(client, experiment_id, run, summary["runs"][run.name], args.split, args.tgt_len,
                    [paths["plot"], paths["summary"], paths["csv"]])
    except Exception as exc:  # noqa: BLE001 - the store went away mid-command: the results on disk still stand
        print(table(summary))
        raise ClusterError(f"results are in {out}, but logging them to MLflow at {uri} failed ({error_reason(exc)}); "
                           "rerun the same command to log them (finished results are reused)") from None
    print(table(summary))
    for line in where.lines():
        print(f"extrapolate: {line}")
    print(f"extrapolate: results in {out} (summary.json, extrapolation.csv, extrapolation.png); MLflow experiment "
          f"{args.experiment!r} at {uri}")
    if failures:
        for line in failures:
            print(f"memlm: error: extrapolation of {line}", file=sys.stderr)
        print(f"memlm: error: {len(failures)} evaluation(s) failed; the other results are kept and a rerun "
              "evaluates only the missing ones", file=sys.stderr)
        return 1
    return 0


def _refuse_unless_tasks_fit(args: argparse.Namespace, available: dict[str, float], where: str) -> None:
    """Ray would queue a task that no node can hold forever: one line instead, naming the flags to change."""
    asked = {"CPU": args.cpus_per_task, "GPU": args.gpus_per_task}
    short = missing(asked, available)
    if not short:
        return
    fixes = []
    if "CPU" in short:
        fixes.append(f"--cpus-per-task {math.floor(available['CPU'] * 100) / 100:g}" if available["CPU"] >= 0.01
                     else "a cluster with CPUs")
        if not args.address:
            fixes[-1] += f" (or --num-cpus {math.ceil(args.cpus_per_task)}: Ray then shares the cores)"
    if "GPU" in short:
        fixes.append(f"--gpus-per-task {available['GPU']:g}")
    raise ClusterError(f"each evaluation asks for {amount(asked, nonzero=True)} (--cpus-per-task "
                       f"{args.cpus_per_task:g}, --gpus-per-task {args.gpus_per_task:g}) but {where} "
                       f"{amount(available)}, so none could ever start; use {' and '.join(fixes)}")


def _keep(job: Job, result: dict[str, Any]) -> dict[str, Any]:
    """The task wrote job.json_path itself; on a cluster whose workers do not share this filesystem it landed on
    the worker's disk instead, so the driver writes it whenever its copy here is missing or different."""
    if read_result(job.json_path) != result:
        write_json(result, job.json_path)
    return result


def _mult_text(mults: list[int]) -> str:
    contiguous = mults == list(range(mults[0], mults[-1] + 1))
    return f"{mults[0]}..{mults[-1]}" if contiguous and len(mults) > 2 else ",".join(map(str, mults))


