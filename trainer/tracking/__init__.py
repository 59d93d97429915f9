"""MLflow: the run tracker, experiments, the comparison table and plots, the UI."""
