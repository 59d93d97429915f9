"""The Ray flags (cluster/ray_flags.py): one declaration for every command that runs on Ray, and one check that
refuses a value no run could use, in one line, before any run folder is read or Ray starts. Seconds: no Ray."""

from __future__ import annotations

import argparse

import pytest

from memlm.cli import build_parser, main
from memlm.cluster.errors import ClusterError
from memlm.cluster.ray_flags import check_ray_flags

RAY_COMMANDS = {"sweep": ["SWEEP"], "extrapolate": ["RUN"], "longeval": ["RUN"]}
WHERE = ["--address", "--num-cpus"]
MLFLOW = ["--experiment", "--uri"]
TASKS = ["--cpus-per-task", "--gpus-per-task", "--lanes", "--max-retries"]


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_ray_command_has_the_same_flags_under_one_heading():
    parsers = command_parsers()
    expected = {"sweep": WHERE, "extrapolate": WHERE + MLFLOW + TASKS, "longeval": WHERE + MLFLOW + TASKS}
    for command, flags in expected.items():
        group = next(g for g in parsers[command]._action_groups if g.title.startswith("Ray"))
        assert [a.option_strings[0] for a in group._group_actions] == flags, command
    # One declaration: the flags' help is the same in every command (the lanes' meaning aside)
    same = [flag for flag in WHERE + MLFLOW + TASKS if flag not in ("--lanes", "--experiment")]
    helps = [{flag: a.help for flag, a in parsers[c]._option_string_actions.items() if flag in same}
             for c in RAY_COMMANDS]
    assert helps[1] == helps[2] and {k: helps[1][k] for k in WHERE} == helps[0]
    assert "--address" not in parsers["train"]._option_string_actions  # training never touches Ray


@pytest.mark.parametrize("command", RAY_COMMANDS)
@pytest.mark.parametrize("flags, message", [
    (["--num-cpus", "0"], "--num-cpus must be >= 1, got 0"),
    (["--address", "10.0.0.1:6379", "--num-cpus", "2"],
     "--num-cpus sizes a local Ray; an existing cluster (--address) has its own CPUs: give one of the two"),
])
def test_where_ray_runs_is_checked_alike_in_every_command(command, flags, message):
    args = build_parser().parse_args([command, *RAY_COMMANDS[command], *flags])
    with pytest.raises(ClusterError) as refused:
        check_ray_flags(args)
    assert str(refused.value) == message


@pytest.mark.parametrize("command", ["extrapolate", "longeval"])
@pytest.mark.parametrize("flags, message", [
    (["--cpus-per-task", "0"], "--cpus-per-task must be > 0, got 0"),
    (["--gpus-per-task", "-1"], "--gpus-per-task must be >= 0, got -1"),
    (["--max-retries", "-1"], "--max-retries must be >= 0, got -1"),
    (["--lanes", "0"], "--lanes must be >= 1, got 0"),
])
def test_a_bad_task_flag_is_one_line_before_any_run_is_read(command, flags, message, tmp_path, capsys):
    """The run folder does not exist: the flag is refused first, and the command line prints it as one line."""
    assert main([command, str(tmp_path / "no-run"), *flags]) == 2
    assert capsys.readouterr().err == f"memlm: error: {message}\n"
