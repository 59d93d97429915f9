import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Two xdist workers on two cores: one torch thread each, also in the runs they start in-process
# (trainer/runtime/process.py
# reads this) and in subprocesses (support.training.child_env), so in-process and subprocess runs compute alike
# whatever the caller's shell says; tests of the thread choice itself start their processes without it.
os.environ["OMP_NUM_THREADS"] = "1"


def pytest_configure(config):
    """A line of progress every minute while the suite runs (support/progress.py: xdist's dots say little)."""
    from support import progress

    progress.register(config)


@pytest.fixture(scope="session", autouse=True)
def _no_store_in_checkout():
    """Runs are tracked by default (the tiny presets included), in ./mlflow.db: a test that trains in the checkout
    must pass tracking.enabled=false (support.training.overrides does) or its own store, never leave one here."""
    stores = [ROOT / "mlflow.db", ROOT / "mlruns"]
    before = {path: path.exists() for path in stores}
    yield
    made = [str(path) for path in stores if path.exists() and not before[path]]
    assert not made, f"a test wrote an MLflow store into the checkout: {made}"


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray (127.0.0.1, 2 CPUs) for every Ray test of this pytest process.

    Ray tests carry @pytest.mark.xdist_group("ray") and scripts/test.sh runs pytest with --dist loadgroup, so they
    all land on one xdist worker and pay Ray's 5-13 s start once. Commands under test that start Ray themselves
    find it running and leave it running.
    """
    import ray

    from memlm.cluster.ray_runtime import start

    started = start(num_cpus=2)
    yield
    if started:
        ray.shutdown()
