"""The training loop: the DeepSpeed engine, one step, the memory carried between segments, the learning-rate schedule,
non-finite steps, SIGTERM and progress lines."""
