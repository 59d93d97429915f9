"""`memlm eval` on real prepared data and real DeepSpeed checkpoints (docs/design.md §4, §8).

The checkpoints are made here, not by the trainer: one child process (this file run as a script) wraps tiny
models in deepspeed.initialize (CPU accelerator, gloo, world 1), takes one optimizer step so the weights differ
from their initialisation, and saves with engine.save_checkpoint, next to config.yaml, `latest` and a plain
torch copy of the weights (weights.pt) that the slow reference loads without DeepSpeed.

Cost: the first deepspeed.initialize on a machine JIT-builds the deepspeed_shm_comm op (~40-60 s, cached in
TORCH_EXTENSIONS_DIR afterwards); the rest of the file takes ~30 s on 2 cores.

The reference scores each document alone, from an empty memory, batch of one, in corpus order: no lanes, no
ranks, no stream. Summed over documents it must equal the lane/rank evaluation (float summation order aside).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# `-m 'not slow'` leaves these out: its runs are trained in a subprocess: 5 min in all on 2 busy cores
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
# run name -> (preset, ZeRO stage)
RUNS = {"txl": ("tiny/txl", 0), "txl_zero2": ("tiny/txl", 2), "txl_zero3": ("tiny/txl", 3),
        "lamemo": ("tiny/lamemo", 0), "rmt": ("tiny/rmt", 0)}
REL = 1e-6


def _documents(split: str) -> list[str]:
    """Varied lengths: shorter than one segment, exactly one, many; multi-line text (several boundaries)."""
    words = "memory lanes carry documents across segments but never from one document to the next".split()
    docs = []
    for i, n in enumerate([1, 3, 7, 2, 30, 12, 5, 60, 9, 18, 4]):
        line = " ".join(words[(i + k) % len(words)] for k in range(n))
        docs.append(line if i % 3 else f"{line}\n{split} {i}")
    return docs


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from memlm.data_pipeline.prepare import prepare

    corpus = tmp_path_factory.mktemp("corpus")
    for split in ("train", "valid", "test"):
        (corpus / split).mkdir()
        for i, text in enumerate(_documents(split)):
            (corpus / split / f"{i:03d}.txt").write_text(text)
    out = tmp_path_factory.mktemp("data") / "bytes"
    # small shards: documents of one split span several shard files
    prepare("textdir", corpus, out, tokenizer="bytes", shard_tokens=200, workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DEEPSPEED_TIMEOUT": "2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, "make-runs", str(root), str(data)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


def _manifest(data: Path) -> dict:
    return json.loads((data / "manifest.json").read_text())


def _reference(run: Path, data: Path, split: str = "valid", **eval_overrides) -> tuple[float, int, int]:
    """(summed NLL, tokens, documents): every document alone from an empty memory, batch of one."""
    from memlm.data_pipeline.shards import read_shard
    from memlm.models import build_model
    from memlm.trainer.config.run_config import eval_model_config, load_config, override_config

    cfg = load_config(run / "config.yaml")
    cfg = override_config(cfg, {f"eval.{k}": v for k, v in eval_overrides.items()})
    mcfg = eval_model_config(cfg)
    model = build_model(mcfg).eval()
    model.load_state_dict(torch.load(run / "weights.pt"), strict=True)
    manifest = _manifest(data)
    boundary = manifest["tokenizer"]["boundary_id"]
    n = mcfg.tgt_len
    total, tokens, docs = 0.0, 0, 0
    with torch.no_grad():
        for shard in manifest["splits"][split]["shards"]:
            for doc in read_shard(data / shard["path"]):
                ids = torch.tensor(doc["tokens"].astype("int64"))
                inputs = torch.cat([torch.tensor([boundary]), ids[:-1]])  # predict every token of the document
                memory = model.init_memory(batch_size=1)
                for start in range(0, len(ids), n):
                    x = torch.zeros(1, n, dtype=torch.long)  # padding id 0: the stream pads differently
                    y = torch.full((1, n), -100, dtype=torch.long)
                    part = slice(start, min(start + n, len(ids)))
                    x[0, : part.stop - start], y[0, : part.stop - start] = inputs[part], ids[part]
                    out = model(x, memory, reset=torch.tensor([start == 0]), targets=y)
                    memory = out.memory
                    total += float(out.nll.double().sum())
                tokens += len(ids)
                docs += 1
    return total, tokens, docs


def _close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["txl", "lamemo", "rmt"])
def test_matches_per_document_reference(arch, runs, data):
    from memlm.trainer.inference.evaluate import evaluate_run

    run = runs / arch
    ref_nll, ref_tokens, ref_docs = _reference(run, data)
    manifest = _manifest(data)["splits"]["valid"]
    assert ref_tokens == manifest["tokens"]
    for lanes in (1,):
        result = evaluate_run(run, lanes=lanes, json_path=run / f"lanes{lanes}.json")
        assert result["tokens"] == manifest["tokens"] and result["documents"] == manifest["documents"]
        assert _close(result["nll"] * result["tokens"], ref_nll, 1e-5), (lanes, result["nll"], ref_nll / ref_tokens)
        assert result["arch"] == arch and result["step"] == 1
        assert (result["tgt_len"], result["mem_len"]) == (8, 8 if arch != "rmt" else 0)
        assert json.loads((run / f"lanes{lanes}.json").read_text()) == result


def test_default_json_path_and_keys(runs):
    from memlm.trainer.inference.evaluate import RESULT_KEYS, evaluate_run

    result = evaluate_run(runs / "txl", split="test")
    path = runs / "txl" / "eval" / "test-step1-tgt8-mem8.json"
    assert json.loads(path.read_text()) == result
    assert tuple(result) == RESULT_KEYS
    assert abs(result["bpc"] - result["nll"] / 0.6931471805599453) < 1e-12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_match_one(runs, data, tmp_path):
    """torchrun, 2 gloo ranks, one lane each (documents dealt unevenly): the same tokens (the manifest's) and the same
    NLL as one process. Four lanes under 2 ranks: tests/trainer/loop/test_launchers.py, under the deepspeed launcher."""
    from memlm.trainer.inference.evaluate import evaluate_run

    run = runs / "txl"
    one = evaluate_run(run, lanes=4, json_path=tmp_path / "one.json")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for lanes in (1,):
        out = tmp_path / f"two{lanes}.json"
        proc = subprocess.run([*torchrun, "-m", "memlm", "eval", str(run), "--lanes", str(lanes), "--json", str(out)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        two = json.loads(out.read_text())
        printed = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        assert len(printed) == 1 and json.loads(printed[0]) == two  # printed once, by rank 0
        assert two["tokens"] == _manifest(data)["splits"]["valid"]["tokens"] == one["tokens"]
        assert two["documents"] == one["documents"]
        assert _close(two["nll"], one["nll"]), (two["nll"], one["nll"])


def test_memory_length_overrides(runs, data, capsys):
    """--mem-len / --mem-mult / --tgt-len reach the model (the weights load at any length) and the JSON."""
    from memlm import cli

    run = runs / "txl"
    cases = [(["--mem-len", "24"], 8, 24, {"mem_len": 24}), (["--mem-mult", "2"], 8, 16, {"mem_mult": 2.0}),
             (["--tgt-len", "4", "--mem-mult", "3"], 4, 12, {"tgt_len": 4, "mem_mult": 3.0})]
    for flags, tgt, mem, overrides in cases:
        assert cli.main(["eval", str(run), "--lanes", "3", "--json", str(run / "m.json"), *flags]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (result["tgt_len"], result["mem_len"]) == (tgt, mem)
        assert result["tokens"] == _manifest(data)["splits"]["valid"]["tokens"]
        ref_nll, _, _ = _reference(run, data, **overrides)
        assert _close(result["nll"] * result["tokens"], ref_nll, 1e-5), flags
    # LaMemo: every layer's memory follows the longer length
    assert cli.main(["eval", str(runs / "lamemo"), "--mem-mult", "3", "--json", str(run / "l.json")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mem_len"] == 24


def test_zero3_checkpoint_loads(runs, data):
    """ZeRO-3 (partitioned parameters) through zero_to_fp32: the saved weights, scored as the reference does."""
    from memlm.trainer.inference.evaluate import evaluate_run

    result = evaluate_run(runs / "txl_zero3", lanes=3, json_path=runs / "z3.json")
    ref_nll, ref_tokens, _ = _reference(runs / "txl_zero3", data)
    assert result["tokens"] == ref_tokens
    assert _close(result["nll"] * result["tokens"], ref_nll, 1e-5)


def test_zero0_and_zero2_agree(runs):
    """The same training step saved by ZeRO-0 (module weights) and ZeRO-2 (partitioned fp32) evaluates alike."""
    from memlm.trainer.inference.evaluate import evaluate_run

    zero0 = evaluate_run(runs / "txl", lanes=2, json_path=runs / "z0.json")
    zero_n = evaluate_run(runs / "txl_zero2", lanes=2, json_path=runs / "z2.json")
    assert (zero0["tokens"], zero0["documents"]) == (zero_n["tokens"], zero_n["documents"])
    assert _close(zero0["nll"], zero_n["nll"], 1e-6), (zero0["nll"], zero_n["nll"])
    # and both loaded the trained weights, not an initialisation: the plain copies agree with the checkpoints
    w0, w2 = torch.load(runs / "txl" / "weights.pt"), torch.load(runs / "txl_zero2" / "weights.pt")
    assert all(torch.allclose(w0[k], w2[k], atol=1e-6) for k in w0)


def _error_line(argv, capsys) -> str:
    from memlm import cli

    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memlm: error: ") and "\n" not in err, err
    return err


def test_user_mistakes_are_one_line(runs, tmp_path, capsys):
    import shutil

    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copy(runs / "txl" / "config.yaml", no_ckpt / "config.yaml")
    assert "no checkpoint" in _error_line(["eval", str(no_ckpt)], capsys)

    no_config = tmp_path / "no_config"
    shutil.copytree(runs / "txl" / "checkpoints", no_config / "checkpoints")
    assert "config.yaml is missing" in _error_line(["eval", str(no_config)], capsys)

    assert "both set" in _error_line(["eval", str(runs / "txl"), "--mem-len", "8", "--mem-mult", "2"], capsys)
    assert "does not exist" in _error_line(["eval", str(tmp_path / "nowhere")], capsys)
    assert "mem_len must be >= 1" in _error_line(["eval", str(runs / "lamemo"), "--mem-len", "0"], capsys)

    moved = tmp_path / "moved_data"
    shutil.copytree(runs / "txl", moved, ignore=shutil.ignore_patterns("eval"))
    text = (moved / "config.yaml").read_text()
    (moved / "config.yaml").write_text(text.replace(str(runs.parent), str(tmp_path / "gone")))
    assert "manifest.json" in _error_line(["eval", str(moved)], capsys)


def test_a_perplexity_far_below_the_vocabulary_gets_no_note():
    from memlm.trainer.inference import uniform_guess

    result = {"split": "test", "ppl": 127.9, "step": 3000}
    assert uniform_guess.note(result, 256) is None
    assert "test ppl 128 is close to the 256" in uniform_guess.note({**result, "ppl": 128.0}, 256)


def test_cli_process_exit_status(runs, tmp_path):
    """The real command: one stderr line and status 2 for a mistake."""
    proc = subprocess.run([sys.executable, "-m", "memlm", "eval", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "config.yaml is missing" in proc.stderr



def test_cli_console_holds_memlm_lines_only(runs, tmp_path):
    """`memlm eval` as a user runs it (DS_ACCELERATOR unset): DeepSpeed's import-time "Setting accelerator to CPU"
    warning, printed on a machine without a GPU, goes to the run's library.log; the console gets memlm's thread
    line, the progress line and the JSON."""
    run = tmp_path / "txl"
    shutil.copytree(runs / "txl", run)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-m", "memlm", "eval", str(run), "--json", str(tmp_path / "e.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "accelerator" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "e.json").read_text())
    # One Adam step on random tokens: a uniform guess over 256 bytes, and the console says so (issue 32)
    assert result["ppl"] > 128 and f"memlm eval: valid ppl {result['ppl']:,.0f} is close to the 256 of a uniform " \
        "guess over the vocabulary: the model at step 1 has not learned the data yet" in proc.stderr, proc.stderr
    if not torch.cuda.is_available():  # where DeepSpeed has a GPU to find, it has nothing to warn about
        assert "Setting accelerator to CPU" in (run / "library.log").read_text()


# ---------------------------------------------------------------------------------------------------------------
# Child process: make the run folders (DeepSpeed initialises a process group, kept out of pytest's process)


def _make_runs(root: Path, data: Path) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    import deepspeed

    from memlm.models import build_model
    from memlm.trainer.config.run_config import dump_yaml, load_config
    from memlm.trainer.runtime.op_cache import use_own_extension_cache

    use_own_extension_cache()  # DeepSpeed builds its CPU op here as memlm would: its cache, its ninja
    for name, (preset, stage) in RUNS.items():
        cfg = load_config(preset, {"data.path": str(data), "deepspeed.zero_stage": stage})
        torch.manual_seed(0)
        model = build_model(cfg.model)
        ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
                     "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
                     "zero_optimization": {"stage": stage}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.tgt_len), generator=gen)
        memory = model.init_memory(batch_size=2)
        out = engine(tokens, memory, reset=torch.ones(2, dtype=torch.bool), targets=tokens)
        engine.backward(out.nll.mean())
        engine.step()
        run = root / name
        (run / "checkpoints").mkdir(parents=True)
        dump_yaml(cfg, run / "config.yaml")
        engine.save_checkpoint(str(run / "checkpoints"), tag="global_step1")
        (run / "checkpoints" / "latest").write_text("global_step1")
        # ZeRO-3 keeps only this rank's partition in each parameter: gather them to read the full weights.
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            trained = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        torch.save(trained, run / "weights.pt")


if __name__ == "__main__" and sys.argv[1:2] == ["make-runs"]:
    _make_runs(Path(sys.argv[2]), Path(sys.argv[3]))
