"""`memlm ui [--uri URI] [--host 127.0.0.1] [--port 5000]`: the MLflow UI over the store training writes to.

The UI is `mlflow server` as a child process (its own session, so the whole process group can be stopped):
- store: --uri, else $MLFLOW_TRACKING_URI, else ./mlflow.db, resolved exactly as training resolves it;
- bound to 127.0.0.1 unless --host says otherwise (a warning line when the address is not loopback: the UI has no
  login, anyone who can reach the port can read and delete runs);
- `--workers 1` and MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: one viewer needs no worker pool or job runner, and
  the server then starts in ~13 s instead of ~20 s and 1.5 GB (docs/design.md §9); telemetry off;
- for a SQLite store, artifacts are served from the `mlartifacts` folder beside the database, where
  trainer.tracking.tracker.ensure_experiment puts every experiment's artifacts.
Once it answers, each experiment's runs table is printed as a link (experiments memlm creates carry the
`mlflow.experimentKind` tag that makes the UI open them on their runs, not on the GenAI Traces tab, and memlm's saved
view of the runs table, trainer.tracking.tracker.RUNS_VIEW_TAG, which the link opens: validation and test perplexity,
loss,
tokens, arch and tokenizer instead of the default Source / Models / Dataset columns). The server's own output (its
start-up lines, warnings, errors; no access log) goes to UI_LOG beside the SQLite store (or in the working folder for
another database), so the console holds memlm's lines only; a server that fails to start is reported with that
file's last line.
Ctrl-C or SIGTERM stops the server and everything it started (SIGTERM to its process group, SIGKILL after a grace
period), so no orphan server keeps the port.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from memlm.trainer.config.run_config import TrackingConfig
from memlm.trainer.runtime import heartbeat

from .client import open_client
from .errors import TrackingError
from .tracker import RUNS_VIEW_TAG, runs_link

READY_TIMEOUT_S = 120.0  # a cold start on a loaded 2-core machine takes ~15-30 s
UI_LOG = "mlflow-ui.log"
# uvicorn logs every request by default: the UI polls the runs table, so a day-long session wrote thousands of lines.
UVICORN_OPTS = "--no-access-log"
STOP_GRACE_S = 10.0
SERVER_ENV = {
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
}


class _Stop(BaseException):
    """Raised in the main thread by our SIGINT/SIGTERM handler. A BaseException, like KeyboardInterrupt: no
    `except Exception` on the way (say, around the experiment links) may swallow a stop request. A library that
    catches BaseException and raises something else in its place (database drivers do) could still turn it into
    an Exception, so the handler also records the request (_stop_requested) and main checks it after such calls."""


_stop_requested = False
_holding_stop = False  # while the server process is being started: a stop request waits until `proc` exists


def main(args: argparse.Namespace) -> int:
    store = backend_store(args.uri)
    host, port = args.host, args.port
    if not 0 < port < 65536:
        raise TrackingError(f"--port {port} is not a TCP port (1-65535)")
    if not is_loopback(host):
        print(f"memlm: warning: binding the MLflow UI to {host}: anyone who can reach this machine on port {port} "
              "can read and change every run (it has no login); the default --host 127.0.0.1 keeps it local",
              file=sys.stderr)
    check_port_free(host, port)
    url = f"http://{_url_host(host)}:{port}"
    log_path = server_log(store)
    try:
        log = open(log_path, "a", encoding="utf-8")
    except OSError as exc:
        raise TrackingError(f"cannot write the server's log {log_path} ({exc.strerror}): run from a folder you "
                           "can write to") from None
    # Handlers first: a Ctrl-C at any moment after the server exists must still reach the clean-up below.
    global _stop_requested, _holding_stop
    _stop_requested = False
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    proc = None
    try:
        with log:
            log.write(f"=== memlm ui: mlflow server on {host}:{port} over {store}, {time.strftime('%Y-%m-%d %H:%M')}\n")
            log.flush()
            # Its own session: a terminal's Ctrl-C reaches only us, and we stop the server's whole group ourselves.
            # A stop request inside Popen is held until it returns: raised there (after the fork, before Popen
            # hands back the process), it would leave a server nobody stops.
            _holding_stop = True
            try:
                proc = subprocess.Popen(server_command(store, host, port), env={**os.environ, **SERVER_ENV},
                                        start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
            finally:
                _holding_stop = False
            if _stop_requested:
                raise _Stop()
        links = experiment_links(store, url)  # read from the store while the server starts (seconds under load)
        if _stop_requested:  # a Ctrl-C inside the store's code, which may have raised something else in its place
            raise _Stop()
        wait_until_ready(proc, url, log_path)
        heartbeat.phase(None)  # the command's own lines from here (memlm/start_watch.py)
        print(f"MLflow UI at {url} (store {store}; server log {log_path}); Ctrl-C stops it", flush=True)
        for line in links:
            print(line, flush=True)
        rc = proc.wait()
        raise TrackingError(f"the MLflow server exited on its own with status {rc}: {last_line(log_path)} "
                           f"(whole log: {log_path})")
    except _Stop:
        return 0
    finally:
        for sig in previous:  # a second Ctrl-C must not interrupt the clean-up below (bounded: ~15 s at most)
            signal.signal(sig, signal.SIG_IGN)
        if proc is not None:
            stop(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def backend_store(uri: str | None) -> str:
    """The database URI the UI reads; a missing SQLite file or a server address is a one-line error."""
    store = TrackingConfig(uri=uri or "").resolved_uri()
    if store.startswith(("http://", "https://")):
        raise TrackingError(f"{store} is already a tracking server: open it in a browser; `memlm ui` needs a "
                           "database store (--uri sqlite:///PATH/mlflow.db or a postgresql://... URI)")
    if store.startswith("sqlite:///"):
        path = Path(store[len("sqlite:///"):])
        if not path.is_file():
            # mlflow server would create an empty store here: almost surely the wrong folder.
            raise TrackingError(f"no MLflow store at {path}: run from the folder you trained in, or pass "
                               "--uri sqlite:///PATH/mlflow.db")
    return store


def server_log(store: str) -> Path:
    """Where the server's output goes: beside a SQLite store (with its database and artifacts), else here."""
    folder = Path(store[len("sqlite:///"):]).parent if store.startswith("sqlite:///") else Path.cwd()
    return folder / UI_LOG


