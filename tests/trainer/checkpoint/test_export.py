"""Weights that leave memlm: `memlm export` folders, the loader, and DeepSpeed's own zero_to_fp32.py.

One tiny ZeRO-2 run (its fp32 master weights live in the optimizer partition, as at scale) is exported in fp32 and
bf16. Every file of an export is opened by the parser of its kind and none is a pickle or a torch zip; the stored
weights are the checkpoint's own (bf16: their bf16 rounding); `memlm eval` and `memlm generate` give the same NLL
and text from the folder as from the run; `from memlm import load_pretrained` works in a fresh interpreter without
`import memlm` loading torch; folders that do not fit (another arch's weights, an edited config, data of another
tokenizer, an --out that holds files) are refused in one line with exit 2. A ZeRO-0 LaMemo run exports too.
zero_to_fp32.py, as DeepSpeed copies it into the checkpoints folder, runs there (a 2-rank run: both partitions) and
its output loads strictly into memlm's model; its --safe_serialization form on a tied head is DeepSpeed 0.19.8's
known failure, asserted so that an upgrade that fixes it is noticed.
Cost: ~45 s on 2 cores (two 2-step trainings in-process, one 2-rank torchrun, four subprocesses that import
torch and DeepSpeed).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from memlm.cli import main
from memlm.data_pipeline.tokenizers import load_tokenizer
from memlm.models import build_model
from memlm.trainer.checkpoint.pretrained import ExportError
from memlm.trainer.checkpoint.run_loader import load_pretrained
from memlm.trainer.checkpoint.store import find_checkpoint
from memlm.trainer.checkpoint.weights import load_weights
from memlm.trainer.config.run_config import load_config
from support.training import REPO, child_env, make_data, torchrun, train_in_process

# One worker builds the module's runs once (scripts/test.sh runs pytest with --dist loadgroup).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("export")]

PICKLE_PROTOCOL_2_PLUS = b"\x80"  # every pickle torch or Python writes today starts with PROTO
ZIP = b"PK\x03\x04"  # torch.save's format: a zip holding a pickle


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("export")
    data = make_data(root)
    run_dir = root / "run"
    train_in_process("txl", data, run_dir, deepspeed__zero_stage=2, train__steps=2, train__save_every=2)
    exports = {}
    for dtype in ("fp32", "bf16"):
        exports[dtype] = root / f"export-{dtype}"
        assert main(["export", str(run_dir), "--out", str(exports[dtype]), "--dtype", dtype]) == 0
    ckpt_dir, tag = find_checkpoint(run_dir)
    return {"root": root, "data": data, "run": run_dir, "weights": load_weights(ckpt_dir, tag), **exports}


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors under every name, tied ones included (as pretrained.py reads them)."""
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        aliases = json.loads(handle.metadata()["aliases"])
    tensors = load_file(str(path))
    return {**tensors, **{name: tensors[target] for name, target in aliases.items()}}


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memlm: error: "), err
    return err[0]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_file_is_opened_and_none_is_a_pickle(run, dtype):
    folder = run[dtype]
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    names = {str(p.relative_to(folder)) for p in files}
    assert names == {"model.safetensors", "config.yaml", "memlm-export.json", "README.md", "tokenizer/tokenizer.json"}
    for path in files:
        head = path.read_bytes()[:4]
        assert not head.startswith(PICKLE_PROTOCOL_2_PLUS) and head != ZIP, path
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as handle:
                assert handle.metadata()["arch"] == "txl" and handle.metadata()["dtype"] == dtype
                assert all(handle.get_slice(k).get_dtype() in ("F32", "BF16") for k in handle.keys())
        elif path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        elif path.suffix == ".yaml":
            assert load_config(path).model.arch == "txl"  # the same config the run trained with
            assert yaml.safe_load(path.read_text()) == yaml.safe_load((run["run"] / "config.yaml").read_text())
        else:
            assert path.suffix == ".md" and "not evaluated" in path.read_text(encoding="utf-8")
    assert load_tokenizer(folder / "tokenizer").identity() == load_tokenizer(run["data"] / "tokenizer").identity()
    marker = json.loads((folder / "memlm-export.json").read_text())
    assert (marker["arch"], marker["dtype"], marker["step"], marker["vocab_size"]) == ("txl", dtype, 2, 256)


