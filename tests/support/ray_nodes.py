"""A Ray cluster of two nodes on this machine, started the way an operator starts one: `ray start --head` and
`ray start --address`, each a process group of its own that a test can SIGKILL as a whole (a node lost).

    with RayNodes() as nodes:                         # head "a" on 127.0.0.1:PORT
        nodes.add("b", {"MEMLM_TEST_...": "..."})     # a second node joins it (its env reaches its workers)
        nodes.address                                 # what `memlm sweep --address` is given
        nodes.node_id("b")                            # Ray's id of node b (from its raylet's command line)
        nodes.kill("b")                               # SIGKILL node b's raylet, agents and workers at once

Why each choice:
- `--block`: `ray start` stays the parent of the node's processes, in a session of its own (start_new_session),
  so killing that process group kills exactly this node, never another test's Ray. `ray stop` is never used: it
  stops every Ray on the machine.
- every port a node opens is picked free here (two nodes on one machine would otherwise both take the dashboard
  agent's 52365, and tests running beside each other the client server's 10001);
- the head runs in Ray's local-only mode, which keeps its node IP on 127.0.0.1 (cluster/ray_runtime.py); a
  joining node refuses that mode ("Multi-node Ray clusters are not supported"), so it resolves its own address:
  127.0.0.1 in the suite's loopback-only network (scripts/offline.sh), the machine's address elsewhere (still
  this machine, so the cluster works either way);
- one CPU and a custom resource per node (node_a / node_b), so two one-CPU trials or tasks must use both nodes;
- the head notices a node that died without a word after about 5 s (health checks every 500 ms with 2 s to
  answer, dead after 5 misses) instead of Ray's default of about 30 s: the retries start sooner, nothing else
  changes (500 ms to answer, dead after 3, once declared the surviving node dead on a 2-core machine at load 7-10);
- a short temp dir per cluster under /tmp: Ray's unix sockets live there and their paths must stay under 107
  characters (pytest's tmp_path is often longer).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

RAY = Path(sys.executable).parent / "ray"  # the CLI installed beside this interpreter
HOST = "127.0.0.1"
STARTED = "Ray runtime started"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def node_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a `ray start` (and so of every worker on that node): no telemetry, no token auth (a
    single-user test cluster), one torch thread, the checkout importable, no launcher variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    repo = str(Path(__file__).resolve().parents[2])
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": repo, "DEEPSPEED_TIMEOUT": "1"})
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    env.update(extra or {})
    return env


class RayNodes:
    def __init__(self, env_a: dict[str, str] | None = None, timeout: float = 90):
        self.root = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))
        self.port = free_port()
        self.address = f"{HOST}:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.env_a = env_a or {}
        self.timeout = timeout

    def __enter__(self) -> RayNodes:
        try:
            self._start("a", ["--head", "--port", str(self.port), "--include-dashboard=false",
                              "--ray-client-server-port", str(free_port()), "--dashboard-port", str(free_port())],
                        {**self.env_a, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_health_check_period_ms": "500",
                         "RAY_health_check_timeout_ms": "2000", "RAY_health_check_failure_threshold": "5"})
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, name: str, env: dict[str, str] | None = None) -> None:
        """Start node `name` (1 CPU, resource node_NAME) and join it to the head; `env` reaches its workers. A
        node of that name from before (lost by an earlier test) is killed first if anything of it is left."""
        if name in self.procs:
            self.kill(name)
            self.procs.pop(name).wait(timeout=30)
        try:
            self._start(name, ["--address", self.address], env or {})
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, role: list[str], env: dict[str, str]) -> None:
        log = self.root / f"node_{name}.log"
        self.logs[name] = log
        cmd = [str(RAY), "start", *role, "--node-ip-address", HOST, "--num-cpus", "1", "--num-gpus", "0",
               "--resources", json.dumps({f"node_{name}": 1}), "--disable-usage-stats", "--block",
               "--temp-dir", str(self.root / "ray"),
               "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
               "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port())]
        with log.open("w") as out:
            self.procs[name] = subprocess.Popen(cmd, env=node_env(env), stdout=out,
                                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while STARTED not in log.read_text(errors="replace"):
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray node {name} did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def pids(self, name: str) -> list[int]:
        """Every live process of node `name`: the `ray start` and everything in its session."""
        proc = self.procs[name]
        found = []
        for p in psutil.process_iter(["pid", "status"]):
            try:
                if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.info["pid"]) == proc.pid:
                    found.append(p.info["pid"])
            except OSError:
                continue
        return found

    def node_id(self, name: str) -> str:
        """Ray's id of node `name`, from its raylet's --node_id argument."""
        for pid in self.pids(name):
            try:
                args = psutil.Process(pid).cmdline()
            except psutil.NoSuchProcess:
                continue
            if args and args[0].endswith("/raylet"):
                return next(a.split("=", 1)[1] for a in args if a.startswith("--node_id="))
        raise RuntimeError(f"node {name} has no raylet")

    def kill(self, name: str) -> None:
        """A node lost: SIGKILL its whole session at once (raylet, agents, workers; no goodbye to the head)."""
        self._killpg(self.procs[name])
        for pid in self.pids(name):  # anything that left the process group (none expected)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Joined nodes first, then the head; kills only what this object started."""
        for name in sorted(self.procs, key=lambda n: n == "a"):
            self.kill(name)
            self.procs[name].wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _killpg(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
