"""The docs name what the code has (issue 36 item 3: docs that cannot drift). Each check reads the code itself,
never a copy of it:

- lists: every marked list of archs, tasks, corpora and tokenizers in README.md, docs/design.md and
  models/README.md against the registry (models/registry.py: ARCHS), data_pipeline/tasks.py (TASKS; longctx.py's
  LONGCTX_TASKS) and `memlm prepare`'s choices; docs/design.md §3 has one `arch: NAME` section per arch;
- commands: docs/design.md §8 has one synopsis line per `memlm` command, its options and `{a,b}` choices the
  parser's; every `memlm COMMAND --option` the docs show (code blocks, `code` spans) exists; README.md names every
  command;
- files: models/README.md's file table names every file of models/; every path the docs name exists;
  bench/README.md names every bench script, and each `python bench/...` command's options and `--profile` choices
  are the script's;
- shapes: models/shapes.md is the one shape legend: each model file's legend cites it and gives its letters its
  meanings, and every bracketed shape in models/*.py's comments and docstrings uses only letters its legend has.

A list is marked where it stands, so whoever edits it sees that it is checked: `<!-- list:KIND -->` ...
`<!-- /list -->` around it, the backticked names inside being KIND's names, exactly (`<!-- list:KIND, one bullet
each -->` around a bullet list: the backticked name each bullet starts with). EXPECTED_LISTS says which lists each
doc keeps, so deleting a list with its marker fails too. Each check returns its problems, and a test beside it
feeds the check a changed code base (an arch or a command more, a letter less) to show that it fails.

Reads files and builds argparse parsers (no model, no torch work): about a second.
"""

from __future__ import annotations

import argparse
import ast
import functools
import glob
import importlib.util
import io
import re
import tokenize
from pathlib import Path

from memlm.cli import build_parser
from memlm.data_pipeline.longctx import LONGCTX_TASKS
from memlm.data_pipeline.tasks import TASKS
from memlm.models.registry import ARCHS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/design.md", "models/README.md", "models/shapes.md", "bench/README.md")
LIST = re.compile(r"<!-- list:([a-z-]+)(, one bullet each)? -->(.*?)<!-- /list -->", re.S)
NAME = re.compile(r"`([a-z][a-z0-9_-]*)`")
# The marked lists each doc keeps (at least this many of each kind).
EXPECTED_LISTS = {
    "README.md": {"archs": 2, "corpora": 1, "tokenizers": 1, "rmt-tasks": 1, "longctx-tasks": 1},
    "docs/design.md": {"archs": 2, "tasks": 1, "rmt-tasks": 1, "longctx-tasks": 1},
}
# Paths a doc names that exist no more, on purpose: (doc, path) -> why. An entry its doc stops naming fails.
HISTORICAL_PATHS = {
    ("bench/README.md", "bench/gpu_run.sh"): "where the GPU script lay when the first GPU calls ran, quoted as run",
    ("bench/README.md", "bench/bench_mfu.py"): "the same calls, quoted as run",
    ("bench/README.md", "bench/bench_gpu_trainer.py"): "the same calls, quoted as run",
}
# What a path the docs name may look like: a top folder of the checkout (or bench/'s own, in bench/README.md), then
# names; an upper-case name is a placeholder (models/NAME.py). Only code and docs are checked: outputs (results
# JSON, figures) are written by the commands that name them.
PATH = re.compile(r"(?<![\w/.~$-])((?:models|trainer|data_pipeline|cluster|memlm|bench|tests|configs|docs|scripts|"
                  r"benchmarks|reproduce)/[\w/.*{},-]*\.(?:py|sh|md|yaml))\b")


def read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def known_lists(archs=ARCHS) -> dict[str, list[str]]:
    """Each kind of list, as the code has it."""
    prepare = subparsers(build_parser())["prepare"]
    return {"archs": list(archs), "tasks": list(TASKS), "longctx-tasks": list(LONGCTX_TASKS),
            "rmt-tasks": [task for task in TASKS if task not in LONGCTX_TASKS],
            "corpora": list(prepare._option_string_actions["--corpus"].choices),
            "tokenizers": list(prepare._option_string_actions["--tokenizer"].choices)}


