"""memlm.trainer: everything between a run config and a trained, evaluated, tracked model. One subpackage a concern:

    config/      the run configuration: typed dataclasses, YAML presets (`tiny/txl`) with `inherit:`, overrides
    loop/        the training loop: `run` / `open_trainer`, `Trainer.train_step`, the memory recurrence across
                 segments, the learning-rate schedule, non-finite steps, SIGTERM, progress lines
    checkpoint/  what a run folder and a checkpoint hold: writing complete-or-absent, resuming (format version),
                 the RNG state, weights at any ZeRO stage, weights-only loading, conversion of old files, and the
                 one loader of a trained run or export folder (run_loader.py)
    inference/   a trained model at work: evaluation, generation, attention analysis
    runtime/     the process: threads, allocator, process group, library output, the tests' fault hooks
    tracking/    MLflow: the one client set-up, the run tracker, `memlm compare`, `memlm ui`

Imports inside go one way, down runtime, config <- checkpoint <- tracking <- inference <- loop; runtime uses nothing
else of memlm (docs/design.md §1; tests/trainer/test_import_direction.py).
"""
