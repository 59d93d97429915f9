"""DeepSpeed is imported without its autotuner's MLflow import (trainer/runtime/lean_import.py): a process that
does not track never imports MLflow, and one that does finds the real MLflow afterwards. In fresh processes: this
test session has imported both long ago."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import json, sys
from memlm.trainer.runtime.lean_import import import_deepspeed
if sys.argv[1] == "mlflow-first":
    import mlflow
deepspeed = import_deepspeed()
from deepspeed.autotuning import autotuner
after = "mlflow" in sys.modules
import mlflow
print(json.dumps({"mlflow_after_deepspeed": after, "autotuner_has_mlflow": autotuner.has_mlflow,
                  "same": import_deepspeed() is deepspeed, "mlflow_real": hasattr(mlflow, "start_run")}))
"""


def child(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_deepspeed_alone_leaves_mlflow_unimported_and_importable():
    assert child("deepspeed-first") == {"mlflow_after_deepspeed": False, "autotuner_has_mlflow": False,
                                        "same": True, "mlflow_real": True}


def test_a_process_that_imported_mlflow_imports_deepspeed_as_it_is():
    assert child("mlflow-first") == {"mlflow_after_deepspeed": True, "autotuner_has_mlflow": True, "same": True,
                                     "mlflow_real": True}
