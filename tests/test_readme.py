"""The README drives this test: every command of its quick start and of "Training and evaluation", in order, as a
user types them, in a scratch copy of the repository.

Only what a CI machine cannot do as written is substituted, each substitution listed in SUBSTITUTIONS:
- `bash scripts/test.sh` is skipped: it is the command running this test;
- the demo runs `--steps 3` (its default trains for minutes) and does not reinstall: MEMLM_SKIP_INSTALL=1 makes
  scripts/install.sh a no-op, and the scratch copy's `.venv` is a symlink to this checkout's (reinstalling there
  would re-point the editable install at the copy, and needs a package registry the offline tests do not have);
- `../shared/data/wikitext-2` is replaced by a small WikiText-format folder written here, whose word vocabulary is
  exactly WikiText-2's 33,278 ids, so `model.vocab_size=33278` stands as written (the real test split takes a
  tiny model over a minute to evaluate on 2 cores).
The commands run in one bash process with `set -e`, so `source .venv/bin/activate` carries to the lines after it,
and with `.venv/bin` removed from PATH first: a README that forgets how memlm gets on the PATH fails here. The
test fails on a non-zero exit, a Python traceback in the output, or a NaN or infinity in any JSON they write.
About 2-3 minutes on 2 cores (the demo ~1 minute, the 2-rank launches most of the rest).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("", "Training and evaluation")  # "": the quick start, before the first "## " heading
WIKITEXT_VOCAB = 33_278  # WikiText-2's word vocabulary, as the README's model.vocab_size says
SKIPPED = ("bash scripts/test.sh",)
DEMO = "bash scripts/demo.sh"
DEMO_STEPS = "--steps 3"  # replaces any --steps N the README gives the demo
SUBSTITUTIONS = {"../shared/data/wikitext-2": "{wikitext}"}
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MLFLOW_TRACKING_URI", "VIRTUAL_ENV", "TORCHELASTIC_RUN_ID")


def readme_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks of SECTIONS, in order (comments and blank lines dropped)."""
    sections: dict[str, str] = {}
    title = ""
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            title = line[3:].strip()
        sections[title] = sections.get(title, "") + line
    commands = []
    for name in SECTIONS:
        assert name in sections, f"README has no section {name!r}"
        for block in re.findall(r"```bash\n(.*?)```", sections[name], flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    commands.append(line.strip())
    return commands


def substitute(command: str, wikitext: Path) -> str | None:
    """The command as run here (None: skipped); see the module docstring."""
    if any(command.startswith(s) for s in SKIPPED):
        return None
    code = code_of(command)
    for old, new in SUBSTITUTIONS.items():
        code = code.replace(old, new.format(wikitext=wikitext))
    if code.startswith(DEMO):
        code = f"{re.sub(r'--steps[ =]+[0-9]+', '', code).rstrip()} {DEMO_STEPS}"
    return code


def code_of(command: str) -> str:
    """The command without its trailing comment (the README sets comments off by two spaces or more)."""
    return re.split(r"\s{2,}#", command, maxsplit=1)[0].strip()


def write_wikitext(folder: Path, vocab: int = WIKITEXT_VOCAB) -> Path:
    """wiki.{train,valid,test}.tokens in WikiText's layout (` = Title = ` articles, one line per paragraph) whose
    train split holds vocab - 2 distinct words (the word tokenizer adds <unk> and <eos>): the titles' "=" and
    vocab - 3 others."""
    words = [f"w{i}" for i in range(vocab - 3)]
    rng = random.Random(0)
    folder.mkdir(parents=True)

    def article(title_words: list[str], body: list[str]) -> str:
        lines = [" ".join(body[i:i + 20]) for i in range(0, len(body), 20)]
        return f" \n = {' '.join(title_words)} = \n \n" + "".join(f" {line} \n" for line in lines)

    per_article = len(words) // 40 + 1
    train = "".join(article(words[i:i + 2], words[i:i + per_article]) for i in range(0, len(words), per_article))
    (folder / "wiki.train.tokens").write_text(train)
    for split in ("valid", "test"):
        text = "".join(article(rng.sample(words, 2), rng.sample(words, 300)) for _ in range(4))
        (folder / f"wiki.{split}.tokens").write_text(text)
    return folder


def scratch_clone(root: Path) -> Path:
    """What the README's commands read from a checkout (README, configs, scripts) and this checkout's .venv."""
    clone = root / "memlm"
    clone.mkdir()
    shutil.copy2(ROOT / "README.md", clone / "README.md")
    for folder in ("configs", "scripts"):
        shutil.copytree(ROOT / folder, clone / folder)
    (clone / ".venv").symlink_to(ROOT / ".venv")
    return clone


def non_finite(value, where: str = "") -> list[str]:
    """Paths of NaN or infinite numbers inside a parsed JSON value."""
    if isinstance(value, float) and not math.isfinite(value):
        return [where or "(top)"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_finite(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in non_finite(v, f"{where}[{i}]")]
    return []


def test_commands_are_found_and_substituted():
    """The extraction itself: the commands a newcomer types, and only the documented substitutions."""
    commands = readme_commands((ROOT / "README.md").read_text())
    codes = [code_of(c) for c in commands]
    assert codes[0].startswith(DEMO) and codes[1:3] == ["bash scripts/test.sh", "source .venv/bin/activate"], codes
    programs = [c.split()[0] for c in codes] + [" ".join(c.split()[:2]) for c in codes]
    for expected in ("memlm prepare", "memlm train", "memlm eval", "torchrun", "deepspeed", "memlm compare"):
        assert expected in programs, (expected, commands)
    run = [substitute(c, Path("/W")) for c in commands]
    assert run[1] is None and run[0].startswith(DEMO) and run[0].endswith(DEMO_STEPS) and run[0].count("--steps") == 1
    assert all("../shared" not in c for c in run if c) and sum("/W" in c for c in run if c) == 1


@pytest.mark.xdist_group("readme")
def test_readme_commands_run_as_written(tmp_path):
    clone = scratch_clone(tmp_path)
    wikitext = write_wikitext(tmp_path / "wikitext-2")
    commands = [substitute(c, wikitext) for c in readme_commands((clone / "README.md").read_text())]
    lines = ["set -euo pipefail"]
    for command in filter(None, commands):
        lines += [f"echo {json.dumps('### README: ' + command)}", command]
    script = tmp_path / "readme.sh"
    script.write_text("\n".join(lines) + "\n")

    venv_bin = str(ROOT / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != Path(venv_bin).resolve())
    env.update(MEMLM_SKIP_INSTALL="1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    log = tmp_path / "readme.log"
    with log.open("w") as out:
        proc = subprocess.run(["bash", str(script)], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=1200)
    output = log.read_text(errors="replace")
    ran = [line for line in output.splitlines() if line.startswith("### README: ")]
    assert proc.returncode == 0, f"{ran[-1] if ran else 'the first command'} failed ({proc.returncode}):\n" + \
        output[-6000:]
    assert len(ran) == sum(c is not None for c in commands)
    assert "Traceback (most recent call last)" not in output, output[-6000:]
    bad = {}
    for path in clone.rglob("*.json"):
        if ".venv" in path.parts:
            continue
        found = non_finite(json.loads(path.read_text()))
        if found:
            bad[str(path.relative_to(clone))] = found
    assert not bad, bad
    # What the training section promises: eval's JSON, and compare's table of the three tracked runs.
    assert list((clone / "runs" / "lamemo" / "eval").glob("test-*.json"))
    table = (clone / "compare" / "tiny" / "table.md").read_text()
    assert all(f"| {name} |" in table for name in ("lamemo", "txl", "txl-ds")), table
