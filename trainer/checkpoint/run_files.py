"""Names of files in a run folder that more than one layer reads, kept in the lowest one (docs/design.md §1): the
run folder's rules (run_folder.py) and the MLflow tracker (trainer/tracking/) both read these."""

RUN_ID_FILE = "mlflow_run_id"  # the run's MLflow run id: a resumed run and `memlm eval` log to that run
