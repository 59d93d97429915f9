"""Starting or joining Ray the way memlm needs it: loopback by default, no telemetry, the same code on the workers.

    from .ray_runtime import ray_session
    with ray_session(address=None, num_cpus=2):   # local Ray on 127.0.0.1; address="auto" / "ray://..." joins one
        ...                                        # ray.remote tasks, tune.Tuner, ...

Only `cluster` imports ray (docs/design.md §1), and only inside functions, so `memlm --help` and training never need it.

Why each setting (docs/design.md §9): every server a Ray node runs (GCS, raylet and object manager, each worker's and
the
driver's gRPC server, the dashboard and runtime-env agents, the metrics exporters) binds to 127.0.0.1 only when
the node's IP is a loopback address, and to every interface otherwise. `ray.init(_node_ip_address="127.0.0.1")`
alone does not give that on Linux: Ray replaces a loopback node IP by the address it discovers with a UDP connect
towards a public address, unless its local-only mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on macOS
and Windows) is on while it starts. A local Ray is started in that mode, with the dashboard off, and is refused
if it still came up on another address. Its workers keep gloo and NCCL on the loopback interface, and a
single-process trial's torch rendezvous (which binds every interface by itself) is made on a loopback socket
(single_process_env). Usage stats and MLflow telemetry are switched off for the driver and,
through the runtime environment, for every worker. Ray 2.60 turns token authentication on by default, which a
single-user local cluster does not need; an existing cluster keeps whatever its operator chose.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import sys
from collections.abc import Iterator
from typing import Any

from memlm.trainer.runtime import heartbeat
from memlm.trainer.runtime.distributed import loopback_comm_env, loopback_single_process

from .errors import ClusterError

LOCAL_HOST = "127.0.0.1"
# Ray's switch for its local-only mode (read by ray._private.ray_constants).
LOCAL_ONLY_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# Launcher variables (torchrun, the deepspeed launcher, and trainer.runtime.distributed for a plain training process).
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
                "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "DS_ACCELERATOR", "PYTHONPATH"):
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
    # Every rank of a local Ray is on this machine: gloo's and NCCL's sockets stay on loopback too.
    runtime_env["env_vars"].update({k: v for k, v in loopback_comm_env().items() if k not in os.environ})
    try:
        with _local_only_mode():
            ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, _node_ip_address=LOCAL_HOST,
                     runtime_env=runtime_env, log_to_driver=True, configure_logging=True, logging_level="WARNING")
    finally:
        os.environ.update(saved)
    node_ip = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node_ip).is_loopback:
        ray.shutdown()
        raise ClusterError(f"the local Ray came up on {node_ip}, not on {LOCAL_HOST} (this Ray version ignores its "
                           "local-only mode), so its servers would listen beyond this machine; it was stopped. Use a "
                           "Ray cluster you secured yourself with --address")
    return True


@contextlib.contextmanager
def _local_only_mode() -> Iterator[None]:
    """Ray's local-only mode while a local Ray starts: its node IP stays 127.0.0.1 (see the module docstring).

    The environment variable reaches the Ray processes started here; the constant is what this process reads,
    computed when ray was first imported (possibly before this call). Both are restored afterwards, so a later
    ray.init(address=...) in the same process discovers its real address as usual."""
    from ray._private import ray_constants

    saved_env = os.environ.get(LOCAL_ONLY_VAR)
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOCAL_ONLY_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(LOCAL_ONLY_VAR, None)
        else:
            os.environ[LOCAL_ONLY_VAR] = saved_env


def local_resources(num_cpus: int | None = None, num_gpus: int | None = None) -> dict[str, float]:
    """The CPUs and GPUs a local Ray started by start(None, num_cpus, num_gpus) would have, known before it
    starts: Ray's own resolution (CPUs from the affinity mask and a cgroup quota, GPUs as CUDA_VISIBLE_DEVICES
    lets it see them, RAY_OVERRIDE_RESOURCES)."""
    from ray._private.resource_and_label_spec import ResourceAndLabelSpec

    spec = ResourceAndLabelSpec(num_cpus=num_cpus, num_gpus=num_gpus).resolve(is_head=True,
                                                                              node_ip_address=LOCAL_HOST)
    return {"CPU": float(spec.num_cpus or 0), "GPU": float(spec.num_gpus or 0)}


def connected_resources() -> dict[str, float]:
    """The CPUs and GPUs of the Ray cluster this process is connected to, all nodes together."""
    import ray

    total = ray.cluster_resources()
    return {"CPU": float(total.get("CPU", 0)), "GPU": float(total.get("GPU", 0))}


def missing(asked: dict[str, float], available: dict[str, float]) -> list[str]:
    """The resources of `asked` that `available` cannot give (Ray would queue such a request forever)."""
    return [key for key, value in asked.items() if value > available.get(key, 0.0) + 1e-9]


def amount(resources: dict[str, float], nonzero: bool = False) -> str:
    """{"CPU": 4, "GPU": 1} -> "4 CPUs and 1 GPU" (nonzero: leave out what is 0, as in a request)."""
    shown = {key: value for key, value in resources.items() if value or not nonzero}
    return " and ".join(f"{value:g} {key}{'' if value == 1 else 's'}" for key, value in shown.items())


def error_reason(exc: BaseException) -> str:
    """The original error of a failed Ray task or Tune trial in one line (RayTaskError carries it as .cause)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip()
    first = text.splitlines()[0][:300] if text else ""
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__


