"""BABILong's own files (Kuratov et al., 2024), read as memlm task samples, and BABILong's answer rule.

memlm never downloads them: the user fetches a copy from the Hugging Face hub (RMT-team/babilong: 100 test samples per
task and length; RMT-team/babilong-1k-samples: 1,000; RMT-team/babilong-train-5k-samples: the authors' training set)
and names its folder. A record has `input` (the context: bAbI facts in PG-19 text), `question` and `target` (the
label to answer; some copies also carry `answer`, unused). The layouts those repositories have used, relative to the
folder, for task T (qa1..qa20) and length L (0k, 1k, ..., 128k, 1M: thousands of GPT-2 tokens, BABILong's k = 1000):

    L/T-00000-of-00001.parquet       RMT-team/babilong and babilong-1k-samples now (several shards: all, in order)
    T/L-00000-of-00001.parquet       RMT-team/babilong's earlier layout
    L/T/0000.parquet, T/L/0000.parquet   the hub's automatic parquet conversion (refs/convert/parquet)
    T/L.json, data/T/L.json          the authors' create_tasks.py, babilong-train-5k-samples (a JSON list of records;
                                     JSON lines, as `datasets` writes them, are read too; .jsonl likewise)

The first layout found wins, so a snapshot holding two of them reads one. A sample is rendered as memlm's task
samples are (data_pipeline/longctx.py): prompt `<context> Q: <question>`, then SEP and the target; the text is made
printable ASCII on one line (the bytes tokenizer's "\\n" ends a document and ">" is SEP), curly quotes and dashes
mapped, accents dropped.

BABILong's scoring (their `compare_answers`): the generated answer, lower-cased and cut at its first ".", must
mention the target and no other of the task's labels (labels named in the question do not count). `right` below.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .format import DataError

TASKS = tuple(f"qa{i}" for i in range(1, 21))
FIELDS = ("input", "question", "target")
ROOMS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")
# Every answer a task's questions can have (bAbI's vocabulary); BABILong's scoring looks for these in the output.
TASK_LABELS = {
    "qa1": ROOMS, "qa2": ROOMS, "qa3": ROOMS, "qa4": ROOMS,
    "qa5": ("Bill", "Fred", "Jeff", "Mary", "apple", "football", "milk"),
    "qa6": ("no", "yes"),
    "qa7": ("none", "one", "three", "two"),
    "qa8": ("apple", "football", "milk", "nothing"),
    "qa9": ("no", "yes"),
    "qa10": ("maybe", "no", "yes"),
    "qa11": ROOMS, "qa12": ROOMS, "qa13": ROOMS,
    "qa14": ("bedroom", "cinema", "kitchen", "office", "park", "school"),
    "qa15": ("cat", "mouse", "sheep", "wolf"),
    "qa16": ("gray", "green", "white", "yellow"),
    "qa17": ("no", "yes"),
    "qa18": ("no", "yes"),
    "qa19": ("e,e", "e,n", "e,s", "n,e", "n,n", "n,w", "s,e", "s,s", "s,w", "w,n", "w,s", "w,w"),
    "qa20": ("bedroom", "bored", "garden", "hungry", "kitchen", "thirsty", "tired"),
}
QUESTION_MARK = " Q: "  # data_pipeline/longctx.py's: the prompt's context and question, as memlm's own tasks
LENGTH = re.compile(r"(\d+)([kM])")
HINT = ("download one with `hf download RMT-team/babilong --repo-type dataset --local-dir DIR` "
        "(or babilong-1k-samples, babilong-train-5k-samples)")


@dataclass(frozen=True)
class Record:
    context: str
    question: str
    target: str


def check_task(task: str) -> str:
    if task not in TASKS:
        raise DataError(f"BABILong has tasks qa1..qa20, not {task!r}")
    return task


def length_tokens(label: str) -> int:
    """"0k" -> 0, "1k" -> 1000, "1M" -> 1000000: the length BABILong's label names (its k is 1000 GPT-2 tokens)."""
    match = LENGTH.fullmatch(label)
    if not match:
        raise DataError(f"BABILong length {label!r}: give a label such as 0k, 1k, 4k, 128k or 1M")
    return int(match.group(1)) * (1000 if match.group(2) == "k" else 1_000_000)


def _layouts(task: str, label: str) -> list[str]:
    """The glob patterns of one (task, length)'s files, in the order tried (see the module docstring)."""
    return [f"{label}/{task}-*.parquet", f"{task}/{label}-*.parquet", f"{label}/{task}/*.parquet",
            f"{task}/{label}/*.parquet", f"{task}/{label}.json", f"data/{task}/{label}.json",
            f"{task}/{label}.jsonl", f"data/{task}/{label}.jsonl"]


def _folder(folder: str | Path) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise DataError(f"BABILong folder {path} does not exist: {HINT}")
    return path


def files(folder: str | Path, task: str, label: str) -> list[Path]:
    """The files holding (task, length), shards in order."""
    root = _folder(folder)
    check_task(task)
    length_tokens(label)
    for pattern in _layouts(task, label):
        found = sorted(p for p in root.glob(pattern) if p.is_file())
        if found:
            return found
    have = lengths(root, task)
    where = f"it has {task} at {', '.join(have)}" if have else f"it has no {task} files at any length"
    raise DataError(f"BABILong folder {root} has no {task} file for length {label} ({where}); looked for "
                    f"{', '.join(_layouts(task, label)[:2])}, ...")


def lengths(folder: str | Path, task: str) -> list[str]:
    """The length labels the folder has for `task`, shortest first."""
    root = _folder(folder)
    check_task(task)
    found = set()
    for path in [*root.glob(f"*/{task}-*.parquet"), *root.glob(f"*/{task}/*.parquet")]:
        found.add(path.parent.name if path.parent.name != task else path.parent.parent.name)
    for path in root.glob(f"{task}/*-*.parquet"):
        found.add(path.name.split("-")[0])
    for path in [*root.glob(f"{task}/*/*.parquet"), *root.glob(f"{task}/*.json*"), *root.glob(f"data/{task}/*.json*")]:
        found.add(path.parent.name if path.suffix == ".parquet" else path.stem)
    return sorted((label for label in found if LENGTH.fullmatch(label)), key=length_tokens)


def records(folder: str | Path, task: str, label: str, limit: int | None = None) -> list[Record]:
    """The (task, length) records in file order, the first `limit` of them when given."""
    out: list[Record] = []
    for path in files(folder, task, label):
        rows = _read_parquet(path) if path.suffix == ".parquet" else _read_json(path)
        for i, row in enumerate(rows):
            out.append(_record(row, path, i))
            if limit is not None and len(out) >= limit:
                return out
    if not out:
        raise DataError(f"BABILong {task} at {label} in {folder} has no records")
    return out


def _record(row, path: Path, i: int) -> Record:
    if not isinstance(row, dict):
        raise DataError(f"BABILong file {path}: record {i} is a {type(row).__name__}, not an object with "
                        f"{', '.join(FIELDS)}")
    missing = [f for f in FIELDS if f not in row]
    if missing:
        raise DataError(f"BABILong file {path}: record {i} has no {', '.join(missing)} (it has "
                        f"{', '.join(map(str, row)) or 'no fields'}; BABILong records have {', '.join(FIELDS)})")
    bad = [f for f in FIELDS if not isinstance(row[f], str)]
    if bad:
        raise DataError(f"BABILong file {path}: record {i}'s {', '.join(bad)} must be text")
    if not printable(row["target"]):
        raise DataError(f"BABILong file {path}: record {i} has an empty target")
    return Record(row["input"], row["question"], row["target"])


def _read_parquet(path: Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # mlflow depends on pyarrow, so memlm's environment has it; a bare one may not
        raise DataError(f"reading {path} needs pyarrow (pip install pyarrow)") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - arrow's errors are many kinds; all mean an unreadable file
        raise DataError(f"BABILong file {path} is not a readable parquet file ({exc})") from None


def _read_json(path: Path) -> list:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):  # create_tasks.py's json.dump of a list
        try:
            rows = json.loads(text)
        except ValueError as exc:
            raise DataError(f"BABILong file {path} is not valid JSON ({exc})") from None
        return rows
    rows = []
    for n, line in enumerate(text.splitlines(), 1):  # JSON lines, as `datasets` writes .json files
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise DataError(f"BABILong file {path}, line {n}: not JSON ({exc}); give a JSON list of records "
                                "or one record per line") from None
    return rows


# ---------------------------------------------------------------- as memlm task samples

_PUNCTUATION = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
                              "\u2014": "-", "\u2026": "...", ">": " "})


def printable(text: str) -> str:
    """Printable ASCII on one line: what a memlm task sample may hold (no "\\n" boundary, no ">" SEP)."""
    text = unicodedata.normalize("NFKD", text.translate(_PUNCTUATION))
    text = "".join(c for c in text if not unicodedata.combining(c))
    return re.sub(r"\s+", " ", re.sub(r"[^ -~]", " ", text)).strip()


def prompt_of(record: Record) -> str:
    return printable(record.context) + QUESTION_MARK + printable(record.question)


def samples(folder: str | Path, task: str, label: str, limit: int | None = None) -> Iterator[tuple[str, str]]:
    """(prompt, answer) per record, as memlm's task samples: the document is prompt + SEP + answer."""
    for record in records(folder, task, label, limit):
        yield prompt_of(record), printable(record.target)


def right(target: str, output: str, question: str, labels: tuple[str, ...]) -> bool:
    """BABILong's rule: the output's first sentence (lower-cased, cut before any "<context>" or "<example>" it
    starts to write) names the target and no other label, labels the question names aside. Labels are found as
    substrings, as theirs are (qa7's "none" also holds "one"), so a target that is not one label (qa8's lists) is
    never right, as in their scoring."""
    said = output.lower().split(".")[0].split("<context>")[0].split("<example>")[0]
    asked = question.lower()
    named = {label.lower() for label in labels if label.lower() in said and label.lower() not in asked}
    return named == {target.strip().lower()}
