"""memlm's own imports stand at the module top, where a reader sees a module's wiring, in models/, data_pipeline/,
cluster/ and memlm/ (trainer/ has the same rule in tests/trainer/test_import_direction.py). One inside a function
says why on its line: it keeps `memlm --help` free of torch (or numpy, YAML), loads an optional dependency only
when chosen, breaks a cycle, or keeps a process that never trains free of torch. Read from the source, no import."""

from __future__ import annotations

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
