"""The README drives this test: every command of every ```bash block and every ```python block, top to bottom, as
a user types them, in a scratch copy of the repository, in one shell.

Only what a CI machine cannot do as written, or what another test already runs as written, is changed, each change
listed here:
- SKIPPED commands do not run (each with its reason: the command running this test, a cluster, hours of training,
  a server that runs until Ctrl-C, the tiny sweep that tests/cluster/test_sweep.py runs as written); a SKIPPED
  entry that matches no README command fails the test, so the list cannot go stale;
- SUBSTITUTIONS replace text in the commands: `../shared/data/wikitext-2` becomes a small WikiText-format folder
  written here, of 2,000 words in sentences (the real test split takes a tiny model minutes to evaluate on 2 cores;
  `memlm train` takes the vocabulary's size from the data, as with the real one); the extrapolation's `--mult 1-10`
  becomes `--mult 1,2,10` (the shortest and the longest memory, 6 Ray tasks instead of 20); the curriculum's
  `--steps 500` per stage becomes `--steps 2`, and the long-context evaluation of its last stage runs 2 samples per
  cell at 512 and 1k tokens instead of 20 at 512 to 8k (issue 32: the curriculum line, skipped here, failed as
  written);
- the demo runs `--steps 3` (its default trains for minutes) and does not reinstall: MEMLM_SKIP_INSTALL=1 makes
  scripts/install.sh a no-op, and the scratch copy's `.venv` is a symlink to this checkout's (reinstalling there
  would re-point the editable install at the copy, and needs a package registry the offline tests do not have).
The commands run in one bash process with `set -e`, so `source .venv/bin/activate` carries to the lines after it,
and with `.venv/bin` removed from PATH first: a README that forgets how memlm gets on the PATH fails here. A python
block runs as `python FILE` at its place in the sequence. DS_ACCELERATOR is left unset, as on a user's machine.

The test fails on a non-zero exit, a Python traceback, a NaN or infinity in any JSON the commands write, library
noise on the console (NOISE), and where what a user reads differs from what the README promises: the Models
snippet's output, the tables `memlm compare` prints (the test ppl that `memlm eval` just logged, the evaluation at
4x memory in its own column, run names that tell runs apart) and `memlm analyze`'s lines in the README's form.
Cost, measured on a shared 2-core machine at load average 6: about 9 1/2 minutes, of which the quick start and
"Training and evaluation" (all this test ran before) 5 1/2; the 2-rank launches take about 2 minutes (the sweep,
now skipped, took as long), the demo and the first training about 1 minute each, the 17 other commands 2 minutes
together. The long-context commands (qa1's data, the curriculum's four 2-step stages, longeval on Ray) add about
1 1/2 minutes; the smaller stand-in vocabulary (2,000 words, not 33,278) saves some of it: 7 minutes at load 5.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT_VOCAB = 2_000  # words of the WikiText-format stand-in: `memlm train` takes its size from the data
SKIPPED = {
    "bash scripts/test.sh": "the command running this test",
    "memlm sweep sweeps/tiny_grid": "tests/cluster/test_sweep.py runs this sweep file through the same command "
                                    "(test_grid_sweep_with_a_killed_trial) and this command's own local Ray, "
                                    "--num-cpus 2 (test_interrupted_sweep_resumes_without_redoing_finished_trials)",
    "memlm sweep sweeps/lamemo_table5": "WikiText-103 and a GPU per trial",
    "memlm sweep SWEEP.yaml": "a sweep file of your own and a Ray cluster",
    "memlm extrapolate runs/* --mult 1,2,4,8 --address auto": "a Ray cluster and an MLflow server",
    "torchrun --nnodes 2": "two nodes, started together (tests/trainer/loop/test_multinode.py runs this form)",
    "deepspeed --hostfile hostfile --no_ssh": "two nodes, started together (tests/trainer/loop/test_multinode.py "
                                              "runs this form)",
    "ray start": "a Ray cluster's nodes (tests/cluster/test_multinode_ray.py starts two with these commands)",
    "memlm extrapolate /shared/runs/*": "a Ray cluster (tests/cluster/test_multinode_ray.py runs this form)",
    "memlm ui": "serves until Ctrl-C (tests/trainer/tracking/test_ui.py starts and stops it)",
    "python bench/": "hours of training (tests/bench/test_reproduce.py runs the experiments' smoke versions)",
}
DEMO = "bash scripts/demo.sh"
DEMO_STEPS = "--steps 3"  # replaces any --steps N the README gives the demo
SUBSTITUTIONS = {"../shared/data/wikitext-2": "{wikitext}", "--mult 1-10": "--mult 1,2,10",
                 # the curriculum's stages and the long-context evaluation of its last stage, smaller
                 "--steps 500": "--steps 2", "--lengths 512,1k,2k,4k,8k": "--lengths 512,1k",
                 "--samples 20": "--samples 2"}
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MLFLOW_TRACKING_URI", "VIRTUAL_ENV", "TORCHELASTIC_RUN_ID", "DS_ACCELERATOR")
# What libraries print that a user must not see on the console (memlm sends it to the run's library.log):
# DeepSpeed's accelerator guess at import, MLflow's INFO lines and run links, uvicorn's request log.
NOISE = {
    "DeepSpeed's accelerator warning": re.compile(r"Setting accelerator to CPU"),
    "MLflow INFO lines": re.compile(r"INFO mlflow|Creating initial MLflow database tables"),
    "MLflow run links": re.compile(r"View run .* at: |View experiment at: "),
    "uvicorn's request log": re.compile(r'"GET /[^"]*" \d{3}'),
    "transformers' progress bars and warnings": re.compile(r"Loading weights|is_gradient_checkpointing"),
}
# DeepSpeed's own launcher imports DeepSpeed before any memlm code runs: its accelerator guess is not ours to route.
NOISE_EXEMPT = {"deepspeed ": ("DeepSpeed's accelerator warning",)}
MARK = "### README: "


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(kind, code) in README order: ("bash", one command line) for each line of a ```bash block (comments, blank
    lines and continuations joined), ("python", the whole block) for a ```python block."""
    found = []
    for kind, block in re.findall(r"^```(bash|python)\n(.*?)^```", text, flags=re.S | re.M):
        if kind == "python":
            found.append(("python", block))
            continue
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(("bash", line.strip()))
    return found


