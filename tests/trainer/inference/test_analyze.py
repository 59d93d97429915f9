"""`memlm analyze` and the models' attention/alpha recording.

LaMemo's alpha is recomputed here from the paper's definitions (eq. 10-11) with plain tensor algebra on the
model's weights: look-ahead scores of each memory position over the window ending at the segment's first token,
s_ahead = sum of their exponentials, alpha = s_past / (s_past + s_ahead + eps), and the refreshed memory
C' = alpha C + (1 - alpha) A that the model carries to the next segment.
Cost: ~22 s on 2 cores (two 2-step trainer runs, one tracked in a temporary MLflow store).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from memlm.models import ModelConfig, build_model
from memlm.trainer.inference.analyze import Recorder, analyze_run, collect
from support.training import make_data, train_in_process

M, N = 16, 8


def _lamemo():
    torch.manual_seed(0)
    return build_model(ModelConfig(arch="lamemo", vocab_size=40, tgt_len=N, mem_len=M, init_std=0.3)).eval()


def _sinusoid(d: float, dim: int) -> torch.Tensor:
    freqs = [1.0 / (10000 ** (k / dim)) for k in range(0, dim, 2)]
    return torch.tensor([math.sin(d * f) for f in freqs] + [math.cos(d * f) for f in freqs])


def test_alpha_matches_the_paper_definition():
    model = _lamemo()
    cfg = model.cfg
    H, E = cfg.n_head, cfg.d_head
    tokens = torch.randint(0, 40, (1, 2 * N))
    with torch.no_grad():
        first = model(tokens[:, :N], model.init_memory(1))
        model.recorder = Recorder()
        second = model(tokens[:, N:], first.memory)
        items = model.recorder.take()
        model.recorder = None
    mem = first.memory
    for l in range(cfg.n_layer):
        alpha = items[("alpha", l)][0]  # [M, H]
        assert alpha.shape == (M, H) and float(alpha.min()) >= 0.0 and float(alpha.max()) <= 1.0

    # Layer 0 by hand. Memory slots 8..15 hold segment 1 (slots 0..7 are empty); the look-ahead window is the
    # N keys ending at the first token of segment 2 (positions M+1-N .. M).
    layer = model.layers[0]
    w_q, w_kv, w_r = layer.attn.q_net.weight, layer.attn.kv_net.weight, layer.attn.r_net.weight
    u, v_ahead = model.learned.bias_u.detach(), model.learned.bias_v_ahead.detach()
    x = torch.cat([mem.embed[0], second.memory.embed[0, M - N : M - N + 1]])  # [M + 1, D] layer-0 inputs
    q = (x @ w_q.T).view(-1, H, E)
    k, v = (x @ w_kv.T).view(-1, 2, H, E).unbind(1)
    for i in range(N, M):
        keys = [p for p in range(M + 1 - N, M + 1) if p > i]
        scores = torch.stack([
            ((q[i] + u) * k[p]).sum(-1) + ((q[i] + v_ahead) * (w_r @ _sinusoid(p - i, cfg.d_model)).view(H, E)).sum(-1)
            for p in keys]) / math.sqrt(E)  # [W, H]
        s_past = mem.lognorm[0][0, i].double().exp()
        s_ahead = scores.double().exp().sum(0)
        alpha = s_past / (s_past + s_ahead + cfg.interp_eps)
        torch.testing.assert_close(items[("alpha", 0)][0, i].double(), alpha, rtol=1e-4, atol=1e-6)
        ahead = (torch.softmax(scores, 0)[:, :, None] * v[keys]).sum(0)  # [H, E]
        refreshed = alpha[:, None].float() * mem.context[0][0, i] + (1 - alpha[:, None].float()) * ahead
        torch.testing.assert_close(second.memory.context[0][0, i - N], refreshed, rtol=1e-4, atol=1e-5)
    assert 0.05 < float(items[("alpha", 0)][0, N:].mean()) < 0.95  # a real mix, not a degenerate one


@pytest.mark.parametrize("arch", ["txl", "lamemo", "rmt"])
def test_attention_rows_sum_to_one_and_recording_changes_nothing(arch):
    torch.manual_seed(0)
    extra = {"num_mem_tokens": 2, "mem_len": 8} if arch == "rmt" else {"mem_len": M}
    model = build_model(ModelConfig(arch=arch, vocab_size=40, tgt_len=N, init_std=0.3, **extra)).eval()
    tokens = torch.randint(0, 40, (2, 2 * N))
    with torch.no_grad():
        plain = model(tokens[:, N:], model(tokens[:, :N], model.init_memory(2)).memory, return_logits=True)
        model.recorder = Recorder()
        memory = model(tokens[:, :N], model.init_memory(2)).memory
        model.recorder.take()
        recorded = model(tokens[:, N:], memory, return_logits=True)
        items = model.recorder.take()
        model.recorder = None
    assert torch.equal(plain.logits, recorded.logits)
    kinds = {"txl": ["causal"], "lamemo": ["causal", "lookahead"], "rmt": ["rmt"]}[arch]
    for kind in kinds:
        for l in range(model.cfg.n_layer):
            probs = items[(kind, l)]
            sums = probs.sum(-1)  # every row has a key: the look-ahead window ends at the segment's first token
            torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)


def test_collect_statistics_on_a_stream_of_segments():
    from memlm.data_pipeline.stream import Batch

    model = _lamemo()
    gen = torch.Generator().manual_seed(0)
    batches = [Batch(torch.randint(0, 40, (1, N), generator=gen), torch.randint(0, 40, (1, N), generator=gen),
                     torch.tensor([s == 0]), torch.tensor([True])) for s in range(5)]
    result = collect(model, batches, segments=4)
    assert result["segments"] == 4
    alpha = result["lamemo_alpha"]
    # Segment 1 has an empty memory; slots fill N per segment, so the oldest N slots first count at segment 3.
    assert alpha["slots_counted"][0] == [2.0] * N + [3.0] * N
    assert all(0.0 <= a <= 1.0 for row in alpha["alpha"] for a in row)
    iv = result["attention_intervals"]
    assert all(0.0 < w <= 1.0 for row in iv["max_weight"] for w in row if w is not None)
    for l in range(model.cfg.n_layer):  # masses over memory and current segment of tokens that saw memory
        assert 0.0 < iv["memory_mass"][l] < 1.0 and 0.0 < iv["current_mass"][l] <= 1.0


def test_collect_counts_compressed_slots_as_memory():
    """The Compressive Transformer's queries read [compressed | memory | segment]: the statistics' "memory" is every
    cached key (C + M of them), masked by the state's key_valid, and the masses of each row still sum to one."""
    from memlm.data_pipeline.stream import Batch

    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="compressive", vocab_size=40, tgt_len=N, mem_len=N, compressed_len=4,
                                    compression_rate=2, init_std=0.3)).eval()
    gen = torch.Generator().manual_seed(0)
    batches = [Batch(torch.randint(0, 40, (1, N), generator=gen), torch.randint(0, 40, (1, N), generator=gen),
                     torch.tensor([s == 0]), torch.tensor([True])) for s in range(4)]
    result = collect(model, batches, segments=4)
    iv = result["attention_intervals"]
    P = 4 + N  # compressed slots + memory rows
    assert [i["keys"] for i in iv["intervals"] if i["label"].startswith("mem")][-1][1] == P
    assert [i["keys"] for i in iv["intervals"] if i["label"].startswith("cur")][-1][1] == P + N
    # Segment 1 reads nothing cached; segments 2-4 read the memory, and 3-4 also the compressed slots: the oldest
    # interval (the slots) is counted by the scored tokens of 2 segments, the memory's newest by those of 3.
    counted = iv["tokens_counted"][0]
    assert counted[0] == 2 * N and counted[len([i for i in iv["intervals"] if i["label"].startswith("mem")]) - 1] \
        == 3 * N
    for l in range(model.cfg.n_layer):
        assert 0.0 < iv["memory_mass"][l] < 1.0


