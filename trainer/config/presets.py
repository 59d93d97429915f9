"""Presets: the YAML files shipped in the package memlm.configs (configs/ in a checkout), each named by its path
there without `.yaml`.

    find("tiny/txl")                          # .../configs/tiny/txl.yaml, from any working folder
    find("runs/mine.yaml")                    # an existing file wins over a preset of the same name
    find("txl.yaml", relative_to=folder)      # inherit: / base: values: a file beside the one naming it, else a preset
    for name in names(): print(name, summary(name))

Looked up through importlib.resources, so an installed wheel finds them exactly as a source checkout does.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from importlib import resources
from pathlib import Path, PurePosixPath

from memlm.models.config import ConfigError

PACKAGE = "memlm.configs"
SUFFIX = ".yaml"
LIST_HINT = "`memlm config --list` lists every preset"
# The flat file names before the presets had folders, so an old command line is told where its preset went.
MOVED = {
    "wt103_base_txl": "paper/wt103/txl",
    "wt103_base_lamemo": "paper/wt103/lamemo",
    "wt103_base_transformer": "paper/wt103/transformer",
    "rmt_wt103_bptt3_mem10": "paper/wt103/rmt_bptt3_mem10",
    "rmt_wt103_bptt2_mem25": "paper/wt103/rmt_bptt2_mem25",
    "rmt_wt103_n50_bptt1_mem1": "paper/wt103/rmt_n50_bptt1_mem1",
    "rmt_wt103_n50_bptt3_mem10": "paper/wt103/rmt_n50_bptt3_mem10",
    "txl_rmt_wt103_mem150_tok10": "paper/wt103/txl_rmt_mem150_tok10",
    "txl_rmt_wt103_mem75_tok5": "paper/wt103/txl_rmt_mem75_tok5",
    "e8_base_txl": "paper/enwik8/txl",
    "e8_base_lamemo": "paper/enwik8/lamemo",
    "t8_base_lamemo": "paper/text8/lamemo",
    "tiny_txl": "tiny/txl",
    "tiny_lamemo": "tiny/lamemo",
    "tiny_rmt": "tiny/rmt",
    "tiny_transformer": "tiny/transformer",
    "repro_wt2_small": "reproduce/wikitext2",
    "repro_tasks_small": "reproduce/copy_reverse",
    "sweep_tiny": "sweeps/tiny_grid",
    "sweep_lamemo_table5": "sweeps/lamemo_table5",
}


def root() -> Path:
    """The folder that holds the presets."""
    folder = resources.files(PACKAGE)
    if not isinstance(folder, Path):  # a zipped install: inherit: needs real files, so this is a packaging bug
        raise RuntimeError(f"{PACKAGE} is not a folder on disk ({folder!r}); install memlm unzipped")
    return folder


def names() -> list[str]:
    """Every preset's name, sorted (so each folder's presets come together)."""
    base = root()
    return sorted(path.relative_to(base).with_suffix("").as_posix() for path in base.rglob(f"*{SUFFIX}"))


# A full stop that ends a sentence: followed by a space or the end, and not one of the abbreviations the presets'
# comments use ("App. B", "Rae et al., 2020", "e.g. 4").
SENTENCE_END = re.compile(r"(?<!\bApp)(?<!\bFig)(?<!\bEq)(?<!\bal)(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)\.(?=\s|$)")
LIST_WIDTH = 120  # `memlm config --list` wraps a description under itself past this column


def summary(name: str) -> str:
    """The first sentence of a preset's leading comment, without its `#`s: what `memlm config --list` shows beside
    the name (issue 32: the first comment line alone cut most descriptions mid-sentence)."""
    lines = []
    for line in path_of(name).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(filter(None, lines))
    end = SENTENCE_END.search(text)
    return text[:end.end()] if end else text


def listing() -> str:
    """Each preset's name, then its summary in an aligned column, wrapped under itself past LIST_WIDTH."""
    all_names = names()
    width = max(map(len, all_names), default=0)
    rows = []
    for name in all_names:
        lines = textwrap.wrap(summary(name), LIST_WIDTH - width - 2, break_on_hyphens=False) or [""]
        rows.append(f"{name:<{width}}  {lines[0]}".rstrip() + "\n")
        rows += [f"{'':<{width}}  {line}\n" for line in lines[1:]]
    return "".join(rows)


def name_of(path: Path) -> str:
    """How to show a config file: its preset name when it is a shipped preset (`tiny/lamemo`), else its path."""
    try:
        return Path(path).resolve().relative_to(root().resolve()).with_suffix("").as_posix()
    except ValueError:
        return str(path)


def path_of(name: str) -> Path:
    """The file of preset `name` (which need not exist)."""
    return root() / f"{name}{SUFFIX}"


def find(name: str | Path, relative_to: Path | None = None) -> Path:
    """The YAML file `name` means: an existing file (relative to the folder `relative_to` when given, else to the
    working folder), else the preset of that name; one-line ConfigError naming the closest presets otherwise."""
    text = str(name)
    path = Path(relative_to) / text if relative_to is not None else Path(text)
    if path.is_file():
        return path
    if _could_be_a_name(text) and path_of(text).is_file():
        return path_of(text)
    if path.exists():  # a folder: reading it gives the one-line "is a folder" error
        return path
    where = f" in {relative_to}" if relative_to is not None else ""
    close = closest(text)
    hint = f"; closest presets: {', '.join(close)}" if close else ""
    raise ConfigError(f"config not found: '{text}' is neither a file{where} nor a preset{hint} ({LIST_HINT})")


def closest(text: str, n: int = 4) -> list[str]:
    """Presets like `text`: where an old flat name moved, those inside a folder of that name (`tiny`), then the
    most similar names."""
    key = text.removesuffix(SUFFIX).removeprefix("./").removeprefix("configs/")
    all_names = names()
    moved = [MOVED[key]] if key in MOVED else []
    inside = [name for name in all_names if name.startswith(key.rstrip("/") + "/")]
    similar = difflib.get_close_matches(key, all_names, n=n, cutoff=0.5)
    return list(dict.fromkeys(moved + inside + similar))[:n]


def _could_be_a_name(text: str) -> bool:
    """A relative path that stays inside the presets folder: never `/etc/x` or `../x`."""
    parts = PurePosixPath(text).parts
    return bool(parts) and not PurePosixPath(text).is_absolute() and ".." not in parts and "\\" not in text