def marked_lists(text: str) -> list[tuple[str, list[str]]]:
    """(kind, names) of every marked list, in order."""
    found = []
    for kind, bullets, body in LIST.findall(text):
        names = re.findall(r"^\s*[-*] `([a-z][a-z0-9_-]*)`", body, flags=re.M) if bullets else NAME.findall(body)
        found.append((kind, names))
    return found


def list_problems(known: dict[str, list[str]]) -> list[str]:
    """Every list whose names differ from the code's, and every doc that lost one of its lists."""
    problems = []
    for doc in DOCS:
        lists = marked_lists(read(doc))
        for kind, names in lists:
            if kind not in known:
                problems.append(f"{doc}: unknown list kind {kind!r}")
            elif sorted(names) != sorted(known[kind]):
                problems.append(f"{doc}: a list of {kind} names {names}, the code {known[kind]}")
        for kind, count in EXPECTED_LISTS.get(doc, {}).items():
            if sum(k == kind for k, _ in lists) < count:
                problems.append(f"{doc}: {count} marked list(s) of {kind} expected")
    section3 = read("docs/design.md").split("\n## 3.")[1].split("\n## 4.")[0]
    named = re.findall(r"\(`arch: ([a-z_]+)`", section3)
    if sorted(named) != sorted(known["archs"]):
        problems.append(f"docs/design.md: §3 describes the archs {named}, the code has {known['archs']}")
    return problems


def test_every_list_of_archs_tasks_corpora_and_tokenizers_is_the_codes():
    assert list_problems(known_lists()) == []


def test_an_arch_missing_from_the_docs_fails_every_list_of_archs():
    marked = sum(kind == "archs" for doc in DOCS for kind, _ in marked_lists(read(doc)))
    problems = list_problems(known_lists(archs=ARCHS + ("newarch",)))
    # each marked list and design.md §3 (pyproject's description and models/__init__.py's docstring point to the
    # registry instead of listing it: a new arch's diff should not have to touch them)
    assert len(problems) == marked + 1 and all("newarch" in problem for problem in problems), problems
    assert marked >= sum(lists.get("archs", 0) for lists in EXPECTED_LISTS.values())


def synopsis() -> list[tuple[str, str]]:
    """docs/design.md §8's command block as (command, the rest of its line and continuation lines)."""
    section8 = read("docs/design.md").split("\n## 8.")[1].split("\n## 9.")[0]
    block = re.search(r"^```\n(.*?)^```", section8, flags=re.S | re.M).group(1)
    lines: list[tuple[str, str]] = []
    for line in block.splitlines():
        start = re.match(r"memlm ([a-z]+)(.*)", line)
        if start:
            lines.append((start.group(1), start.group(2)))
        elif line.strip() and lines:
            lines[-1] = (lines[-1][0], f"{lines[-1][1]} {line.strip()}")
    return lines