@pytest.mark.parametrize("arch, settings, has_memory", [
    ("transformer", dict(mem_len=0), False),
    # No Transformer-XL cache (mem_len 0), but an associative state carried from segment to segment
    ("armt", dict(mem_len=0, num_mem_tokens=2, assoc_dim=4), True),
    ("txl", dict(mem_len=N), True),
])
def test_the_analysis_says_whether_the_model_has_memory(arch, settings, has_memory, caplog):
    """`memlm analyze` once read "no Transformer-XL cache" as "no memory" and called ARMT memoryless."""
    from memlm.data_pipeline.stream import Batch

    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=arch, vocab_size=40, tgt_len=N, init_std=0.3, **settings)).eval()
    gen = torch.Generator().manual_seed(0)
    batches = [Batch(torch.randint(0, 40, (1, N), generator=gen), torch.randint(0, 40, (1, N), generator=gen),
                     torch.tensor([s == 0]), torch.tensor([True])) for s in range(2)]
    with caplog.at_level("INFO", logger="memlm.trainer.inference.analyze"):
        result = collect(model, batches, segments=2)
    assert result["has_memory"] is has_memory
    assert ("has no memory" in caplog.text) is not has_memory


# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("analyze")
    data = make_data(root)
    train_in_process("lamemo", data, root / "lamemo", train__steps=2, tracking__enabled="true",
                     tracking__uri=f"sqlite:///{root / 'mlflow.db'}", tracking__experiment="analyze-test")
    train_in_process("rmt", data, root / "rmt", train__steps=2)
    return root