def test_stored_weights_are_the_checkpoints(run):
    fp32, bf16 = _stored(run["fp32"]), _stored(run["bf16"])
    assert fp32.keys() == bf16.keys() == run["weights"].keys()
    for name, weight in run["weights"].items():
        assert fp32[name].dtype == torch.float32 and torch.equal(fp32[name], weight), name
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], weight.to(torch.bfloat16)), name
    # The tied softmax head is stored once: the bf16 file is about half the fp32 one, not more.
    sizes = {d: (run[d] / "model.safetensors").stat().st_size for d in ("fp32", "bf16")}
    assert sizes["fp32"] < 4 * sum(w.numel() for w in run["weights"].values())
    assert sizes["bf16"] < 0.55 * sizes["fp32"]


def test_eval_and_generate_give_the_runs_results(run, capsys):
    def eval_json(folder: Path) -> dict:
        assert main(["eval", str(folder), "--split", "test"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    def generated(folder: Path) -> str:
        assert main(["generate", str(folder), "--prompt", "the cat sat", "--tokens", "40", "--seed", "3"]) == 0
        return capsys.readouterr().out

    before = sorted(p.name for p in run["fp32"].rglob("*"))
    from_run, from_export = eval_json(run["run"]), eval_json(run["fp32"])
    assert from_export == from_run  # the same NLL, tokens, step: the same weights, computed the same way
    bf16 = eval_json(run["bf16"])
    assert bf16["tokens"] == from_run["tokens"] and abs(bf16["nll"] - from_run["nll"]) < 0.05
    assert generated(run["fp32"]) == generated(run["run"])
    assert sorted(p.name for p in run["fp32"].rglob("*")) == before  # eval wrote nothing into the export
    # Exported after its test evaluation, the card quotes the run's own result.
    card = run["root"] / "card"
    assert main(["export", str(run["run"]), "--out", str(card)]) == 0
    text = (card / "README.md").read_text()
    row = f"| test | {from_run['tgt_len']} | {from_run['mem_len']} | {from_run['tokens']:,} | {from_run['ppl']:.3f} |"
    assert "not evaluated" not in text and row in text


def test_longeval_and_analyze_read_an_export_as_its_run(run, tmp_path, capsys):
    """Every command that reads a trained run loads it one way (trainer/checkpoint/run_loader.py): longeval's scorer
    and analyze took a run folder only (they looked for its checkpoints) and now read an export folder as its run;
    analyze writes its files elsewhere, never into the export."""
    from memlm.trainer.inference.analyze import analyze_run
    from memlm.trainer.inference.longeval import evaluate_length

    from_run = evaluate_length(run["run"], "passkey", {}, 128, 1, 2)
    assert from_run["step"] == 2  # the checkpoint global_step2
    assert evaluate_length(run["fp32"], "passkey", {}, 128, 1, 2) == from_run
    views = [analyze_run(folder, segments=2, out_dir=tmp_path / name, track=False)
             for name, folder in (("run", run["run"]), ("export", run["fp32"]))]
    for view in views:
        view.pop("files")
    assert views[1] == views[0] and views[0]["step"] == 2
    before = sorted(p.name for p in run["fp32"].rglob("*"))
    capsys.readouterr()  # what loading the run's checkpoint printed
    assert main(["analyze", str(run["fp32"]), "--segments", "2"]) == 2
    assert "is an export folder, which analyze does not write into" in _one_error_line(capsys)
    assert sorted(p.name for p in run["fp32"].rglob("*")) == before


def test_one_line_loader_in_a_fresh_interpreter(run):
    """`import memlm` stays free of torch; the loader gives a model whose weights are the checkpoint's."""
    out = run["root"] / "loaded.safetensors"
    script = ("import sys, memlm\n"
              "assert 'torch' not in sys.modules\n"
              "from memlm import load_pretrained\n"
              f"model, tokenizer = load_pretrained({str(run['fp32'])!r}, expect_arch='txl')\n"
              "from safetensors.torch import save_file\n"
              f"save_file({{k: v.clone() for k, v in model.state_dict().items()}}, {str(out)!r})\n"
              "print(type(model).__name__, tokenizer.kind, model.training)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[1:] == ["bytes", "False"]
    loaded = load_file(str(out))
    assert loaded.keys() == run["weights"].keys()
    assert all(torch.equal(loaded[k], w) for k, w in run["weights"].items())


def test_zero_0_run_of_another_arch(run, tmp_path):
    """ZeRO-0 (the tiny presets'; no optimizer partitions: the model states file is read) and LaMemo's parameters."""
    run_dir = tmp_path / "lamemo"
    train_in_process("lamemo", run["data"], run_dir, train__steps=2, train__save_every=2)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 0
    model, tokenizer = load_pretrained(tmp_path / "export", expect_arch="lamemo", expect_vocab_size=256)
    weights = load_weights(*find_checkpoint(run_dir))
    assert model.state_dict().keys() == weights.keys()
    assert all(torch.equal(model.state_dict()[k], w) for k, w in weights.items())
    # DeepSpeed writes zero_to_fp32.py for ZeRO 1-3 only, and the README says so (issue 32: it said the script
    # worked, and every tiny preset is ZeRO 0)
    assert not (run_dir / "checkpoints" / "zero_to_fp32.py").exists()
    assert (run["run"] / "checkpoints" / "zero_to_fp32.py").is_file()  # the ZeRO-2 run's
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "`zero_to_fp32.py` is for ZeRO 1-3 runs" in readme and "A ZeRO 0 run (every tiny preset) has neither the " \
        "script nor partitions: `memlm export` it." in readme


def test_another_arch_or_vocabulary_is_refused_in_one_line(run, capsys):
    with pytest.raises(ExportError, match="holds a txl model, not lamemo") as exc:
        load_pretrained(run["fp32"], expect_arch="lamemo")
    with pytest.raises(ExportError, match="vocabulary of 256 ids") as exc2:
        load_pretrained(run["fp32"], expect_vocab_size=33278)
    assert "\n" not in str(exc.value) + str(exc2.value)

    # Data of another tokenizer (a word vocabulary of the same corpus).
    from memlm.data_pipeline.prepare import prepare

    words = run["root"] / "words"
    prepare("textdir", run["root"] / "corpus", words, tokenizer="word", workers=1, progress=False)
    assert main(["eval", str(run["fp32"]), "--split", "test", "--data", str(words)]) == 2
    line = _one_error_line(capsys)
    assert "word tokenizer" in line and "bytes one of 256 ids" in line and "--tokenizer-from" in line


def test_folders_whose_files_disagree_are_refused(run, capsys, tmp_path):
    # Another arch's weights under this config: named by the file's own metadata.
    other = tmp_path / "other-arch"
    shutil.copytree(run["fp32"], other)
    cfg = load_config(run["run"] / "config.yaml", {"model.arch": "lamemo"})
    lamemo = build_model(cfg.model)
    save_file({k: v.clone() for k, v in lamemo.state_dict().items()}, str(other / "model.safetensors"),
              metadata={"arch": "lamemo", "aliases": "{}"})
    assert main(["generate", str(other), "--prompt", "the cat"]) == 2
    assert "holds lamemo weights but" in _one_error_line(capsys)

    # A config edited after export: the first parameter whose shape differs is named.
    edited = tmp_path / "edited"
    shutil.copytree(run["fp32"], edited)
    tree = yaml.safe_load((edited / "config.yaml").read_text())
    tree["model"]["d_inner"] = 2 * tree["model"]["d_inner"]
    (edited / "config.yaml").write_text(yaml.safe_dump(tree))
    wider = build_model(load_config(edited / "config.yaml").model).state_dict()
    first = next(k for k, v in wider.items() if v.shape != run["weights"][k].shape)
    assert main(["eval", str(edited), "--split", "test"]) == 2
    line = _one_error_line(capsys)
    assert f"parameter {first} is {list(run['weights'][first].shape)} in the file" in line

    # An export that travelled without its data: eval says how to give it (generate needs none).
    moved = tmp_path / "moved"
    shutil.copytree(run["fp32"], moved)
    tree = yaml.safe_load((moved / "config.yaml").read_text())
    tree["data"]["path"] = str(tmp_path / "gone")
    (moved / "config.yaml").write_text(yaml.safe_dump(tree))
    assert main(["eval", str(moved), "--split", "test"]) == 2
    assert "--data DATA_DIR" in _one_error_line(capsys)
    assert main(["generate", str(moved), "--prompt", "the cat", "--tokens", "3"]) == 0


def test_out_that_holds_files_is_refused_unless_an_earlier_export(run, capsys, tmp_path):
    assert main(["export", str(run["run"]), "--out", str(run["fp32"])]) == 2
    assert "--overwrite" in _one_error_line(capsys)
    assert main(["export", str(run["run"]), "--out", str(run["run"]), "--overwrite"]) == 2
    assert "is not a memlm export" in _one_error_line(capsys)
    assert (run["run"] / "checkpoints").is_dir()  # nothing was deleted
    again = tmp_path / "again"
    shutil.copytree(run["bf16"], again)
    assert main(["export", str(run["run"]), "--out", str(again), "--overwrite"]) == 0
    assert json.loads((again / "memlm-export.json").read_text())["dtype"] == "fp32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no temporary folder left beside it


@pytest.fixture(scope="module")
def two_ranks(run) -> Path:
    """A 2-rank ZeRO-2 run (each rank's optimizer partition holds half the fp32 master weights), untied head."""
    out = run["root"] / "two-ranks"
    torchrun("txl", run["data"], out, nproc=2, deepspeed__zero_stage=2, train__steps=2, train__save_every=2,
             model__tie_weight="false")
    return out


def _zero_to_fp32(run_dir: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    """DeepSpeed's documented use, `python zero_to_fp32.py . OUT`, in the folder it copied the script into."""
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "zero_to_fp32.py").is_file()
    return subprocess.run([sys.executable, "zero_to_fp32.py", ".", str(out), *flags], cwd=ckpt, env=child_env(),
                          capture_output=True, text=True, timeout=300)


def _loads_strictly(run_dir: Path, state: dict[str, torch.Tensor]) -> None:
    model = build_model(load_config(run_dir / "config.yaml").model)
    model.load_state_dict(state, strict=True)
    weights = load_weights(*find_checkpoint(run_dir))
    assert all(torch.equal(model.state_dict()[k], w) for k, w in weights.items())


def test_zero_to_fp32_script_of_a_two_rank_run(two_ranks, tmp_path):
    """--safe_serialization (safetensors, through huggingface_hub's sharding) on partitions from two ranks; memlm
    export of the same checkpoint stores the same weights."""
    proc = _zero_to_fp32(two_ranks, tmp_path / "out", "--safe_serialization")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _loads_strictly(two_ranks, load_file(str(tmp_path / "out" / "model.safetensors")))
    assert main(["export", str(two_ranks), "--out", str(tmp_path / "export")]) == 0
    _loads_strictly(two_ranks, _stored(tmp_path / "export"))


def test_zero_to_fp32_script_with_tied_weights(run, tmp_path):
    """The default form (torch.save) works on a tied head (the preset's); --safe_serialization does not in
    DeepSpeed 0.19.8: it keeps the tied pair as one tensor under two names, which safetensors refuses (upstream
    deepspeedai/DeepSpeed PR #8376). memlm export stores it once with its other name in the metadata. When a
    DeepSpeed upgrade fixes this, this test fails: drop the note in docs/export.md."""
    proc = _zero_to_fp32(run["run"], tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _loads_strictly(run["run"], torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True))
    proc = _zero_to_fp32(run["run"], tmp_path / "safe", "--safe_serialization")
    assert proc.returncode != 0 and "Some tensors share memory" in proc.stderr
