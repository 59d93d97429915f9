"""Import DeepSpeed without the MLflow import it makes for a feature memlm never uses.

`import deepspeed` imports deepspeed.autotuning.autotuner, which tries `import mlflow` (to log autotuning
experiments) whether or not anything will track: 1.6 s of CPU on every start of a process that reads or trains a
DeepSpeed model (3.9 s -> 2.3 s of `import deepspeed` measured on this 2-core machine), most of it in MLflow's own
imports (pandas, its GenAI modules). memlm logs to MLflow through its own tracker, which imports MLflow when a run is
tracked; DeepSpeed's autotuner is not used. So DeepSpeed is imported with MLflow marked absent for that moment only
(the autotuner then records has_mlflow = False); a later `import mlflow` by memlm or the user finds the real one.
A process that already imported MLflow imports DeepSpeed as it is.
"""

from __future__ import annotations

import sys


def import_deepspeed():
    """deepspeed, imported once (sys.modules afterwards), without the autotuner's MLflow import."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    absent = "mlflow" not in sys.modules
    if absent:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError while DeepSpeed is imported
    try:
        import deepspeed
    finally:
        if absent and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed
