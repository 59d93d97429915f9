"""The flags of the commands that run on Ray (`memlm sweep`, `extrapolate`, `longeval`), declared and checked here
once: where Ray runs (--address, --num-cpus), the MLflow experiment and store a command logs its results to
(--experiment, --uri), and the resources of a command's one Ray task per evaluation (--cpus-per-task,
--gpus-per-task, --lanes, --max-retries).

Imports neither ray nor torch: the command line builds its parser from it, and `memlm --help` stays instant.
"""

from __future__ import annotations

import argparse

from .errors import ClusterError


def add_ray_flags(parser: argparse.ArgumentParser, *, experiment: str | None = None,
                  lanes: str | None = None) -> None:
    """Add the Ray flags to a command's parser, under their own heading of its --help. `experiment`: the MLflow
    experiment the command logs to by default (a command that logs nothing itself passes None and gets no
    --experiment / --uri); `lanes`: what the lanes of one evaluation task are (None: the command runs no such
    tasks and gets no task flags)."""
    ray = parser.add_argument_group("Ray" if experiment is None else "Ray and MLflow")
    ray.add_argument("--address", metavar="ADDR", help="an existing Ray cluster (default: a local Ray on 127.0.0.1)")
    ray.add_argument("--num-cpus", type=int, metavar="C", help="CPUs of a local Ray (default: all)")
    if experiment is not None:
        ray.add_argument("--experiment", default=experiment, help=f"MLflow experiment (default {experiment})")
        ray.add_argument("--uri", metavar="URI",
                         help="MLflow tracking URI (default $MLFLOW_TRACKING_URI or ./mlflow.db)")
    if lanes is not None:
        ray.add_argument("--cpus-per-task", type=float, default=1.0, metavar="C",
                         help="CPUs each evaluation asks for (default 1)")
        ray.add_argument("--gpus-per-task", type=float, default=0.0, metavar="G",
                         help="GPUs each evaluation asks for (default 0: CPU; Ray hands each task its own GPU)")
        ray.add_argument("--lanes", type=int, metavar="B", help=f"{lanes} (default the run's eval lanes)")
        ray.add_argument("--max-retries", type=int, default=2, metavar="R",
                         help="retries of a failed evaluation (default 2)")


def check_ray_flags(args: argparse.Namespace) -> None:
    """ClusterError, one line, for a Ray flag no run could use; the task flags are checked where they were added."""
    if args.num_cpus is not None and args.num_cpus < 1:
        raise ClusterError(f"--num-cpus must be >= 1, got {args.num_cpus}")
    if args.address and args.num_cpus is not None:
        raise ClusterError("--num-cpus sizes a local Ray; an existing cluster (--address) has its own CPUs: "
                           "give one of the two")
    if not hasattr(args, "cpus_per_task"):
        return
    if args.cpus_per_task <= 0:
        raise ClusterError(f"--cpus-per-task must be > 0, got {args.cpus_per_task:g}")
    if args.gpus_per_task < 0:
        raise ClusterError(f"--gpus-per-task must be >= 0, got {args.gpus_per_task:g}")
    if args.max_retries < 0:
        raise ClusterError(f"--max-retries must be >= 0, got {args.max_retries}")
    if args.lanes is not None and args.lanes < 1:
        raise ClusterError(f"--lanes must be >= 1, got {args.lanes}")