def skip_reason(command: str) -> str | None:
    return next((why for prefix, why in SKIPPED.items() if command.startswith(prefix)), None)


def substitute(command: str, wikitext: Path) -> str | None:
    """The command as run here (None: skipped); see the module docstring."""
    if skip_reason(command):
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


def script_lines(blocks: list[tuple[str, str]], wikitext: Path, folder: Path) -> tuple[list[str], list[str]]:
    """(bash lines, the commands they run): each command echoed after MARK first, python blocks as files."""
    lines, ran = ["set -euo pipefail"], []
    for i, (kind, code) in enumerate(blocks):
        if kind == "python":
            # In a folder of their own: `python FILE` puts FILE's folder first on sys.path, and tmp_path holds the
            # scratch clone, named memlm, which `import memlm` would then find as a bare namespace package.
            (folder / "readme_blocks").mkdir(exist_ok=True)
            path = folder / "readme_blocks" / f"readme_block_{i}.py"
            path.write_text(code)
            command = f"python {path}"
        else:
            command = substitute(code, wikitext)
            if command is None:
                continue
        lines += [f"echo {shlex.quote(MARK + command)}", command]  # quoted: the echo expands nothing
        ran.append(command)
    return lines, ran


def write_wikitext(folder: Path, vocab: int = WIKITEXT_VOCAB) -> Path:
    """wiki.{train,valid,test}.tokens in WikiText's layout (` = Title = ` articles, one line per paragraph, sentences
    ending " . ", as the long-context tasks' background reads them) whose train split holds vocab - 2 distinct words
    (the word tokenizer adds <unk> and <eos>): "=", "." and vocab - 4 others."""
    words = [f"w{i}" for i in range(vocab - 4)]
    rng = random.Random(0)
    folder.mkdir(parents=True)

    def article(title_words: list[str], body: list[str]) -> str:
        sentences = [" ".join(body[i:i + 10]) + " ." for i in range(0, len(body), 10)]
        lines = [" ".join(sentences[i:i + 2]) for i in range(0, len(sentences), 2)]
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


def outputs_by_command(output: str) -> list[tuple[str, str]]:
    """[(command, what it printed)] from the script's output, split at the MARK lines."""
    parts = re.split(rf"^{re.escape(MARK)}(.*)$", output, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def noise_in(pieces: list[tuple[str, str]]) -> list[str]:
    found = []
    for command, printed in pieces:
        exempt = next((names for prefix, names in NOISE_EXEMPT.items() if command.startswith(prefix)), ())
        for name, pattern in NOISE.items():
            match = pattern.search(printed)
            if match and name not in exempt:
                found.append(f"{name} from `{command}`: {printed[match.start():match.start() + 150]!r}")
    return found


def markdown_rows(table: str) -> dict[str, dict[str, str]]:
    """A printed `memlm compare` table as {run: {header: cell}}."""
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]
    return {row["run"]: row for row in rows}


