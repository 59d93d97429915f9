"""`memlm ui` (docs/design.md §5, §9): a real MLflow server over the given store, listening on 127.0.0.1 only, stopped
with
everything it started on SIGINT (Ctrl-C) or SIGTERM; user mistakes are one line and exit 2.

One server start (~15-20 s on 2 cores) serves the whole slow test: the HTTP checks, the listening-address check,
a second `memlm ui` on the taken port (and on the wildcard address, which must warn first), then the stop.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from support.training import child_env

# One xdist worker runs the whole file (scripts/test.sh: --dist loadgroup), so the module fixture is built once.
pytestmark = pytest.mark.xdist_group("ui")
EXPERIMENT = "ui-check"  # made by hand: no saved view
TRACKED = "ui-tracked"  # made as training makes it: with memlm's saved view of the runs table


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A SQLite store holding two experiments, so the test can tell the server reads this store and no other."""
    from mlflow import MlflowClient

    from memlm.trainer.config.run_config import TrackingConfig
    from memlm.trainer.tracking.tracker import ensure_experiment

    root = tmp_path_factory.mktemp("ui")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).create_experiment(EXPERIMENT)
    ensure_experiment(TrackingConfig(experiment=TRACKED, uri=uri))
    return uri


def _memlm(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "memlm", *args], cwd=cwd, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _get(url: str) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as response:
        return response.status, response.read()


def _wait_until_serving(proc: subprocess.Popen, port: int, limit: float = 90.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"memlm ui exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"memlm ui did not answer on 127.0.0.1:{port} within {limit:.0f} s")


def _experiment_id(store: str, name: str) -> str:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=store).get_experiment_by_name(name).experiment_id


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    import psutil

    found = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        found.update((c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN)
    return found


@pytest.mark.slow
def test_ui_serves_the_store_on_loopback_and_stops_cleanly(store, tmp_path):
    import psutil

    from memlm.trainer.runtime.distributed import free_port

    port = free_port()
    ui = _memlm("ui", "--uri", store, "--port", str(port), cwd=tmp_path)
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(ui.stdout), daemon=True)
    reader.start()
    try:
        _wait_until_serving(ui, port)
        # The server reads the store we gave it: our experiment is there.
        status, body = _get(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name"
                            f"?experiment_name={EXPERIMENT}")
        assert status == 200 and json.loads(body)["experiment"]["name"] == EXPERIMENT
        assert _get(f"http://127.0.0.1:{port}/")[0] == 200  # the UI page itself
        # The UI reads an experiment's saved views from its tags, through this request.
        from memlm.trainer.tracking.tracker import RUNS_VIEW_COLUMNS, RUNS_VIEW_TAG

        tracked = json.loads(_get(f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/get-by-name"
                                  f"?experiment_name={TRACKED}")[1])["experiment"]
        view = json.loads({t["key"]: t["value"] for t in tracked["tags"]}[RUNS_VIEW_TAG])
        assert json.loads(view["state"])["selectedColumns"] == list(RUNS_VIEW_COLUMNS)

        family = [ui.pid] + [p.pid for p in psutil.Process(ui.pid).children(recursive=True)]
        assert len(family) >= 2, family  # memlm and the mlflow server (plus its worker)
        listening = _listening(family)
        assert listening and all(ip == "127.0.0.1" for ip, _ in listening), listening
        assert ("127.0.0.1", port) in listening

        # A second UI on the same port: one line, exit 2, before any server starts.
        second = _memlm("ui", "--uri", store, "--port", str(port), cwd=tmp_path)
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2 and err.strip() == (
            f"memlm: error: port {port} on 127.0.0.1 is already in use (another `memlm ui` or mlflow server?): "
            "stop it or pass --port N"), err
        # Binding every address is opt-in and warned about (the taken port stops it before it starts).
        wide = _memlm("ui", "--uri", store, "--host", "0.0.0.0", "--port", str(port), cwd=tmp_path)
        out, err = wide.communicate(timeout=60)
        lines = err.strip().splitlines()
        assert wide.returncode == 2 and len(lines) == 2, err
        assert lines[0].startswith("memlm: warning: binding the MLflow UI to 0.0.0.0") and "in use" in lines[1]

        deadline = time.monotonic() + 60  # the links follow the first line once the server answers
        while len(printed) < 3 and time.monotonic() < deadline and ui.poll() is None:
            time.sleep(0.2)
        ui.send_signal(signal.SIGINT)  # Ctrl-C
        ui.wait(timeout=40)
        reader.join(timeout=10)
        out, err = "".join(printed), ui.stderr.read()
        assert ui.returncode == 0, err[-3000:]
        assert f"MLflow UI at http://127.0.0.1:{port}" in out
        # Links to the runs tables: memlm's saved view where the experiment has it; the classic (not GenAI) mode
        ids = {name: _experiment_id(store, name) for name in (EXPERIMENT, TRACKED)}
        runs = f"http://127.0.0.1:{port}/#/experiments/{{}}/runs"
        classic = "workflowType=machine_learning"
        assert f"  {TRACKED}: {runs.format(ids[TRACKED])}?viewStateShareKey=memlm&{classic}\n" in out
        assert f"  {EXPERIMENT}: {runs.format(ids[EXPERIMENT])}?{classic}\n" in out
        # The console holds memlm's lines only: uvicorn's start-up and request lines are in the server's log,
        # requests not at all (the UI polls; a day-long session wrote thousands of lines).
        assert "INFO" not in out + err and '"GET /' not in out + err, out + err
        log = (Path(store[len("sqlite:///"):]).parent / "mlflow-ui.log").read_text()
        assert f"Uvicorn running on http://127.0.0.1:{port}" in log and '"GET /' not in log, log[-2000:]
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in family[1:] if psutil.pid_exists(p)], timeout=5)
        assert not alive, [p.pid for p in alive]  # no orphan server or worker
        with socket.socket() as sock:  # and the port is free again (REUSEADDR: our requests' TIME_WAIT is no listener)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
    finally:
        if ui.poll() is None:
            ui.kill()
            ui.wait()