def shown_commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, its --options) for every `memlm COMMAND ...` in a code block or `code` span of a doc. A command
    word followed by ':' is a quoted output line (`memlm train: ...`), not a command."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M)
    chunks = [re.sub(r"(^|\s)#.*", "", line) for block in blocks for line in block.splitlines()]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    chunks += [span.replace("\n", " ") for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose) if "\n\n" not in span]
    found = []
    for chunk in chunks:
        for piece in re.split(r"(?=(?<![\w.[-])(?<!from )(?<!import )memlm )", chunk)[1:]:
            start = re.match(r"memlm (--[a-z_-]+|[a-z]+)(?![\w:.-])(.*)", piece)
            if start:
                found.append((start.group(1), re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", start.group(2))))
    return found


def command_problems(parser: argparse.ArgumentParser) -> list[str]:
    commands = subparsers(parser)
    problems = []
    documented = synopsis()
    names = [command for command, _ in documented]
    if sorted(names) != sorted(commands):
        problems.append(f"docs/design.md §8: synopsis lines for {names}, the parser's commands are {list(commands)}")
    for command, rest in documented:
        sub = commands.get(command)
        if sub is None:
            continue
        for name, listed in re.findall(r"(--[a-z][a-z0-9_-]*)(?: \{([^}]*)\})?", rest):
            action = sub._option_string_actions.get(name)
            if action is None:
                problems.append(f"docs/design.md §8: memlm {command} has no option {name}")
            elif listed and sorted(listed.split(",")) != sorted(action.choices or ()):
                problems.append(f"docs/design.md §8: memlm {command} {name} {{{listed}}}, the parser's choices are "
                                f"{list(action.choices or ())}")
    for doc in DOCS:
        for command, options in shown_commands(read(doc)):
            sub = parser if command.startswith("--") else commands.get(command)
            if sub is None:
                problems.append(f"{doc}: `memlm {command}` is no memlm command")
                continue
            for name in options if sub is not parser else [command]:
                if name not in sub._option_string_actions:
                    problems.append(f"{doc}: `memlm {command}` has no option {name}")
    readme = read("README.md")
    problems += [f"README.md never names `memlm {command}`" for command in commands if f"memlm {command}" not in readme]
    return problems


def test_every_command_the_docs_show_is_the_parsers():
    assert command_problems(build_parser()) == []


def test_a_command_or_option_missing_from_the_docs_fails():
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action.add_parser("newcommand")
    commands = subparsers(parser)
    del commands["eval"]._option_string_actions["--mem-mult"]  # shown in README.md and design.md §8
    problems = command_problems(parser)
    assert any("newcommand" in p and p.startswith("docs/design.md") for p in problems), problems
    assert "README.md never names `memlm newcommand`" in problems
    assert {"README.md: `memlm eval` has no option --mem-mult",
            "docs/design.md §8: memlm eval has no option --mem-mult"} <= set(problems), problems


TOP_FOLDERS = ("models", "trainer", "data_pipeline", "cluster", "configs")


def defined_names(module: str) -> set[str] | None:
    """What `from MODULE import NAME` can take, read from the module's source without importing it: its top-level
    definitions, imports and `__all__`, and the names its `__getattr__` serves. None: no such module."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None if spec is None else set()
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                names |= {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
    return names


def snippet_problems() -> list[str]:
    """Each import in a doc's ```python block: memlm's folders by their installed names (memlm.models, not models),
    and every module and name there."""
    problems = []
    for doc in DOCS:
        for block in re.findall(r"^```python\n(.*?)^```", read(doc), flags=re.S | re.M):
            imports = "\n".join(line for line in block.splitlines() if re.match(r"(from \S+ )?import ", line))
            for node in ast.walk(ast.parse(imports)):  # the import lines alone: a sketch may elide arguments (...)
                if isinstance(node, ast.ImportFrom):
                    modules, names = [node.module], [alias.name for alias in node.names]
                elif isinstance(node, ast.Import):
                    modules, names = [alias.name for alias in node.names], []
                else:
                    continue
                for module in modules:
                    if module.split(".")[0] in TOP_FOLDERS:
                        problems.append(f"{doc}: `import {module}`: installed, it is memlm.{module}")
                    elif module.split(".")[0] == "memlm":
                        defined = defined_names(module)
                        if defined is None:
                            problems.append(f"{doc}: no module {module}")
                        problems += [f"{doc}: {module} has no {name}" for name in names
                                     if defined is not None and name not in defined]
    return problems


def test_the_docs_python_snippets_import_what_exists():
    assert snippet_problems() == []


def models_table_problems(files: set[str]) -> list[str]:
    table = "\n".join(line for line in read("models/README.md").splitlines() if line.startswith("| `"))
    named = set(re.findall(r"`((?:\w+/)?\w+\.py)`", table))  # a file of models/ or of a folder in it
    return ([f"models/README.md's file table lacks {name}" for name in sorted(files - named)]
            + [f"models/README.md's file table names {name}, which models/ lacks" for name in sorted(named - files)])


def test_the_models_readme_names_every_file_of_models():
    files = {path.relative_to(ROOT / "models").as_posix() for path in (ROOT / "models").rglob("*.py")
             if path.name != "__init__.py"}  # a subfolder's as pretrained/rmt.py
    assert models_table_problems(files) == []
    assert models_table_problems(files | {"newarch.py"}) == ["models/README.md's file table lacks newarch.py"]


def path_problems() -> list[str]:
    problems = []
    for doc in DOCS:
        text = read(doc)
        for path in sorted(set(PATH.findall(text))):
            candidates = [path]
            if "{" in path:  # bench/{a.py,b.py}
                head, _, tail = path.partition("{")
                options, _, rest = tail.partition("}")
                candidates = [head + option + rest for option in options.split(",")]
            for candidate in candidates:
                pattern = re.sub(r"(?<![a-z])[A-Z][A-Z_]*(?![a-z])", "*", candidate)  # NAME -> *
                if (doc, candidate) in HISTORICAL_PATHS:
                    continue
                if not any(glob.glob(str(base / pattern)) for base in (ROOT, (ROOT / doc).parent)):
                    problems.append(f"{doc} names {candidate}, which does not exist")
        problems += [f"HISTORICAL_PATHS: {doc} no longer names {path}" for doc_, path in HISTORICAL_PATHS
                     if doc_ == doc and path not in text.replace("{bench_mfu.py,bench_gpu_trainer.py,gpu_run.sh}",
                                                                 "bench_mfu.py bench/bench_gpu_trainer.py gpu_run.sh")]
    return problems


def test_every_path_the_docs_name_exists():
    assert path_problems() == []


@functools.cache
def script_options(script: Path) -> tuple[set[str], dict[str, list[str]]]:
    """The --options a bench script (with the bench modules it imports) declares, and each option's choices where
    they are a literal or the keys of a module-level dict (`choices=sorted(PROFILES) + ["small"]`)."""
    tree = ast.parse(script.read_text(encoding="utf-8"))
    trees = [tree]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memlm.bench."):
            module = ROOT / (node.module.removeprefix("memlm.").replace(".", "/") + ".py")
            if module.is_file():
                trees.append(ast.parse(module.read_text(encoding="utf-8")))
    strings = {node.value for t in trees for node in ast.walk(t)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    options = {string for string in strings if string.startswith("--")}
    # parser.add_argument(f"--{name}") over names written out: any of the script's strings may be an option
    if any(isinstance(node, ast.JoinedStr) and isinstance(node.values[0], ast.Constant)
           and node.values[0].value.startswith("--") for node in ast.walk(tree)):
        options |= {f"--{string}" for string in strings}
    dicts = {target.id: [key.value for key in node.value.keys if isinstance(key, ast.Constant)]
             for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
             for target in node.targets if isinstance(target, ast.Name)}

    def values(expr: ast.expr) -> list[str]:
        if isinstance(expr, ast.Call) and getattr(expr.func, "id", "") == "sorted":
            return values(expr.args[0])
        if isinstance(expr, ast.Name):
            return dicts.get(expr.id, [])
        if isinstance(expr, ast.BinOp):
            return values(expr.left) + values(expr.right)
        if isinstance(expr, (ast.List, ast.Tuple)):
            return [e.value for e in expr.elts if isinstance(e, ast.Constant)]
        return []

    choices = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant)):
            for keyword in node.keywords:
                if keyword.arg == "choices":
                    choices[node.args[0].value] = values(keyword.value)
    return options, choices


def bench_problems() -> list[str]:
    problems = []
    text = read("bench/README.md")
    scripts = [path for path in sorted((ROOT / "bench").rglob("*.py"))
               if re.search(r"^if __name__ == \"__main__\":", path.read_text(encoding="utf-8"), flags=re.M)]
    problems += [f"bench/README.md never names {path.relative_to(ROOT)}" for path in scripts
                 if path.name not in text]
    for doc in ("README.md", "bench/README.md"):
        shown = read(doc).replace("\\|", "|")
        for line in shown.splitlines():
            line = re.sub(r"\s#\s.*", "", line)
            for script, rest in re.findall(r"(?:python[0-9.]*|\.venv/bin/python) "
                                           r"((?:bench/)?(?:benchmarks/|reproduce/)?[a-z0-9_]+\.py)([^`\n]*)", line):
                if doc == "README.md" and not script.startswith("bench/"):
                    continue  # the README's other scripts (zero_to_fp32.py) are not bench's
                path = ROOT / script if script.startswith("bench/") else ROOT / "bench" / script
                if not path.is_file():
                    problems.append(f"{doc}: {script} does not exist")
                    continue
                options, choices = script_options(path)
                for name in re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", rest):
                    if name not in options:
                        problems.append(f"{doc}: {script} has no option {name}")
                for name, listed in re.findall(r"(--[a-z][a-z0-9_-]*)[ =]([a-z0-9_]+(?:\|[a-z0-9_]+)+)", rest):
                    if name in choices and sorted(listed.split("|")) != sorted(choices[name]):
                        problems.append(f"{doc}: {script} {name} {listed}, the script's choices are {choices[name]}")
    return problems


def test_bench_readme_names_every_script_and_their_options():
    assert bench_problems() == []


# --- shapes ---------------------------------------------------------------------------------------------------

SHAPE_ELEMENT = re.compile(r"^[A-Z0-9][A-Za-z0-9_ +\-*/·()]*$")
LEGEND = re.compile(r"Shape letters \(models/shapes\.md\): (.*?)\.(?:\s|$)", re.S)


def legend_of_shapes_md() -> dict[str, str]:
    """models/shapes.md's letters -> the first word of their meaning (rows `| `X` | meaning ... |`)."""
    rows = re.findall(r"^\| `([^`]+)` \| ([^ |]+)", read("models/shapes.md"), flags=re.M)
    return {letter: word.rstrip(":,;") for letter, word in rows}


def split_items(legend: str) -> list[str]:
    """A legend's items: split at ', ' and '; ' outside parentheses."""
    items, depth, current = [], 0, ""
    text = " ".join(legend.split())
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth == 0 and char in ",;" and text[i + 1:i + 2] == " ":
            items.append(current.strip())
            current = ""
        else:
            current += char
    return [item for item in items + [current.strip()] if item]


def shape_letters_used(source: str) -> set[str]:
    """The letters of every bracketed shape ([B, M + N, D]) in a file's comments and docstrings: groups whose
    comma-separated parts all start with a capital or a digit; a lower-case word of two letters or more is prose."""
    texts = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            texts.append(token.string)
        elif token.type == tokenize.STRING and token.string.lstrip("rbuRBU").startswith(('"""', "'''")):
            texts.append(token.string)
    used = set()
    for text in texts:
        for group in re.findall(r"\[([^\[\]\n]+)\]", text):
            parts = [part.strip() for part in group.split(",")]
            if all(SHAPE_ELEMENT.match(part) for part in parts) and re.search(r"[A-Z]", group):
                used |= {word for word in re.findall(r"(?<![A-Za-z0-9_])\d*([A-Za-z_][A-Za-z0-9_]*)", group)
                         if not (word.islower() and len(word) > 1)}
    return used


def shape_problems(shapes: dict[str, str]) -> list[str]:
    problems = []
    for path in sorted((ROOT / "models").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        source = path.read_text(encoding="utf-8")
        used = shape_letters_used(source)
        docstring = ast.get_docstring(ast.parse(source)) or ""
        found = LEGEND.search(docstring)
        if not found:
            if used:
                problems.append(f"{name}: shapes use {sorted(used)} but its docstring has no 'Shape letters "
                                "(models/shapes.md): ...' legend")
            continue
        legend = {}
        for item in split_items(found.group(1)):
            letter, _, meaning = item.partition(" ")
            legend[letter] = meaning.split(" ")[0].rstrip(":,;")
            if letter not in shapes:
                problems.append(f"{name}: its legend's {letter} is not in models/shapes.md")
            elif legend[letter] != shapes[letter]:
                problems.append(f"{name}: its legend's {letter} is '{legend[letter]} ...', models/shapes.md's "
                                f"'{shapes[letter]} ...'")
        problems += [f"{name}: its shapes use {letter}, which its legend does not define" for letter in sorted(used)
                     if letter not in legend]
    return problems


def test_every_model_file_uses_the_one_shape_legend():
    shapes = legend_of_shapes_md()
    assert shapes and shape_problems(shapes) == []
    letters = re.findall(r"^\| `([^`]+)` \|", read("models/shapes.md"), flags=re.M)
    assert len(letters) == len(set(letters)), "models/shapes.md defines a letter twice"


def test_a_letter_with_another_meaning_or_none_fails():
    shapes = legend_of_shapes_md()
    problems = shape_problems({**shapes, "T": "tokens?"})
    assert any("legend's T is" in p for p in problems), problems
    problems = shape_problems({letter: word for letter, word in shapes.items() if letter != "K"})
    assert any("models/txl.py: its legend's K is not in models/shapes.md" == p for p in problems), problems
    assert shape_letters_used('x = 1  # [B, M + N, D] or [B or 1, Q, K]; not: [read R | tokens N], x[b, t]\n') \
        == {"B", "M", "N", "D", "Q", "K"}