def readme_output_pattern(line: str) -> re.Pattern:
    """A line the README shows as output, as a pattern its numbers may differ in (a 3-step demo is not the
    README's 3,000-step one): "27%" matches "31%", "0.068" matches "0.104"."""
    return re.compile(re.sub(r"\d+", r"\\d+", re.escape(line.strip())))


def test_commands_are_found_and_substituted():
    """The extraction itself: the commands a newcomer types, and only the documented substitutions."""
    blocks = readme_blocks((ROOT / "README.md").read_text())
    commands = [code for kind, code in blocks if kind == "bash"]
    codes = [code_of(c) for c in commands]
    assert codes[0].startswith(DEMO) and codes[1:3] == ["bash scripts/test.sh", "source .venv/bin/activate"], codes
    assert [kind for kind, _ in blocks].count("python") >= 1  # the Models snippet
    programs = {c.split()[0] for c in codes} | {" ".join(c.split()[:2]) for c in codes}
    for expected in ("memlm prepare", "memlm train", "memlm eval", "torchrun", "deepspeed", "memlm compare",
                     "memlm sweep", "memlm extrapolate", "memlm generate", "memlm analyze", "memlm config"):
        assert expected in programs, (expected, commands)
    for prefix in SKIPPED:  # a skip that no longer matches a README line is stale
        assert any(c.startswith(prefix) for c in commands), f"SKIPPED {prefix!r} matches no README command"
    run = [substitute(c, Path("/W")) for c in commands]
    assert run[1] is None and run[0].startswith(DEMO) and run[0].endswith(DEMO_STEPS) and run[0].count("--steps") == 1
    assert all("../shared" not in c for c in run if c) and sum("/W" in c for c in run if c) == 2  # data, qa1
    # Nothing the README runs twice may write the same output twice (prepare refuses a filled --out).
    outs = [m.group(1) for c in run if c and c.startswith("memlm prepare") for m in [re.search(r"--out (\S+)", c)]]
    assert len(outs) == len(set(outs)), outs


def test_noise_and_table_readers_catch_what_they_are_for():
    """The checks below can fail: each noise pattern is caught in a command's output, the exemption only
    for DeepSpeed's launcher and only for its accelerator line."""
    accelerator = "[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. If you have GPU"
    pieces = outputs_by_command(f"{MARK}memlm eval runs/x\n{accelerator}\n"
                                f"{MARK}deepspeed --num_gpus 2 x\n{accelerator}\n"
                                f"{MARK}memlm train x\n🏃 View run x at: http://127.0.0.1:5000/#/experiments/1\n"
                                f"{MARK}memlm demo\n2026/11/25 13:37:45 INFO mlflow.store.db.utils: Creating initial\n"
                                f'{MARK}memlm ui\nINFO:     127.0.0.1:60336 - "GET / HTTP/1.1" 200 OK\n')
    found = noise_in(pieces)
    assert len(found) == 4 and "`deepspeed" not in " ".join(found), found
    rows = markdown_rows("| run | test ppl |\n|---|---|\n| lamemo-3f9a2c | 12.50 |\n")
    assert rows == {"lamemo-3f9a2c": {"run": "lamemo-3f9a2c", "test ppl": "12.50"}}
    pattern = readme_output_pattern("  layer 0: attention on the memory 27%; mean max attention weight  memory 0.068")
    assert pattern.search("  layer 0: attention on the memory 5%; mean max attention weight  memory 0.104")
    assert not pattern.search("  layer 0: mean max attention weight  memory 0.068")


def _compare_rows(folder: Path) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
    """(Markdown rows by run name, CSV rows by run id) of a `memlm compare` output folder."""
    with open(folder / "table.csv", newline="") as f:
        by_id = {row["run_id"]: row for row in csv.DictReader(f)}
    return markdown_rows((folder / "table.md").read_text()), by_id