def test_analyze_lamemo_run_writes_and_logs(runs, capsys):
    from memlm import cli

    capsys.readouterr()
    assert cli.main(["analyze", str(runs / "lamemo"), "--segments", "6"]) == 0
    printed = capsys.readouterr().out
    assert "alpha mean" in printed and "memory" in printed
    out = runs / "lamemo" / "analysis"
    result = json.loads((out / "analysis-test.json").read_text())
    assert result["arch"] == "lamemo" and result["segments"] == 6 and result["step"] == 2
    # The console says what the README quotes: each layer's attention mass on the memory, as in the JSON.
    for layer, mass in enumerate(result["attention_intervals"]["memory_mass"]):
        assert f"layer {layer}: attention on the memory {100 * mass:.0f}%;" in printed, printed
    assert len(result["lamemo_alpha"]["alpha"]) == 2 and len(result["attention_intervals"]["max_weight"]) == 2
    for name in ("attention_intervals.png", "lamemo_alpha.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from mlflow import MlflowClient

    run_id = (runs / "lamemo" / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    logged = {a.path for a in client.list_artifacts(run_id, "analysis")}
    assert logged == {"analysis/analysis-test.json", "analysis/attention_intervals.png", "analysis/lamemo_alpha.png"}


def test_analyze_rmt_run(runs):
    result = analyze_run(runs / "rmt", split="valid", segments=3)
    rmt = result["rmt_attention"]
    assert result["mlflow"] is False  # untracked run: files only
    R = rmt["num_mem_tokens"]
    for rows in (rmt["read_rows"], rmt["write_rows"]):
        t = torch.tensor(rows)  # [L, R, K]
        assert t.shape[1] == R
        torch.testing.assert_close(t.sum(-1), torch.ones(t.shape[:2], dtype=t.dtype), atol=1e-4, rtol=0)  # 6 decimals
    assert (runs / "rmt" / "analysis" / "rmt_attention.png").is_file()


def test_analyze_mistakes_are_one_line(runs, capsys):
    from memlm import cli

    capsys.readouterr()
    assert cli.main(["analyze", str(runs / "rmt"), "--segments", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memlm: error: ") and "--segments" in err and "\n" not in err
