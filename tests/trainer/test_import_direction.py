"""trainer/'s imports (docs/design.md §1), read from the source of every module under trainer/: each import of memlm's
own code, at module top or inside a function, goes down the layers

    runtime, config  <-  checkpoint  <-  tracking  <-  inference  <-  loop

(a package uses its own modules and those of the packages to its left; runtime and config use no other part of
trainer/, and runtime nothing else of memlm), and nothing under trainer/ reaches up to `cluster` or the command line.
Those imports stand at the module top, where a reader sees a module's wiring, unless a comment on the line says why
not (keeping `memlm --help` free of torch).
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.import_scan import unexplained_imports

ROOT = Path(__file__).resolve().parents[2]

# What each package of trainer/ may import of the others.
MAY_USE = {
    "runtime": set(),
    "config": set(),
    "checkpoint": {"runtime", "config"},
    "tracking": {"runtime", "config", "checkpoint"},
    "inference": {"runtime", "config", "checkpoint", "tracking"},
    "loop": {"runtime", "config", "checkpoint", "tracking", "inference"},
}
OUTSIDE_TRAINER = {"models", "data_pipeline"}  # what trainer/ builds on; cluster and the command line build on it
BENEATH_ALL = {"errors"}  # memlm/errors.py, the user-error base: it imports nothing, every package builds on it


def imported_modules(path: Path, package: list[str]) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, relative ones resolved against `package`; a
    `from PACKAGE import name` gives PACKAGE.name, since the name may be a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return sorted(found)


def back_edges(trainer: Path) -> list[str]:
    """'FILE:LINE imports MODULE (...)' for every import under `trainer` that breaks the direction."""
    wrong = []
    for path in sorted(trainer.rglob("*.py")):
        parts = path.relative_to(trainer.parent).with_suffix("").parts  # ("trainer", "loop", "train")
        package = ["memlm", *parts[:-1]]  # what a relative import starts from (a package's __init__ included)
        own = parts[1] if len(parts) > 2 else None  # None: trainer/__init__.py
        for line, module in imported_modules(path, package):
            names = module.split(".")
            if names[0] != "memlm" or len(names) < 2 or names[1] in BENEATH_ALL:
                continue
            where = f"{path.relative_to(trainer.parent)}:{line} imports {module}"
            if names[1] == "trainer":
                target = names[2] if len(names) > 2 else None
                if own is None or target is None or target == own:
                    continue
                if target not in MAY_USE.get(own, set()):
                    wrong.append(f"{where} ({own} may use {sorted(MAY_USE.get(own, ())) or 'nothing'} of trainer/)")
            elif names[1] not in OUTSIDE_TRAINER:
                wrong.append(f"{where} (trainer/ builds on {sorted(OUTSIDE_TRAINER)} only)")
            elif own == "runtime":
                wrong.append(f"{where} (runtime uses nothing else of memlm)")
    return wrong


def test_trainer_imports_its_own_modules_at_the_top():
    hidden = unexplained_imports(ROOT / "trainer")
    assert not hidden, "memlm imports inside functions (move them to the top, or say why on the line):\n" + \
        "\n".join(hidden)


def test_trainer_imports_go_one_way():
    wrong = back_edges(ROOT / "trainer")
    assert not wrong, "imports against docs/design.md §1:\n" + "\n".join(wrong)


def test_a_back_edge_is_named(tmp_path):
    """The reader finds an upward import wherever it is written: module top, a function, relative or absolute."""
    trainer = tmp_path / "trainer"
    for package in MAY_USE:
        (trainer / package).mkdir(parents=True)
        (trainer / package / "__init__.py").write_text("")
    (trainer / "checkpoint" / "fine.py").write_text("from memlm.trainer.config.run_config import load_config\n"
                                                   "from . import store\nimport torch\n")
    (trainer / "checkpoint" / "up.py").write_text(
        "from memlm.trainer.loop.recurrence import plain_state\n\n\n"
        "def load():\n    from ..inference import generate\n    import memlm.cluster.sweep\n")
    (trainer / "runtime" / "up.py").write_text("from memlm.models.config import ConfigError\n")
    (trainer / "inference" / "fine.py").write_text("from memlm.trainer.checkpoint import pretrained\n")
    assert back_edges(trainer) == [
        "trainer/checkpoint/up.py:1 imports memlm.trainer.loop.recurrence.plain_state "
        "(checkpoint may use ['config', 'runtime'] of trainer/)",
        "trainer/checkpoint/up.py:5 imports memlm.trainer.inference.generate "
        "(checkpoint may use ['config', 'runtime'] of trainer/)",
        "trainer/checkpoint/up.py:6 imports memlm.cluster.sweep (trainer/ builds on ['data_pipeline', 'models'] only)",
        "trainer/runtime/up.py:1 imports memlm.models.config.ConfigError (runtime uses nothing else of memlm)",
    ]


def test_an_import_inside_a_function_is_named_unless_it_says_why(tmp_path):
    trainer = tmp_path / "trainer"
    (trainer / "loop").mkdir(parents=True)
    (trainer / "loop" / "lazy.py").write_text(
        "import os\nfrom memlm.models import build_model\n\n\n"
        "def a():\n    import json\n    from memlm.trainer.checkpoint import store\n\n\n"
        "def b():\n    def inner():\n        from .train import run\n\n\n"
        "def c():\n    from memlm.models.config import ConfigError  # keeps `memlm --help` free of torch\n")
    assert unexplained_imports(trainer) == ["trainer/loop/lazy.py:7", "trainer/loop/lazy.py:12"]