@pytest.mark.slow
@pytest.mark.xdist_group("readme")
def test_readme_commands_run_as_written(tmp_path):
    clone = scratch_clone(tmp_path)
    wikitext = write_wikitext(tmp_path / "wikitext-2")
    readme = (clone / "README.md").read_text()
    lines, ran = script_lines(readme_blocks(readme), wikitext, tmp_path)
    script = tmp_path / "readme.sh"
    script.write_text("\n".join(lines) + "\n")

    venv_bin = str(ROOT / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != Path(venv_bin).resolve())
    env.update(MEMLM_SKIP_INSTALL="1", OMP_NUM_THREADS="1")
    import torch

    if torch.cuda.is_available():  # a developer's GPU machine: the README's 2-rank CPU launches stay on CPU
        env["DS_ACCELERATOR"] = "cpu"
    log = tmp_path / "readme.log"
    with log.open("w") as out:
        proc = subprocess.run(["bash", str(script)], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=1500)
    output = log.read_text(errors="replace")
    pieces = outputs_by_command(output)
    assert proc.returncode == 0, f"{pieces[-1][0] if pieces else 'the first command'} failed ({proc.returncode}):\n" \
        + output[-6000:]
    assert [command for command, _ in pieces] == ran
    assert "Traceback (most recent call last)" not in output, output[-6000:]
    bad = {}
    for path in clone.rglob("*.json"):
        if ".venv" in path.parts or "tune" in path.parts:  # Ray Tune's own state: pickles and JSON lines
            continue
        found = non_finite(json.loads(path.read_text()))
        if found:
            bad[str(path.relative_to(clone))] = found
    assert not bad, bad
    assert not noise_in(pieces), noise_in(pieces)
    printed = dict(pieces)

    # Models: the snippet runs and prints the [B, N] per-token NLL's shape.
    snippet = next(command for command in ran if command.startswith("python "))
    assert "torch.Size([4, 8])" in printed[snippet], printed[snippet]

    # Training and evaluation: compare's first table shows the 4x-memory evaluation in its own column, labelled.
    lamemo_id = (clone / "runs" / "lamemo" / "mlflow_run_id").read_text().strip()
    at_4x = json.loads(next((clone / "runs" / "lamemo" / "eval").glob("test-*-tgt8-mem32.json")).read_text())
    first, by_id = _compare_rows(clone / "compare" / "tiny")
    name = by_id[lamemo_id]["run"]
    assert re.fullmatch(rf"lamemo-{lamemo_id[:6]}", name), name  # arch (the folder's name) + the run id's start
    # no run has an as-trained test ppl yet: that column is left out, the 4x one shown
    assert "test ppl" not in first[name] and first[name]["test ppl, other lengths"] == f"{at_4x['ppl']:.2f} (N=8 M=32)"
    trained = {(clone / "runs" / d / "mlflow_run_id").read_text().strip() for d in ("lamemo", "txl", "txl-ds")}
    assert trained <= set(by_id) and len({by_id[i]["run"] for i in trained}) == 3  # three rows, three names
    # Comparing runs: after the as-trained evaluation the table's test ppl is the one eval logged, the 4x one stays.
    as_trained = json.loads((clone / "runs" / "lamemo" / "eval" / "test-step20-tgt8-mem8.json").read_text())
    second, _ = _compare_rows(clone / "results" / "tiny")
    assert second[name]["test ppl"] == f"{as_trained['ppl']:.2f}"
    assert second[name]["test ppl, other lengths"] == first[name]["test ppl, other lengths"]
    demo, demo_by_id = _compare_rows(clone / "compare" / "memlm-demo")
    assert len(demo) == len(demo_by_id) == 3 and all(re.fullmatch(r"demo-(transformer|txl|lamemo)-stdlib-bytes-"
                                                                  r"[0-9a-f]{6}", run) for run in demo), list(demo)
    # The demo as written (3 steps here): its table, memory-effect lines, MLflow runs and where to look next
    # (tests/cli/test_demo.py checks a second demo into the same folder, on one arch).
    check_demo_output(next(text for command, text in pieces if command.startswith(DEMO)), clone / "mlflow.db")

    # The two launchers (2 ranks each, as written) train the same run: every step, the same loss and tokens, and
    # a 2-rank checkpoint (this was tests/trainer/loop/test_launchers.py's own pair of launches).
    launched = {d: [json.loads(line) for line in (clone / "runs" / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("txl", "txl-ds")}
    by_torchrun, by_deepspeed = launched["txl"], launched["txl-ds"]
    assert [r["step"] for r in by_torchrun] == [r["step"] for r in by_deepspeed] == list(range(1, 21))
    assert [r["tokens"] for r in by_torchrun] == [r["tokens"] for r in by_deepspeed]
    for a, b in zip(by_torchrun, by_deepspeed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5), (a, b)
    for d in launched:
        meta = json.loads((clone / "runs" / d / "checkpoints" / "global_step20" / "meta.json").read_text())
        assert meta.get("world_size") == 2, (d, meta)

    # Training takes model.vocab_size from the word data's manifest, and says so (issue 32).
    first_train = next(text for command, text in pieces if command.startswith("memlm train tiny/lamemo"))
    assert (f"memlm train: model.vocab_size {WIKITEXT_VOCAB:,} from data/wikitext-2's word tokenizer (tiny/lamemo "
            "says 256)") in first_train, first_train[-3000:]

    # Long-context accuracy: the curriculum's four stages as written, each from the one before; longeval scores
    # the last one at both lengths.
    for stage in ("stage0-1seg", "stage1-2seg", "stage2-4seg", "stage3-8seg"):
        rows = (clone / "runs" / "armt-passkey" / stage / "metrics.jsonl").read_text().splitlines()
        assert json.loads(rows[-1])["step"] == 2, stage
    summary = json.loads((clone / "longeval" / "summary.json").read_text())
    assert [r["length"] for r in summary["runs"]["stage3-8seg"]["results"]] == [512, 1024], summary

    # Generation and analysis: analyze prints the lines the README shows, and its percentages are the JSON's.
    shown = re.search(r"the two `analyze` commands print.*?```text\n(.*?)```", readme, flags=re.S).group(1)
    analyzed = "".join(text for command, text in pieces if command.startswith("memlm analyze"))
    for line in shown.splitlines():
        assert readme_output_pattern(line).search(analyzed), (line, analyzed)
    for arch in ("txl", "lamemo"):
        result = json.loads((clone / "runs" / "demo" / "runs" / arch / "analysis" / "analysis-test.json").read_text())
        for layer, mass in enumerate(result["attention_intervals"]["memory_mass"]):
            assert f"layer {layer}: attention on the memory {100 * mass:.0f}%" in analyzed


def check_demo_output(out: str, store: Path) -> None:
    """The demo's printed table (one row per arch, finite, bits per byte from the same NLL), its equal-tokens line,
    each memory model's effect against the baseline as the table has it, and its MLflow runs, finished."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(transformer|txl|lamemo)\s+([\d,]+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", line)
        if m:
            rows[m.group(1)] = [float(x.replace(",", "")) for x in m.groups()[1:]]
    assert set(rows) == {"transformer", "txl", "lamemo"}, out
    for arch, values in rows.items():
        assert all(math.isfinite(v) for v in values), (arch, values)
        params, steps, loss, nll, bpc, rate = values
        assert params > 0 and steps == 3 and 0 < nll < 10 and rate > 0
        assert abs(bpc - nll / math.log(2)) < 1e-3  # bytes: bits per byte, from the same NLL
    equal = re.search(r"Equal steps and tokens for every arch \(3 steps, ([\d,]+) training tokens each", out)
    results = json.loads((store.parent / "runs" / "demo" / "results.json").read_text())
    assert equal and {r["tokens"] for r in results} == {int(equal.group(1).replace(",", ""))}, out  # one number
    for arch in ("txl", "lamemo"):
        m = re.search(rf"^  {arch}\s+([+-]\d+\.\d+) nats/token", out, re.M)
        assert m, out
        assert abs(float(m.group(1)) - (rows[arch][3] - rows["transformer"][3])) < 2e-3
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    runs = client.search_runs([client.get_experiment_by_name("memlm-demo").experiment_id])
    by_arch = {r.data.tags.get("arch"): r for r in runs}
    assert set(by_arch) == {"transformer", "txl", "lamemo"}
    for r in by_arch.values():
        assert r.info.status == "FINISHED" and "loss" in r.data.metrics and "test_nll" in r.data.metrics
        assert r.info.run_name in out  # the demo says which runs are its own
    # Where to look next: memlm's saved view of the experiment's runs table in `memlm ui`, and `memlm compare`.
    experiment_id = client.get_experiment_by_name("memlm-demo").experiment_id
    view = (f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs?viewStateShareKey=memlm"
            "&workflowType=machine_learning")
    assert re.search(rf"memlm ui   \(then {re.escape(view)}\)", out), out
    assert re.search(r"memlm compare --experiment memlm-demo", out), out
    # MLflow's start-up lines of the fresh store go to the demo's library.log, not to the console.
    assert "Creating initial MLflow database tables" in (store.parent / "runs" / "demo" / "library.log").read_text()

