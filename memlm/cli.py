"""The `memlm` command line: parse, then dispatch (docs/design.md §8).

Kept thin on purpose: each command imports its heavy modules (torch, deepspeed, ray, mlflow) inside its own
function, so `memlm --help` is instant and training never imports Ray. A user mistake (a bad config key or
value, a missing file) is one line `memlm: error: ...` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from memlm.cluster.ray_flags import add_ray_flags  # imports neither ray nor torch
from memlm.data_pipeline import progress
from memlm.errors import MemlmError
from memlm.models.config import ConfigError  # without torch (models/__init__.py)
from memlm.start_watch import watched
from memlm.trainer.config import presets
from memlm.trainer.inference import uniform_guess
from memlm.trainer.loop.preemption import Preempted  # the standard library only
from memlm.trainer.runtime import heartbeat
from memlm.trainer.runtime.distributed import shutdown  # torch only when a process group ends
from memlm.trainer.runtime.process import before_torch

USAGE_ERROR = 2  # argparse's own exit status for bad usage; config mistakes use the same
# data_pipeline/tasks.py's TASKS, spelled out so that `memlm --help` loads no numpy (tests/cli checks they agree)
TASK_NAMES = ["copy", "reverse", "retrieval", "quadratic", "qa1", "qa2", "qa3", "passkey"]
CONFIG_HELP = "a YAML file, or a preset's name such as tiny/txl or paper/wt103/lamemo (`memlm config --list`)"


def main(argv: Sequence[str] | None = None) -> int:
    before_torch()  # process-wide settings that torch and its OpenMP read once, at import
    parser = build_parser()
    args = parse(parser, argv)
    interrupt = Interrupt()
    try:
        with interrupt.watched(), watched(args.command):  # a line within 10 s, however slow the start (issue 32)
            return int(args.run(args) or 0)
    except KeyboardInterrupt as exc:
        return interrupt.report(args.command, str(exc))
    except Preempted as exc:  # a stop after saving (SIGTERM), not an error: the rank-0 status line, exit 143
        interrupt.say(str(exc), args.command)
        return exc.exit_status
    except Exception as exc:  # noqa: BLE001 - only memlm's own errors become a message; the rest re-raises
        if interrupt.seen:  # a rank whose peer stopped for the Ctrl-C: a broken collective, not a new error
            return interrupt.report(args.command)
        if not isinstance(exc, MemlmError):
            raise
        if not exc.quiet:  # quiet: another rank or node failed, and one surviving rank says so (PeerFailure)
            print(f"memlm: error: {exc}", file=sys.stderr)
        return exc.exit_status


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """argparse, except that `dotted.key=value` overrides may also come after an option (`--out X data.path=Y`),
    as users type them; anything else left over is one usage line."""
    args, extra = parser.parse_known_args(argv)
    overrides = [word for word in extra if "=" in word and not word.startswith("-")]
    if overrides and isinstance(getattr(args, "overrides", None), list):
        args.overrides += overrides
        extra = [word for word in extra if word not in overrides]
    if extra:
        parser.exit(USAGE_ERROR, f"memlm: error: {args.command}: unrecognized arguments: {' '.join(extra)} "
                                 f"(see `memlm {args.command} --help`)\n")
    return args


class Interrupt:
    """Ctrl-C as one line and exit 130 in every process of a command (each rank of a launcher gets the SIGINT).

    Only rank 0 speaks. A rank blocked in a collective when its peer left sees an error from the broken
    connection instead of KeyboardInterrupt: once a SIGINT has arrived, that too is reported as the interrupt."""

    EXIT = 130  # what a shell reports for Ctrl-C

    def __init__(self) -> None:
        self.seen = False

    @contextlib.contextmanager
    def watched(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_sigint(signum, frame):
            self.seen = True
            signal.default_int_handler(signum, frame)

        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def report(self, command: str, detail: str = "") -> int:
        hint = {"train": "; `memlm train ... --resume` continues from the last checkpoint",
                "sweep": "; run the same command again to resume the sweep"}.get(command, "")
        self.say(f"interrupted (Ctrl-C) {detail}" if detail else f"interrupted (Ctrl-C){hint}", command)
        return self.EXIT

    @staticmethod
    def say(message: str, command: str) -> None:
        if os.environ.get("RANK", "0") == "0":
            print(f"memlm {command}: {message}", file=sys.stderr, flush=True)


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage mistakes as one line, like every other memlm error (its sub-commands inherit it)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        command = self.prog.removeprefix("memlm").strip()
        where = f"{command}: " if command else ""
        self.exit(USAGE_ERROR, f"memlm: error: {where}{message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="memlm", description="Train and evaluate segment-recurrent memory language models."
    )
    # The deepspeed launcher puts --local_rank=N before the command; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_config(commands)
    _add_demo(commands)
    _add_prepare(commands)
    _add_train(commands)
    _add_eval(commands)
    _add_generate(commands)
    _add_export(commands)
    _add_analyze(commands)
    _add_extrapolate(commands)
    _add_longeval(commands)
    _add_curriculum(commands)
    _add_sweep(commands)
    _add_compare(commands)
    _add_ui(commands)
    _add_track(commands)
    return parser


def _add_config(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("config", help="print the resolved config (presets, inherit: and overrides) as YAML, "
                            "or list the presets (--list)")
    p.add_argument("config", nargs="?", metavar="CONFIG", help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value",
                   help="e.g. model.mem_len=16 model.cutoffs=[20,40]")
    p.add_argument("--list", action="store_true", help="print every preset's name and first comment line")
    p.set_defaults(run=_run_config)


def _run_config(args: argparse.Namespace) -> int:
    if args.list:
        if args.config or args.overrides:
            given = " ".join(filter(None, [args.config, *args.overrides]))
            raise ConfigError(f"config --list takes no CONFIG or overrides, got {given}")
        sys.stdout.write(presets.listing())
        return 0
    if not args.config:
        raise ConfigError("config needs a CONFIG (a YAML file, or a preset's name such as tiny/txl), or --list "
                          "to see the presets")
    from memlm.trainer.config.run_config import config_to_yaml, load_config  # keeps --help YAML-free

    sys.stdout.write(config_to_yaml(load_config(args.config, args.overrides)))
    return 0


def _add_demo(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("demo", help="train tiny memory LMs on a real corpus and print the results")
    p.add_argument("--steps", type=int, metavar="N",
                   help="training steps, the same for every architecture (default 3000: where memory pays off)")
    p.add_argument("--lr", type=float, metavar="LR", help="peak learning rate (default 1e-3)")
    p.add_argument("--wikitext", metavar="PATH",
                   help="a WikiText folder (wiki.{train,valid,test}.tokens) instead of the stdlib corpus "
                        "(also $MEMLM_DEMO_WIKITEXT)")
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from memlm import demo  # keeps --help YAML-free

    heartbeat.phase("preparing the demo's corpus")

    return demo.main(args)


def _add_prepare(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("prepare", help="tokenize a corpus (or generate an algorithmic task) into a DATA_DIR "
                            "of webdataset shards with manifest.json")
    p.add_argument("--corpus", required=True,
                   choices=["wikitext", "enwik8", "text8", "textdir", "jsonl", "task", "babilong"])
    p.add_argument("--input", metavar="PATH", help="the corpus folder or file (not needed for --corpus task; "
                   "babilong: a downloaded BABILong folder, e.g. of RMT-team/babilong-train-5k-samples)")
    p.add_argument("--out", required=True, metavar="DATA_DIR",
                   help="the folder to write (serve it over HTTP with any static web server), or s3://BUCKET/PREFIX "
                        "(prepared in a temporary folder, then uploaded, manifest.json last; a rerun resumes)")
    p.add_argument("--tokenizer", choices=["word", "bytes", "spm-unigram", "spm-bpe"],
                   help="trained on the train split (default: bytes for enwik8/text8/task, else word)")
    p.add_argument("--tokenizer-from", metavar="DIR",
                   help="reuse a trained tokenizer folder (e.g. DATA_DIR/tokenizer), or a Hugging Face model folder's "
                        "own tokenizer.json (a backbone's: lengths count its tokens)")
    p.add_argument("--vocab-size", type=int, metavar="N", help="needed for spm-*; caps the word vocabulary")
    p.add_argument("--task", choices=TASK_NAMES + [f"qa{i}" for i in range(4, 21)], metavar="TASK",
                   help="an RMT task (copy, reverse, retrieval, quadratic), or a long-context one: qa1/qa2/qa3 "
                        "(BABILong-style, give --task-option background=WIKITEXT_DIR) or passkey; --corpus babilong: "
                        "BABILong's qa1..qa20")
    p.add_argument("--babilong-length", metavar="L", help="--corpus babilong: the length to read (0k, 1k, 2k, ...)")
    p.add_argument("--task-docs", metavar="N|TRAIN,VALID,TEST",
                   help="samples per split (N: train N, valid and test N/10; default 10000; --corpus babilong: "
                        "the file's records in order, default all with 1/20 each to valid and test)")
    p.add_argument("--task-length", type=int, metavar="L",
                   help="copy/reverse: symbols per sample (default 24); retrieval: key-value pairs (default 4); "
                        "qa1-3, passkey: the sample's bytes, or tokens with --tokenizer-from a backbone (default 1000)")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other task option, repeatable (e.g. alphabet=0123456789, predict_first=false, query=)")
    p.add_argument("--seed", type=int, default=0, help="task generation seed (default 0)")
    p.add_argument("--split-pages", action="store_true", help="enwik8: one document per <page> instead of per split")
    p.add_argument("--shard-tokens", type=int, default=50_000_000, metavar="T", help="tokens per shard (default 50M)")
    p.add_argument("--workers", type=int, default=2, help="tokenizer processes (default 2; 1 = no pool)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DATA_DIR")
    p.set_defaults(run=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from memlm.data_pipeline.prepare import prepare  # keeps --help numpy-free

    progress.phase_listener = heartbeat.phase  # prepare names its slow steps; its progress meters end them
    if args.corpus == "babilong" or args.babilong_length is not None:
        return _run_prepare_babilong(args)

    task_options = None
    if args.corpus == "task":
        task_options = {"docs": args.task_docs, "length": args.task_length, "seed": args.seed}
        for item in args.task_option:
            key, eq, value = item.partition("=")
            if not eq or key in task_options:
                from memlm.data_pipeline.format import DataError  # keeps --help numpy-free

                raise DataError(f"--task-option {item!r}: give KEY=VALUE for an option other than docs, length "
                                "and seed (they have their own flags)")
            task_options[key] = value
    manifest = _prepared_at(args, lambda out, overwrite: prepare(
        args.corpus, args.input, out, tokenizer=args.tokenizer, vocab_size=args.vocab_size, task=args.task,
        task_options=task_options, shard_tokens=args.shard_tokens, split_pages=args.split_pages,
        workers=args.workers, overwrite=overwrite, tokenizer_from=args.tokenizer_from))
    heartbeat.phase(None)
    tok = manifest["tokenizer"]
    source = f" from {tok['source']}" if "source" in tok else ""  # a backbone's tokenizer.json
    print(f"{args.out}: tokenizer {tok['kind']}{source} (vocab {tok['vocab_size']})")
    for split, entry in manifest["splits"].items():
        print(f"  {split}: {entry['documents']:,} documents, {entry['tokens']:,} tokens, "
              f"{len(entry['shards'])} shard(s)")
    return 0


def _prepared_at(args: argparse.Namespace, build) -> dict:
    """build(out, overwrite) into --out; for an s3:// --out into a local staging folder, then uploaded there
    (data_pipeline/remote/upload.py: manifest.json last, files already uploaded whole skipped)."""
    from memlm.data_pipeline.remote.location import is_remote  # keeps --help numpy-free

    if not is_remote(args.out):
        return build(args.out, args.overwrite)
    import tempfile

    from memlm.data_pipeline.remote import upload  # only for an --out at a URL: `memlm --help` stays numpy-free

    folder = upload.check_destination(args.out)  # no credentials, no bucket: refused before prepare
    with tempfile.TemporaryDirectory(prefix="memlm-prepare-") as staging:
        manifest = build(Path(staging) / "data", False)
        heartbeat.phase(f"uploading to {folder.where.display()}")
        done = upload.upload(Path(staging) / "data", folder, args.overwrite)
    skipped = f", {done.skipped} already there whole (skipped)" if done.skipped else ""
    print(f"uploaded {done.sent} file(s), {done.nbytes / 1e6:.1f} MB, to {folder.where.display()}{skipped}; "
          "manifest.json last")
    return manifest


def _run_prepare_babilong(args: argparse.Namespace) -> int:
    from memlm.data_pipeline.babilong_prepare import prepare_babilong  # keeps --help numpy-free
    from memlm.data_pipeline.format import DataError  # keeps --help numpy-free

    if args.corpus != "babilong":
        raise DataError(f"--babilong-length applies to --corpus babilong, not to {args.corpus}")
    flags = (("--tokenizer", args.tokenizer), ("--tokenizer-from", args.tokenizer_from), ("--vocab-size",
             args.vocab_size), ("--task-length", args.task_length), ("--task-option", args.task_option),
             ("--split-pages", args.split_pages))
    given = [flag for flag, value in flags if value]
    if given:
        raise DataError(f"--corpus babilong reads BABILong's records onto the bytes tokenizer: drop {', '.join(given)}")
    missing = [flag for flag, value in (("--input DIR", args.input), ("--task qaN", args.task),
                                        ("--babilong-length L", args.babilong_length)) if value is None]
    if missing:
        raise DataError(f"--corpus babilong needs {', '.join(missing)}: it reads one task (--task) at one length "
                        "(--babilong-length) of a downloaded BABILong folder (--input)")
    manifest = _prepared_at(args, lambda out, overwrite: prepare_babilong(
        args.input, args.task, args.babilong_length, out, docs=args.task_docs, overwrite=overwrite,
        shard_tokens=args.shard_tokens))
    print(f"{args.out}: BABILong {args.task} at {args.babilong_length} from {args.input}, tokenizer bytes (vocab 256)")
    for split, entry in manifest["splits"].items():
        print(f"  {split}: {entry['documents']:,} documents, {entry['tokens']:,} tokens, "
              f"{len(entry['shards'])} shard(s)")
    return 0


def _add_train(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train",
                            help="train a model with DeepSpeed (plain process, torchrun or deepspeed launcher)")
    p.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="e.g. train.steps=100 data.path=DATA_DIR")
    p.add_argument("--out", metavar="RUN_DIR", help="run folder (default runs/ARCH)")
    p.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoints/latest")
    p.add_argument("--overwrite", action="store_true",
                   help="delete what RUN_DIR holds (checkpoints, metrics, evaluations) and train from step 0")
    p.add_argument("--reshard", action="store_true",
                   help="with --resume at another world size: load only the weights (optimizer and data restart)")
    p.add_argument("--stop-at", type=int, metavar="STEP",
                   help="leave after STEP with a checkpoint (the schedule still spans train.steps; --resume goes on)")
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from memlm.trainer.config import data_vocab  # keeps --help numpy-free

    cfg, note = data_vocab.load_fitted(args.config, args.overrides)
    if note and os.environ.get("RANK", "0") == "0":
        print(f"memlm train: {note}", file=sys.stderr, flush=True)
    from memlm.trainer.loop.train import run  # keeps --help torch-free

    run(cfg, args.out, resume=args.resume or args.reshard, reshard=args.reshard, stop_at=args.stop_at,
        overwrite=args.overwrite)
    shutdown()  # only after a finished run: a failing rank must not wait in a collective teardown
    return 0


def _add_curriculum(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("curriculum", help="train stage by stage on long-context samples spanning more and more "
                            "segments, each stage from the previous one's weights (the BABILong / ARMT recipe)")
    p.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="applied to every stage")
    p.add_argument("--task", required=True, choices=["qa1", "qa2", "qa3", "passkey"])
    p.add_argument("--background", metavar="WIKITEXT_DIR", help="the QA tasks' background text folder")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a task option for every stage, repeatable (e.g. facts=2, digits=5); length comes from "
                        "--segments and model.tgt_len")
    p.add_argument("--segments", default="1,2,4,8", metavar="S,S,...",
                   help="segments of model.tgt_len bytes per sample at each stage, increasing (default 1,2,4,8: "
                        "the first holds fact and question in one segment); tokens of the backbone's tokenizer when "
                        "model.backbone names a folder with a tokenizer.json")
    p.add_argument("--steps", default="3000", metavar="N|N,N,...",
                   help="the cap on a stage's optimizer steps, for every stage or one per stage (default 3000)")
    p.add_argument("--check-every", type=int, default=250, metavar="K",
                   help="steps between held-out checks (default 250, or a stage's cap if fewer; must divide the caps)")
    p.add_argument("--check-samples", type=int, default=200, metavar="N",
                   help="held-out samples per check, from the stage's valid split (default 200)")
    p.add_argument("--target", type=float, default=0.99,
                   help="held-out exact-match accuracy that ends a stage as learned (default 0.99)")
    p.add_argument("--patience", type=int, default=4,
                   help="checks in a row without a gain that end a stage as plateaued (default 4)")
    p.add_argument("--min-steps", default="1000", metavar="N|N,N,...",
                   help="no plateau stop before this step, for every stage or one per stage (default 1000; a stage's "
                        "cap: never a plateau there, as for a first stage that every model must learn)")
    p.add_argument("--min-gain", type=float, default=0.02,
                   help="a gain: accuracy up by this much or answer loss down by this fraction (default 0.02)")
    p.add_argument("--fixed-steps", action="store_true",
                   help="every stage trains exactly --steps (the checks are still recorded)")
    p.add_argument("--docs", default="5000", metavar="N|TRAIN,VALID,TEST", help="samples per stage's corpus")
    p.add_argument("--seed", type=int, default=0, help="sample generation seed (default 0)")
    p.add_argument("--out", required=True, metavar="DIR", help="stages' data and run folders")
    p.set_defaults(run=_run_curriculum)


def _run_curriculum(args: argparse.Namespace) -> int:
    from memlm.trainer.loop.curriculum import parse_segments, per_stage, run_curriculum  # keeps --help torch-free
    from memlm.trainer.loop.curriculum_stop import StopRule  # keeps --help torch-free

    options = {"background": args.background} if args.background else {}
    for item in args.task_option:
        key, eq, value = item.partition("=")
        if not eq or key in ("length", "docs", "seed", "background"):
            raise ConfigError(f"--task-option {item!r}: give KEY=VALUE for an option other than length (--segments "
                              "and model.tgt_len), docs (--docs), seed (--seed) and background (--background)")
        options[key] = value
    segments = parse_segments(args.segments)
    caps, firsts = (per_stage(flag, text, len(segments)) for flag, text in (("--steps", args.steps),
                                                                             ("--min-steps", args.min_steps)))
    rules = [StopRule(steps=cap, check_every=min(args.check_every, cap) if cap >= 1 else args.check_every,
                      samples=args.check_samples, target=args.target, patience=args.patience, min_steps=first,
                      min_gain=args.min_gain, fixed=args.fixed_steps)
             for cap, first in zip(caps, firsts)]  # a cap below --check-every: checked at the cap
    runs = run_curriculum(args.config, args.overrides, out=Path(args.out), task=args.task, task_options=options,
                          segments=segments, rules=rules, docs=args.docs, seed=args.seed)
    print(f"curriculum: {len(runs)} stage(s) trained; the last one: {runs[-1]}")
    return 0


def _add_eval(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("eval", help="evaluate a run's latest checkpoint (or an export folder) on valid/test "
                            "(per-document memory) and print the JSON result")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, or an export folder (`memlm export`)")
    p.add_argument("--split", choices=["valid", "test"], default="valid")
    p.add_argument("--tgt-len", type=int, metavar="N", help="target (segment) length (default: the run's)")
    # Not an argparse mutually exclusive group: its usage + error is two lines; evaluate_run refuses both in one.
    p.add_argument("--mem-len", type=int, metavar="M", help="memory length (default: the run's)")
    p.add_argument("--mem-mult", type=float, metavar="m", help="memory length = m x target length")
    p.add_argument("--clamp-len", type=int, metavar="C", help="clamp relative distances beyond C")
    p.add_argument("--same-length", action="store_true", default=None, help="every query sees as many keys")
    p.add_argument("--json", metavar="PATH",
                   help="where to write the JSON (default RUN_DIR/eval/...; an export folder: only with --json)")
    p.add_argument("--data", metavar="DATA_DIR", help="the prepared data (default: the config's data.path)")
    p.add_argument("--lanes", type=int, metavar="B", help="lanes per rank (default data.eval_batch_size)")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    p.set_defaults(run=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    import json
    import os

    from memlm.trainer.inference.evaluate import evaluate_run  # keeps --help torch-free

    result = evaluate_run(args.run_dir, split=args.split, tgt_len=args.tgt_len, mem_len=args.mem_len,
                          mem_mult=args.mem_mult, clamp_len=args.clamp_len, same_length=args.same_length,
                          lanes=args.lanes, json_path=args.json, data_dir=args.data)
    if int(os.environ.get("RANK", "0")) == 0:  # every rank holds the same result: print it once
        print(json.dumps(result))
        from memlm.trainer.config.run_config import load_config  # keeps --help YAML-free

        vocab_size = load_config(os.path.join(args.run_dir, "config.yaml")).model.vocab_size
        note = uniform_guess.note(result, vocab_size)
        if note:
            print(f"memlm eval: {note}", file=sys.stderr)
    return 0


def _add_generate(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="sample text from a run's latest checkpoint (or an export folder) with "
                            "its memory carried across segments, streamed to stdout")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, or an export folder (`memlm export`)")
    p.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    p.add_argument("--prompt-file", metavar="F", help="read the prompt from a UTF-8 file instead")
    p.add_argument("--tokens", type=int, default=100, metavar="T", help="tokens to sample (default 100)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest (default 0: off)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="X", help="default 1; 0 = greedy")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default 0)")
    p.add_argument("--mem-len", type=int, metavar="M", help="memory length (default: the run's)")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from memlm.trainer.inference import generate  # keeps --help torch-free

    return generate.main(args)


def _add_export(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("export", help="write a run's latest weights as safetensors with its config, tokenizer "
                            "and a model card: a folder for `memlm generate/eval DIR` and memlm.load_pretrained")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", required=True, metavar="DIR", help="the export folder (new or empty)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights' precision (default fp32)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in DIR")
    p.add_argument("--hf-backbone", action="store_true",
                   help="archs hf, hf_rmt, hf_armt: write DIR as the run's backbone alone, a Hugging Face folder "
                        "(save_pretrained: config.json, model.safetensors, the data's tokenizer.json) that "
                        "model.backbone=DIR loads; LoRA merged, the memory left out")
    p.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from memlm.trainer.checkpoint import export  # keeps --help torch-free

    return export.main(args)


def _add_analyze(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("analyze", help="attention to memory vs the current segment (LaMemo Fig. 1), LaMemo's "
                            "alpha (Fig. 6), RMT read/write attention maps: plots + JSON in RUN_DIR/analysis")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--split", choices=["valid", "test"], default="test")
    p.add_argument("--segments", type=int, default=64, metavar="S", help="segments to average over (default 64)")
    p.set_defaults(run=_run_analyze)


def _run_analyze(args: argparse.Namespace) -> int:
    from memlm.trainer.inference import analyze  # keeps --help torch-free

    return analyze.main(args)


# -- cluster commands (Ray and MLflow are imported inside cluster/, only when one of these runs) -----------------


def _add_extrapolate(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("extrapolate", help="evaluate runs with memory m x N for m in --mult, one Ray task per "
                            "(run, m); JSON, MLflow and a ppl-against-m plot (LaMemo Figure 5)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--mult", default="1-10", metavar="A-B|m,m,...", help="memory multipliers m (default 1-10)")
    p.add_argument("--tgt-len", type=int, metavar="N", help="target length N (default: the runs' own)")
    p.add_argument("--split", choices=["valid", "test"], default="test")
    p.add_argument("--out", metavar="DIR", help="results folder (default extrapolation/)")
    add_ray_flags(p, experiment="memlm-extrapolate", lanes="lanes per evaluation")
    p.set_defaults(run=_run_extrapolate)


def _run_extrapolate(args: argparse.Namespace) -> int:
    from memlm.cluster import extrapolate  # keeps --help free of torch and Ray

    heartbeat.phase("checking the runs and opening the MLflow store")

    return extrapolate.main(args)


def _add_longeval(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("longeval", help="answer accuracy on long-context tasks (BABILong-style QA, passkey; or "
                            "BABILong's own files) by sample length and fact depth, beside chance and cheap heuristics "
                            "on the same samples, one Ray task per (run, length); plots, heatmaps, JSON, MLflow")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--lengths", metavar="L,L,...",
                   help="sample lengths in tokens, k = 1024 (default 512,1k,2k,4k); with --babilong BABILong's "
                        "length labels, e.g. 0k,1k,4k (default: every length the folder has)")
    p.add_argument("--depths", type=int, metavar="K", help="fact-depth windows (default 5: 0-0.2, ...)")
    p.add_argument("--samples", type=int, metavar="S",
                   help="samples per (length, depth) (default 20); with --babilong the first S records of each "
                        "length (default all)")
    p.add_argument("--task", metavar="TASK",
                   help="qa1, qa2, qa3 or passkey; with --babilong qa1..qa20 (default: the task the first run was "
                        "trained on)")
    p.add_argument("--babilong", metavar="DIR",
                   help="score BABILong's own files (a download of RMT-team/babilong or babilong-1k-samples) with "
                        "BABILong's scoring, instead of generated samples")
    p.add_argument("--background", metavar="WIKITEXT_DIR", help="QA background (default: the run's data's)")
    p.add_argument("--seed", type=int, help="sample generation seed (default 0)")
    p.add_argument("--split", choices=["valid", "test"], help="background text's split (default test)")
    p.add_argument("--out", metavar="DIR", help="results folder (default longeval/)")
    add_ray_flags(p, experiment="memlm-longeval", lanes="samples side by side")
    p.set_defaults(run=_run_longeval)


def _run_longeval(args: argparse.Namespace) -> int:
    from memlm.cluster import longeval  # keeps --help free of torch and Ray

    heartbeat.phase("checking the runs and opening the MLflow store")

    return longeval.main(args)


def _add_sweep(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("sweep", help="Ray Tune sweep of training runs over a YAML search space; MLflow parent "
                            "run with one child run per trial")
    p.add_argument("sweep", metavar="SWEEP", help="a sweep file, or a preset's name such as sweeps/tiny_grid")
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value",
                   help="fixed overrides of the base run config for every trial (e.g. data.path=DATA_DIR), or of "
                        "the sweep file's own keys (e.g. resources.gpus=0 max_concurrent=1)")
    p.add_argument("--num-samples", type=int, metavar="K", help="trials to sample (default: the sweep file's)")
    p.add_argument("--out", metavar="DIR", help="sweep folder (default sweeps/NAME); a rerun resumes it")
    add_ray_flags(p)  # a sweep's MLflow experiment is its sweep file's; each trial is one training run
    p.set_defaults(run=_run_sweep)


def _run_sweep(args: argparse.Namespace) -> int:
    from memlm.cluster import sweep  # keeps --help free of torch and Ray

    heartbeat.phase("checking the sweep and loading MLflow")

    return sweep.main(args)


def _add_compare(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("compare", help="an MLflow experiment's runs as a table (Markdown, CSV) like LaMemo's "
                            "Table 1, with loss-curve plots; logged back to MLflow")
    p.add_argument("--experiment", required=True, metavar="NAME")
    p.add_argument("--out", metavar="DIR", help="output folder (default compare/NAME)")
    p.add_argument("--uri", metavar="URI", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.set_defaults(run=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from memlm.trainer.tracking import compare  # here: the MLflow command's module loads only when it runs

    heartbeat.phase(f"reading experiment {args.experiment!r} from MLflow and drawing its curves")

    return compare.main(args)


def _add_ui(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("ui", help="the MLflow UI over the default store, on 127.0.0.1")
    p.add_argument("--uri", metavar="URI", help="backend store (default $MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; others are opt-in)")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(run=_run_ui)


def _run_ui(args: argparse.Namespace) -> int:
    from memlm.trainer.tracking import ui  # here: the MLflow command's module loads only when it runs

    heartbeat.phase("starting the MLflow server")

    return ui.main(args)


def _add_track(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("track", help="log to a run's MLflow run what its folder records and the run lacks "
                            "(a tracking server that was away); creates the run if it never reached the server")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by `memlm train`")
    p.add_argument("--uri", metavar="URI", help="MLflow tracking URI (default: the one the run was tracked in)")
    p.set_defaults(run=_run_track)


def _run_track(args: argparse.Namespace) -> int:
    from memlm.trainer.tracking import catchup  # here: the MLflow command's module loads only when it runs

    heartbeat.phase(f"comparing {args.run_dir} with its MLflow run")

    return catchup.main(args)

