"""LaMemo against the paper's equations over absolute positions (tests/support/reference.py), with several lanes whose
documents start at different segments; the single-layer union-softmax property; the look-ahead encodings'
own dropout draw."""

import functools

import pytest
import torch

from memlm.models import build_model
from support.models import perturbed, tiny_model_config
from support.reference import Weights, lamemo_reference, lane_doc_starts, sinusoid_vec

N = 8


tiny = functools.partial(tiny_model_config, arch="lamemo", tgt_len=N)

def run_lanes(model, tokens, targets, resets):
    """ModelOutputs of consecutive segments of tokens/targets [B, T]; resets[k]: None or [B] bool."""
    memory = model.init_memory(tokens.shape[0])
    outs = []
    for k, s in enumerate(range(0, tokens.shape[1], N)):
        out = model(tokens[:, s : s + N], memory, reset=resets[k], targets=targets[:, s : s + N])
        memory = out.memory
        outs.append(out)
    return outs


# Lane 0: one document; lane 1: a new document at segment 2; lane 2: new documents at segments 1 and 4.
RESETS = [None, torch.tensor([False, False, True]), torch.tensor([False, True, False]), None,
          torch.tensor([False, False, True])]


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(mem_len=3),  # M < N
        dict(mem_len=12),  # M > N: positions stay for a second look-ahead round
        dict(mem_len=20, interp_eps=1e-2),  # three rounds
        dict(mem_len=12, rpe="xl", clamp_len=3),  # signed R(i - p); only the maximum is clamped
        dict(mem_len=12, lookahead=False),
        dict(mem_len=12, interpolate=False),
        dict(mem_len=12, pre_lnorm=True, untie_r=True),
        dict(mem_len=12, clamp_len=3),
        dict(mem_len=12, same_length=True),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default",
)
def test_lamemo_matches_absolute_position_reference(options):
    torch.manual_seed(5)
    model = perturbed(build_model(tiny(init_std=0.3, **options))).eval()
    M, B, S = model.cfg.mem_len, 3, len(RESETS)
    tokens = torch.randint(0, 50, (B, N * S))
    targets = torch.randint(0, 50, (B, N * S))
    targets[0, 4] = targets[2, 30] = -100
    with torch.no_grad():
        outs = run_lanes(model, tokens, targets, RESETS)
    for b in range(B):
        docs = lane_doc_starts(RESETS, b, N)
        ref = lamemo_reference(model, tokens[b].tolist(), targets[b].tolist(), N, docs)
        for k, (out, seg) in enumerate(zip(outs, ref)):
            where = f"lane {b} segment {k}"
            torch.testing.assert_close(out.nll[b], torch.tensor(seg.nll, dtype=torch.float32), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{where} nll: {m}")
            # slot c of the memory after segment k holds absolute position end - M + c, if in this document
            end, doc = (k + 1) * N, max(d for d in docs if d <= k * N)
            positions = [end - M + c for c in range(M)]
            assert out.memory.valid[b].tolist() == [p >= doc for p in positions], where
            for l in range(model.cfg.n_layer):
                for c, p in enumerate(positions):
                    if p < doc:
                        continue
                    C, S_ = seg.cache[l][p]
                    torch.testing.assert_close(out.memory.context[l][b, c].double(), C, rtol=1e-4, atol=1e-5,
                                               msg=lambda m: f"{where} layer {l} C of position {p}: {m}")
                    torch.testing.assert_close(out.memory.lognorm[l][b, c].double(), S_, rtol=1e-4, atol=1e-5,
                                               msg=lambda m: f"{where} layer {l} S of position {p}: {m}")


def test_single_layer_interpolation_is_one_softmax_over_past_and_lookahead_keys():
    """docs/design.md §3 / paper Appendix A. One layer, M > N so a position stays in memory for several segments: its
    cached context must equal a single softmax over its causal keys and every look-ahead key so far (the windows
    tile without gaps or overlap), and its log-normaliser the logsumexp over that union. Since C' = alpha C +
    (1 - alpha) A mixes two softmaxes over disjoint key sets, this holds only when alpha is the union's mass on
    the past. With one layer every key is a token embedding, so the union is written down directly; lane 1 starts
    a new document at segment 2, which bounds both the causal and the look-ahead keys."""
    torch.manual_seed(6)
    n, M, segments = 3, 10, 6
    model = build_model(tiny(n_layer=1, tgt_len=n, mem_len=M, interp_eps=0.0, init_std=0.3)).eval()
    W = Weights(model)
    tokens = torch.randint(0, 50, (2, n * segments))
    memory = model.init_memory(2)
    with torch.no_grad():
        for k in range(segments):
            reset = torch.tensor([False, True]) if k == 2 else None
            memory = model(tokens[:, k * n : (k + 1) * n], memory, reset=reset).memory
    u, v_left, v_right = W.bias("bias_u", 0), W.bias("bias_v", 0), W.bias("bias_v_ahead", 0)
    last_start = n * (segments - 1)  # first token of the last segment processed
    for b, doc in ((0, 0), (1, 2 * n)):
        kv = {p: W.qkv(0, W.embed(int(tokens[b, p]))) for p in range(doc, n * segments)}
        checked = 0
        for slot in range(M):
            i = last_start + n - M + slot  # absolute position of this memory slot
            if i >= last_start or i < doc:
                continue  # current tokens of the last segment (plain causal attention), or another document
            seg_start = (i // n) * n
            causal = range(max(doc, seg_start - M), i + 1)  # keys i saw when it was current
            ahead = range(i + 1, last_start + 1)  # every look-ahead key up to the last segment's first token
            scores = [W.score(0, kv[i][0], kv[j][1], u, v_left, i - j) for j in causal]
            scores += [W.score(0, kv[i][0], kv[p][1], u, v_right, p - i) for p in ahead]
            values = [kv[j][2] for j in causal] + [kv[p][2] for p in ahead]
            s = torch.stack(scores)  # [keys, H]
            probs = torch.softmax(s, dim=0)
            want_ctx = (probs[:, :, None] * torch.stack(values)).sum(0)
            torch.testing.assert_close(memory.context[0][b, slot].double(), want_ctx, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(memory.lognorm[0][b, slot].double(), torch.logsumexp(s, 0), rtol=1e-5, atol=1e-5)
            checked += 1
        assert checked == M - n


def drop_calls(model):
    """Record (input, output) of every call of the model's top-level dropout module."""
    calls = []
    handle = model.drop.register_forward_hook(lambda mod, inp, out: calls.append((inp[0].detach(), out.detach())))
    return calls, handle


def test_lookahead_encodings_get_their_own_dropout_draw():
    """Training with dropout > 0: the look-ahead encodings R(1..M) are dropped with a mask of their own (the
    authors' code), not by reusing rows 1..M of the causal encodings' draw, and the look-ahead uses that draw."""
    M, D = 12, 32  # M > N: after two segments, slots 0..M-N-1 hold looked-ahead positions of the first
    model = build_model(tiny(mem_len=M, dropout=0.5, init_std=0.3)).train()
    tokens = torch.randint(0, 50, (2, 2 * N))
    with torch.no_grad():
        memory = model(tokens[:, :N], model.init_memory(2)).memory  # a real memory for the look-ahead
        calls, handle = drop_calls(model)
        torch.manual_seed(7)
        base = model(tokens[:, N:], memory).memory
        handle.remove()
    causal_r = torch.stack([sinusoid_vec(d, D) for d in range(M + N)]).float()
    ahead_r = torch.stack([sinusoid_vec(d, D) for d in range(1, M + 1)]).float()
    causal = [o for i, o in calls if i.shape == causal_r.shape and torch.allclose(i, causal_r, atol=1e-6)]
    ahead = [o for i, o in calls if i.shape == ahead_r.shape and torch.allclose(i, ahead_r, atol=1e-6)]
    assert len(causal) == 1, "one draw for the causal encodings R(0..M+N-1)"
    assert len(ahead) == 1, "one draw of its own for the look-ahead encodings R(1..M)"
    assert not torch.equal(ahead[0] == 0, causal[0][1 : M + 1] == 0), "the same zero pattern as the causal draw"
    assert (ahead[0] == 0).any() and (ahead[0] != 0).any()

    def scale_ahead(mod, inp, out):  # change only the look-ahead draw; the RNG stream is untouched
        if inp[0].shape == ahead_r.shape and torch.allclose(inp[0], ahead_r, atol=1e-6):
            return out * 3.0
        return None

    handle = model.drop.register_forward_hook(scale_ahead)
    with torch.no_grad():
        torch.manual_seed(7)
        changed = model(tokens[:, N:], memory).memory
    handle.remove()
    # layer 0: the look-ahead touches the slots of the previous segment's positions, nothing else
    assert not torch.allclose(changed.context[0][:, : M - N], base.context[0][:, : M - N], atol=1e-4)
    torch.testing.assert_close(changed.context[0][:, M - N :], base.context[0][:, M - N :], rtol=0, atol=0)


def test_lookahead_bias_gets_gradient_only_through_a_real_memory():
    """v- is used only by memory rows; it can influence the loss only once the memory holds real positions."""
    model = build_model(tiny()).train()
    tokens = torch.randint(0, 50, (2, 2 * N + 1))
    memory = model.init_memory(2)
    out = model(tokens[:, :N], memory, targets=tokens[:, 1 : N + 1])
    out.nll.sum().backward()
    assert model.learned.bias_v_ahead.grad is not None and model.learned.bias_v_ahead.grad.abs().max() == 0
    model.zero_grad()
    out = model(tokens[:, N : 2 * N], out.memory, targets=tokens[:, N + 1 :])
    out.nll.sum().backward()
    assert model.learned.bias_v_ahead.grad.abs().max() > 0
    assert not any(t.requires_grad for t in [out.memory.embed, *out.memory.context, *out.memory.lognorm])


def test_lognorm_and_alpha_stay_fp32_under_bf16_autocast():
    model = build_model(tiny())
    tokens = torch.randint(0, 50, (2, N))
    memory = model.init_memory(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            out = model(tokens, memory, targets=tokens)
            memory = out.memory
    assert all(s.dtype == torch.float32 for s in memory.lognorm)
    assert torch.isfinite(out.nll).all()