def last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(no output)"


def server_command(store: str, host: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--host", host,
           "--port", str(port), "--workers", "1", "--uvicorn-opts", UVICORN_OPTS]
    if store.startswith("sqlite:///"):
        cmd += ["--artifacts-destination", (Path(store[len("sqlite:///"):]).parent / "mlartifacts").as_uri()]
    return cmd


def experiment_links(store: str, url: str, limit: int = 20) -> list[str]:
    """One line per experiment of the store: its name and the address of its runs table, newest first.

    The UI's home page lists experiments, and an experiment without the `mlflow.experimentKind` tag (one made by
    an older memlm or by hand) opens on the GenAI Traces tab; these links open the training runs directly, in
    memlm's saved view where the experiment has it, in the UI's classic machine-learning mode (tracker.UI_WORKFLOW)."""
    try:
        experiments = open_client(store, create=False).search_experiments(max_results=limit + 1,
                                                                        order_by=["last_update_time DESC"])
    except Exception:  # noqa: BLE001 - the links are a convenience; the UI itself is up
        return []
    lines = [f"  {e.name}: {runs_link(url, e.experiment_id, RUNS_VIEW_TAG in e.tags)}"
             for e in experiments[:limit] if not (e.name == "Default" and e.experiment_id == "0")]
    if len(experiments) > limit:
        lines.append(f"  ... and more: {url}")
    return lines


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: we cannot know what it resolves to everywhere, so treat it as remote
        return False


def check_port_free(host: str, port: int) -> None:
    """Bind the address once ourselves: a clear line now instead of a server traceback later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise TrackingError(f"port {port} on {host} is already in use (another `memlm ui` or mlflow "
                                   f"server?): stop it or pass --port N") from None
            raise TrackingError(f"cannot bind {host}:{port} ({exc.strerror}): pass another --host or --port") from None


def wait_until_ready(proc: subprocess.Popen, url: str, log_path: Path,
                     timeout: float = READY_TIMEOUT_S) -> None:
    """Poll URL/health until the server answers; TrackingError (with the log's last line) if it exits first or
    never answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never ask a proxy for our own port
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            raise TrackingError(f"the MLflow server exited with status {rc} before it answered on {url}: "
                               f"{last_line(log_path)} (whole log: {log_path})")
        try:
            with opener.open(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TrackingError(f"the MLflow server did not answer on {url} within {timeout:.0f} s (its log: {log_path})")


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to the server's whole process group (it forks workers), SIGKILL to what is left after `grace`
    seconds; returns once the server and every process of its group are gone."""
    for sig, grace in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            break
        deadline = time.monotonic() + grace
        # poll() first: it reaps the leader, whose zombie would otherwise keep the group "alive".
        while (proc.poll() is None or _group_alive(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is not None and not _group_alive(proc.pid):
            break


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member exists but changed user: still alive
        return True
    return True


def _raise_stop(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    global _stop_requested
    _stop_requested = True
    if not _holding_stop:
        raise _Stop()


def _url_host(host: str) -> str:
    """The address a browser on this machine uses for a bind address."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
