"""The one reader of where memlm's own imports stand, for the tests that hold each folder to the module-top
rule (tests/cli/test_imports_at_top.py, tests/trainer/test_import_direction.py). Reads source, imports nothing."""

from __future__ import annotations

import ast
from pathlib import Path


def unexplained_imports(folder: Path) -> list[str]:
    """'FOLDER/FILE:LINE' of each import of memlm's code (absolute `memlm.*` or relative) inside a function whose
    line carries no comment."""
    found = set()  # a set: the import of a nested function is walked under each enclosing one
    for path in sorted(folder.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for function in ast.walk(ast.parse(text)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom):
                    own = node.level > 0 or (node.module or "").split(".")[0] == "memlm"
                elif isinstance(node, ast.Import):
                    own = any(alias.name.split(".")[0] == "memlm" for alias in node.names)
                else:
                    continue
                if own and "#" not in lines[node.lineno - 1]:
                    found.add((path.relative_to(folder.parent).as_posix(), node.lineno))
    return [f"{file}:{line}" for file, line in sorted(found)]
