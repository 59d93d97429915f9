"""Starting or joining Ray the way memlm needs it: loopback by default, no telemetry, the same code on the workers.

    from cluster.ray_runtime import ray_session
    with ray_session(address=None, num_cpus=2):   # local Ray on 127.0.0.1; address="auto" / "ray://..." joins one
        ...                                        # ray.remote tasks, tune.Tuner, ...

Only `cluster` imports ray (DESIGN §1), and only inside functions, so `memlm --help` and training never need it.

Why each setting (DESIGN §9): Ray probes the cloud-metadata address and discovers its node IP with a UDP connect
to a public address unless it is told the node IP; a local cluster therefore binds to 127.0.0.1 with the
dashboard off. Usage stats and MLflow telemetry are switched off for the driver and, through the runtime
environment, for every worker. Ray 2.60 turns token authentication on by default, which a single-user local
cluster does not need; an existing cluster keeps whatever its operator chose.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from .errors import ClusterError

LOCAL_HOST = "127.0.0.1"

# Launcher variables (torchrun, the deepspeed launcher, and trainer.distributed for a plain training process).
# A Ray worker that inherits them from its driver would host or join a process group that is not its own: every
# trial would try to bind the same MASTER_PORT.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")

# Set for the driver and passed to every worker (setdefault: a user's own choice wins).
QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    # A worker's output reaches the driver's console prefixed by Ray: training's per-step lines and evaluation
    # progress from every trial or task would bury the driver's own one line per trial / task (data_pipeline.progress).
    "MEMLM_PROGRESS": "0",
}


def quiet_console_env() -> None:
    """Output to a file or pipe: no colour codes around Ray's worker prefixes, and no green "[repeated Nx across
    cluster]" notes (escape sequences in a log). Ray reads RAY_DEDUP_LOGS when it is imported, so the commands
    call this first thing."""
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def worker_env() -> dict[str, str]:
    """Environment variables every Ray worker gets: telemetry off, and the driver's MLflow/DeepSpeed settings."""
    env = {key: os.environ.get(key, value) for key, value in QUIET_ENV.items()}
    for key in ("MLFLOW_TRACKING_URI", "DEEPSPEED_TIMEOUT", "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS",
                "DS_ACCELERATOR", "PYTHONPATH"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def start(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None) -> bool:
    """Connect to Ray; returns True when this call started it (so the caller shuts it down).

    address None: a new local Ray on 127.0.0.1 (dashboard off). "auto" or "HOST:PORT" or "ray://HOST:PORT":
    join an existing cluster (remote addresses are the user's explicit choice).
    """
    for key, value in QUIET_ENV.items():
        if key != "MEMLM_PROGRESS":  # the workers' setting, not the driver's
            os.environ.setdefault(key, value)
    quiet_console_env()
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": worker_env()}
    if address:
        try:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        except ConnectionError as exc:
            raise ClusterError(f"cannot reach a Ray cluster at {address!r} ({exc}); start one with `ray start "
                               "--head` there, or leave --address out for a local Ray") from None
        return True
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # The local Ray's processes copy this process's environment when they start: leave the launcher variables
    # out of it (a driver that trained in process has RANK=0, WORLD_SIZE=1, MASTER_PORT=... set).
    saved = {key: os.environ.pop(key) for key in LAUNCH_VARS if key in os.environ}
    try:
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, _node_ip_address=LOCAL_HOST,
                 runtime_env=runtime_env, log_to_driver=True, configure_logging=True, logging_level="WARNING")
    finally:
        os.environ.update(saved)
    return True


def clear_launch_env() -> None:
    """Forget launcher variables in this worker process, so what runs here is a fresh single process (on an
    existing cluster the workers' environment comes from whoever started its nodes)."""
    for key in LAUNCH_VARS:
        os.environ.pop(key, None)


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None,
                num_gpus: int | None = None) -> Iterator[None]:
    """Ray for the duration of the block; shut down afterwards only if this block started it."""
    quiet_console_env()
    import ray

    started = start(address, num_cpus, num_gpus)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