def clear_launch_env() -> None:
    """Forget launcher variables in this worker process, so what runs here is a fresh single process (on an
    existing cluster the workers' environment comes from whoever started its nodes)."""
    for key in LAUNCH_VARS:
        os.environ.pop(key, None)


def single_process_env() -> None:
    """Make this Ray worker a fresh single training process whose torch rendezvous, gloo and NCCL stay on
    loopback (trainer.runtime.distributed.loopback_single_process). Launcher variables inherited from a driver are
    replaced."""
    clear_launch_env()
    loopback_single_process()


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None,
                num_gpus: int | None = None) -> Iterator[None]:
    """Ray for the duration of the block; shut down afterwards only if this block started it."""
    quiet_console_env()

    heartbeat.said()  # the command has just said what it will run
    heartbeat.phase(f"connecting to the Ray cluster at {address}" if address else "starting a local Ray (127.0.0.1)")
    import ray

    started = start(address, num_cpus, num_gpus)
    heartbeat.phase(None)  # the command's progress lines from here
    try:
        yield
    finally:
        if started:
            ray.shutdown()


# -- where work ran, and which nodes a command lost -------------------------------------------------------------


def placement() -> dict[str, Any]:
    """{"node_id", "attempt"} of the Ray task or actor running this code ({} outside Ray): which node did the
    work, and whether this is a retry (attempt 0 is the first run; Ray re-runs a task lost with its worker or
    node under the same task id with the next attempt number)."""
    if "ray" not in sys.modules:  # called in-process (no Ray): never import it just to ask
        return {}
    import ray

    if not ray.is_initialized():
        return {}
    where: dict[str, Any] = {"node_id": ray.get_runtime_context().get_node_id()}
    try:  # no public API for the attempt number; a Ray without it only loses this detail
        where["attempt"] = int(ray._private.worker.global_worker.core_worker.get_current_task_attempt_number())
    except Exception:  # noqa: BLE001
        pass
    return where


def dead_nodes() -> dict[str, str]:
    """node id -> address of every node the connected cluster knows as dead (GCS keeps them for a while)."""
    import ray

    return {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes() if not n.get("Alive", True)}


def lost_since(dead_before: dict[str, str]) -> dict[str, str]:
    """The nodes that died since `dead_before = dead_nodes()` was taken."""
    return {node: addr for node, addr in dead_nodes().items() if node not in dead_before}


def short_node(node_id: str) -> str:
    """The first 8 hex digits of a node id, as a reader compares them with `ray status` / `ray list nodes`."""
    return node_id[:8]
