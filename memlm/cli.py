"""The `memlm` command line: parse, then dispatch (DESIGN §8).

Kept thin on purpose: each command imports its heavy modules (torch, deepspeed, ray, mlflow) inside its own
function, so `memlm --help` is instant and training never imports Ray. A user mistake (a bad config key or
value, a missing file) is one line `memlm: error: ...` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

USAGE_ERROR = 2  # argparse's own exit status for bad usage; config mistakes use the same


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except Exception as exc:  # noqa: BLE001 - only ConfigError is turned into a message; the rest re-raises
        if not _is_config_error(exc):
            raise
        print(f"memlm: error: {exc}", file=sys.stderr)
        return USAGE_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memlm", description="Train and evaluate segment-recurrent memory language models."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_config(commands)
    _add_demo(commands)
    return parser


def _add_config(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("config", help="print the resolved config (presets, inherit: and overrides) as YAML")
    p.add_argument("config", metavar="CONFIG.yaml")
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="e.g. model.mem_len=16 model.cutoffs=[20,40]")
    p.set_defaults(run=_run_config)


def _run_config(args: argparse.Namespace) -> int:
    from trainer.config import config_to_yaml, load_config

    sys.stdout.write(config_to_yaml(load_config(args.config, args.overrides)))
    return 0


def _add_demo(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("demo", help="train tiny memory LMs on a real corpus and print the results")
    p.add_argument("--seconds", type=float, default=60.0, help="time budget in seconds (default 60)")
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from trainer import demo

    return demo.main(args)


def _is_config_error(exc: BaseException) -> bool:
    # Looked up rather than imported: importing models.config pulls in torch, and a ConfigError can only have
    # been raised if that module is already loaded.
    config = sys.modules.get("models.config")
    return config is not None and isinstance(exc, config.ConfigError)
