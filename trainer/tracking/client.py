"""Every MLflow client memlm opens comes from `open_client`: one place for the environment MLflow reads and for
how a SQLite store comes into being.

Environment (set before MLflow reads it, unless the user set it): no telemetry (our tests and clusters have no
outside network), and a dead tracking server fails in seconds instead of MLflow's 7 retries with backoff and a
120 s timeout, which would stall a training's first step for minutes.

Writers (training, sweeps, extrapolation: `create=True`) create a missing SQLite store, under an exclusive lock on
`.NAME.lock` beside it: two processes creating a fresh store at the same moment (the demo's parallel trainings,
two `memlm train` started together) otherwise both run the migrations and leave it broken ("table
_alembic_tmp_experiments already exists"). Readers (compare, ui, logging an evaluation into an existing run:
`create=False`) refuse a SQLite file that does not exist: opening it would create an empty store as a side effect,
and the user almost surely ran from another folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import TrackingError

ENV_DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


def set_environment(extra: dict[str, str] | None = None) -> None:
    """memlm's MLflow environment defaults (and `extra`), where the user has not set them."""
    for key, value in {**ENV_DEFAULTS, **(extra or {})}.items():
        os.environ.setdefault(key, value)


def sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def open_client(uri: str, *, create: bool = True) -> Any:
    """An MlflowClient for `uri` whose store exists (and, for SQLite, is migrated); see the module docstring."""
    set_environment()
    from mlflow import MlflowClient

    db = sqlite_path(uri)
    if db is None:
        return MlflowClient(tracking_uri=uri)
    if not create:
        if not db.is_file():
            raise TrackingError(f"no MLflow store at {db}: run from the folder you trained in, or pass "
                                "--uri sqlite:///PATH/mlflow.db (or a server's http://HOST:PORT)")
        return MlflowClient(tracking_uri=uri)
    import fcntl

    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(f".{db.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            client = MlflowClient(tracking_uri=uri)
            client._tracking_client.store  # noqa: B018 - creating the store creates and migrates the tables
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return client