def test_sigterm_while_starting_leaves_nothing(store, tmp_path):
    """SIGTERM (what `kill` or a job scheduler sends) as soon as the server process exists: memlm ui exits 0 and
    takes the server with it. No wait for the server to be ready, so this costs about a second."""
    import psutil

    from memlm.trainer.runtime.distributed import free_port

    ui = _memlm("ui", "--uri", store, "--port", str(free_port()), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(ui.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        server = psutil.Process(ui.pid).children()[0]
        assert "mlflow" in " ".join(server.cmdline())
        ui.send_signal(signal.SIGTERM)
        out, err = ui.communicate(timeout=40)
        assert ui.returncode == 0, err[-3000:]
        assert not psutil.pid_exists(server.pid) or server.status() == psutil.STATUS_ZOMBIE
    finally:
        if ui.poll() is None:
            ui.kill()
            ui.wait()


def test_sigterm_inside_the_server_start_still_stops_the_server(store, tmp_path, monkeypatch):
    """The narrowest window: SIGTERM after the fork but before Popen hands back the process. Raised there, the stop
    would leave a server nobody knows of; memlm ui must hold it until the process is known, then stop it."""
    import argparse
    import os

    import psutil

    from memlm.trainer.runtime.distributed import free_port
    from memlm.trainer.tracking import ui

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_then_signalled(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, before this call returns
        return proc

    monkeypatch.setattr(ui.subprocess, "Popen", popen_then_signalled)
    monkeypatch.chdir(tmp_path)
    rc = ui.main(argparse.Namespace(uri=store, host="127.0.0.1", port=free_port()))
    assert rc == 0 and len(started) == 1
    server = started[0]
    assert server.poll() is not None  # stopped and reaped by memlm ui
    assert not psutil.pid_exists(server.pid) or psutil.Process(server.pid).status() == psutil.STATUS_ZOMBIE


def test_stop_kills_a_group_member_that_ignores_sigterm():
    """The server's workers get SIGKILL when SIGTERM is not enough: here a grandchild that ignores it."""
    import psutil

    from memlm.trainer.tracking.ui import stop

    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {stubborn!r}], "
              "stdout=subprocess.PIPE); p.stdout.readline(); print(p.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
    grandchild = psutil.Process(int(proc.stdout.readline()))  # printed once its SIGTERM handler is in place
    started = time.monotonic()
    stop(proc, grace=1.0)
    assert proc.returncode == -signal.SIGTERM and time.monotonic() - started < 10
    assert not psutil.pid_exists(grandchild.pid) or grandchild.status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("uri, words", [
    ("http://127.0.0.1:5000", ["already a tracking server", "sqlite:///"]),
    ("sqlite:///{tmp}/nowhere/mlflow.db", ["no MLflow store at", "nowhere", "--uri"]),
])
def test_bad_store_is_one_line(tmp_path, capsys, uri, words):
    from memlm.cli import main

    assert main(["ui", "--uri", uri.format(tmp=tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("memlm: error:"), err
    assert all(w in err for w in words), err
    assert not (tmp_path / "nowhere").exists()


def test_default_store_is_the_working_folders(tmp_path, monkeypatch, capsys):
    """No --uri: $MLFLOW_TRACKING_URI, else ./mlflow.db, exactly as training resolves it."""
    from memlm.trainer.tracking.ui import backend_store, server_command

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "mlflow.db").write_bytes(b"")
    store = backend_store(None)
    assert store == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    cmd = server_command(store, "127.0.0.1", 5000)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--workers") + 1] == "1"
    assert cmd[cmd.index("--artifacts-destination") + 1] == (tmp_path / "mlartifacts").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert backend_store(None) == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_the_installed_ui_reads_saved_views_where_memlm_writes_them():
    """memlm's saved runs view is an experiment tag and a URL parameter that this MLflow's UI bundle reads: the
    tag prefix and the parameter name must still be in its JavaScript (an MLflow upgrade that drops saved views
    fails here rather than silently opening the default columns)."""
    import mlflow

    from memlm.trainer.tracking.tracker import RUNS_VIEW_TAG

    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    text = "".join(path.read_text(errors="replace") for path in bundle.glob("*.js"))
    prefix = RUNS_VIEW_TAG.rsplit(".", 1)[0] + "."
    assert f'"{prefix}"' in text and '"viewStateShareKey"' in text
    # The envelope's validation: a string name, a number createdAt, a string state.
    assert "Invalid saved-view envelope" in text


def test_the_links_select_the_installed_uis_classic_mode():
    """Issue 32: the UI opened in MLflow 3's GenAI mode. Its mode is the browser's own (localStorage
    "mlflow.workflowType", default "genai") unless the address carries `workflowType`; no server option or
    experiment tag sets it. This MLflow's bundle must still read that parameter and know the classic value, or the
    links lose their effect silently. The assistant's panel is the browser's own too: "mlflow.assistant.panelOpen",
    opened once by the UI itself on a local server's first load ("mlflow.assistant.fab.autoOpenedOnFirstLoad"),
    nothing a server or an experiment can choose; the README says so, and this notices a change."""
    import mlflow

    from memlm.trainer.tracking.tracker import UI_WORKFLOW, runs_link

    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    text = "".join(path.read_text(errors="replace") for path in bundle.glob("main.*.js"))
    key, value = UI_WORKFLOW
    assert f'.get("{key}")' in text and f'MACHINE_LEARNING="{value}"' in text
    assert 'key:"mlflow.workflowType"' in text and 'key:"mlflow.assistant.panelOpen"' in text
    assert 'key:"mlflow.assistant.fab.autoOpenedOnFirstLoad"' in text
    assert runs_link("http://127.0.0.1:5000", "3", saved_view=True) == (
        "http://127.0.0.1:5000/#/experiments/3/runs?viewStateShareKey=memlm&workflowType=machine_learning")
