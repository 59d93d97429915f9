"""memlm's own imports stand at the module top, where a reader sees a module's wiring, in models/, data_pipeline/,
cluster/ and memlm/ (trainer/ has the same rule in tests/trainer/test_import_direction.py). One inside a function
says why on its line: it keeps `memlm --help` free of torch (or numpy, YAML), loads an optional dependency only
when chosen, breaks a cycle, or keeps a process that never trains free of torch. Read from the source, no import."""

from __future__ import annotations

import ast
from pathlib import Path

from support.import_scan import unexplained_imports

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("models", "data_pipeline", "cluster", "memlm")


def test_memlms_imports_are_at_the_top_or_say_why():
    hidden = [where for name in FOLDERS for where in unexplained_imports(ROOT / name)]
    assert not hidden, ("imports of memlm's modules inside functions (move them to the top, or say why on the "
                        "line):\n" + "\n".join(hidden))


def test_an_unexplained_import_in_a_function_is_named(tmp_path):
    folder = tmp_path / "cluster"
    folder.mkdir()
    (folder / "lazy.py").write_text(
        "import json\nfrom memlm.trainer.runtime import heartbeat\n\n\n"
        "def a():\n    import os\n    from memlm.trainer.loop.train import run\n\n\n"
        "def b():\n    def inner():\n        from .ray_runtime import placement\n\n\n"
        "def c():\n    from memlm.trainer.inference import analyze  # keeps --help torch-free\n\n\n"
        "def d():\n    import memlm.models.output\n")
    assert unexplained_imports(folder) == ["cluster/lazy.py:7", "cluster/lazy.py:12", "cluster/lazy.py:20"]


# The modules that wrap a Hugging Face model (models/pretrained/__init__.py): the only ones of models/ that import
# transformers or peft (issue 37: models/ imports torch alone otherwise)
HUGGING_FACE_WRAPPERS = {"models/pretrained/loading.py", "models/pretrained/causal_lm.py", "models/pretrained/rmt.py",
                         "models/pretrained/armt.py"}


def test_only_the_modules_that_wrap_a_hugging_face_model_import_transformers():
    importers = set()
    for path in sorted((ROOT / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if any(name.split(".")[0] in ("transformers", "peft") for name in names):
                importers.add(path.relative_to(ROOT).as_posix())
    assert importers <= HUGGING_FACE_WRAPPERS, sorted(importers - HUGGING_FACE_WRAPPERS)
    assert importers, "no module of models/ wraps a Hugging Face model any more: update HUGGING_FACE_WRAPPERS"
