"""Recurrent Memory Transformer (with and without the Transformer-XL cache) against slow references:
the attention mask and the cache contents as explicit matrices for both settings of read_mem_from_cache and
cache_memory_rows, a forward over the lane's row stream (tests/support/reference.py) with several lanes whose documents
start at different segments, memory rows dropped like tokens, no leakage, document isolation, BPTT depth by
gradients, mem_len-independent parameters and the auxiliary memory loss."""

import dataclasses
import functools
import io

import pytest
import torch

from memlm.models import build_model, map_memory
from memlm.models.rmt import RMTMemory, rmt_allowed, rmt_positions
from support.models import tiny_model_config
from support.reference import Weights, lane_doc_starts, rmt_reference

tiny = functools.partial(tiny_model_config, arch="rmt", mem_len=0, num_mem_tokens=2)

def run(model, tokens, targets, seg_lens, resets=None, memory=None):
    """ModelOutputs of consecutive segments of tokens/targets [B, T], the memory carried along."""
    memory = memory if memory is not None else model.init_memory(tokens.shape[0])
    outs, s = [], 0
    for i, n in enumerate(seg_lens):
        reset = None if resets is None else resets[i]
        out = model(tokens[:, s : s + n], memory, reset=reset, targets=targets[:, s : s + n])
        outs.append(out)
        memory, s = out.memory, s + n
    return outs


def nll_of(outs):
    return torch.cat([o.nll for o in outs], dim=1)


# ---------------------------------------------------------------- 1. the mask as an explicit matrix

#              c0 c1 c2 rd t0 t1 wr        (R = 1, N = 2, M = 3; cache slot c2 is the newest)
MASK_DEFAULT = [[0, 0, 0, 1, 0, 0, 0],  # read: its own block only; the cache is not read (authors' code)
                [1, 1, 1, 1, 1, 0, 0],  # token 0
                [1, 1, 1, 1, 1, 1, 0],  # token 1
                [0, 0, 0, 1, 1, 1, 1]]  # write: the whole segment; not the cache either (authors' mask)
MASK_READ_CACHE = [[1, 1, 1, 1, 0, 0, 0],  # read_mem_from_cache: both memory blocks see the cache
                   [1, 1, 1, 1, 1, 0, 0],
                   [1, 1, 1, 1, 1, 1, 0],
                   [1, 1, 1, 1, 1, 1, 1]]
MASK_WRITE_CACHE = [[0, 0, 0, 1, 0, 0, 0],  # write_mem_from_cache: the write rows alone see it
                    [1, 1, 1, 1, 1, 0, 0],
                    [1, 1, 1, 1, 1, 1, 0],
                    [1, 1, 1, 1, 1, 1, 1]]
# same_length: token rows drop cache/token keys >= M = 3 index positions back (t0 sits at 4, t1 at 5)
MASK_SAME_LENGTH = [[0, 0, 0, 1, 0, 0, 0],
                    [0, 0, 1, 1, 1, 0, 0],
                    [0, 0, 0, 1, 1, 1, 0],
                    [0, 0, 0, 1, 1, 1, 1]]


@pytest.mark.parametrize(
    "read_mem_from_cache,write_mem_from_cache,same_length,literal",
    [(False, False, False, MASK_DEFAULT), (True, False, False, MASK_READ_CACHE),
     (False, True, False, MASK_WRITE_CACHE), (False, False, True, MASK_SAME_LENGTH)],
)
def test_mask_literal_small_case(read_mem_from_cache, write_mem_from_cache, same_length, literal):
    valid = torch.tensor([[True, True, True], [False, True, True]])  # lane 1: slot c0 empty (document start)
    got = rmt_allowed(1, 2, valid, same_length=same_length, read_mem_from_cache=read_mem_from_cache,
                      write_mem_from_cache=write_mem_from_cache)
    want = torch.tensor(literal, dtype=torch.bool)
    assert torch.equal(got[0], want)
    want_lane1 = want.clone()
    want_lane1[:, 0] = False  # an empty slot is masked for every row
    assert torch.equal(got[1], want_lane1)


def expected_mask(R, N, M, valid_row, same_length, read_mem_from_cache, write_mem_from_cache=False):
    """[Q, K] by hand: rows read 0..R-1, tokens R..R+N-1, write R+N..; columns cache 0..M-1, then the rows.
    Row q sits at key index M + q; distances are index differences."""
    Q = 2 * R + N
    reads, toks, writes = range(0, R), range(R, R + N), range(R + N, Q)
    want = torch.zeros(Q, M + Q, dtype=torch.bool)
    for q in range(Q):
        for k in range(M + Q):
            if k < M:
                ok = bool(valid_row[k]) and (q in toks or read_mem_from_cache or (q in writes and write_mem_from_cache))
            else:
                c = k - M  # column in the segment's own layout
                ok = q in writes or c in reads or (q in toks and c in toks and c <= q)
            if same_length and M > 0 and q in toks and (k < M or k - M in toks) and (M + q) - k >= M:
                ok = False
            want[q, k] = ok
    return want


@pytest.mark.parametrize("read_mem_from_cache,write_mem_from_cache", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize(
    "R,N,M,valid,same_length",
    [
        (2, 3, 0, [[], []], False),
        (2, 4, 3, [[0, 1, 1], [1, 1, 1], [0, 0, 0]], False),
        (3, 5, 2, [[1, 1], [0, 1]], False),
        (2, 5, 3, [[1, 1, 1], [0, 1, 1]], True),
        (1, 3, 6, [[0, 0, 1, 1, 1, 1]], True),
    ],
)
def test_attention_mask_matches_hand_rules(R, N, M, valid, same_length, read_mem_from_cache, write_mem_from_cache):
    valid = torch.tensor(valid, dtype=torch.bool).view(len(valid), M)
    got = rmt_allowed(R, N, valid, same_length, read_mem_from_cache, write_mem_from_cache)
    assert got.shape == (len(valid), 2 * R + N, M + 2 * R + N)
    for b in range(len(valid)):
        want = expected_mask(R, N, M, valid[b].tolist(), same_length, read_mem_from_cache, write_mem_from_cache)
        assert torch.equal(got[b], want), f"lane {b}"


@pytest.mark.parametrize("R,N,M", [(1, 3, 0), (2, 4, 3), (3, 2, 5)])
def test_position_index_gives_signed_distance(R, N, M):
    distances, index = rmt_positions(R, N, M, torch.device("cpu"))
    allowed = rmt_allowed(R, N, torch.ones(1, M, dtype=torch.bool), read_mem_from_cache=True)[0]
    Q, K = 2 * R + N, M + 2 * R + N
    assert index.shape == (Q, K)
    for q in range(Q):
        for k in range(K):
            if allowed[q, k]:
                assert distances[index[q, k]].item() == (M + q) - k


# ---------------------------------------------------------------- 2. what the cache holds, as explicit rows


@pytest.mark.parametrize("cache_memory_rows", [True, False])
def test_cache_rows_explicit(cache_memory_rows):
    """R = 1, N = 2, M = 5, two lanes, lane 1 starts a new document at segment 2. The layer-0 cache after each
    segment, slot by slot (oldest first), in terms of the layer-0 inputs: token embeddings e(.), the learned
    initial memory `init` and the write outputs w_k of segment k (the next segment's memory rows)."""
    torch.manual_seed(9)
    model = build_model(tiny(num_mem_tokens=1, tgt_len=2, mem_len=5, cache_memory_rows=cache_memory_rows)).eval()
    W = Weights(model)
    tokens = torch.randint(0, 50, (2, 6))
    resets = [None, None, torch.tensor([False, True])]
    with torch.no_grad():
        outs = run(model, tokens, tokens, [2, 2, 2], resets)
    init = W.learned["memory_init"][0]
    w = [out.memory.tokens[:, 0].double() for out in outs]  # [B, D] per segment

    def e(b, t):
        return W.embed(int(tokens[b, t]))

    for b in range(2):
        x = None  # an empty slot
        if cache_memory_rows:  # rows [read | t0 t1 | write] of the lane's row stream, last 5
            want = [
                [x, init, e(b, 0), e(b, 1), init],  # segment 0: read = write = init
                [init, w[0][b], e(b, 2), e(b, 3), w[0][b]],  # spans segments 0 and 1
                [w[0][b], w[1][b], e(b, 4), e(b, 5), w[1][b]] if b == 0
                else [x, init, e(b, 4), e(b, 5), init],  # lane 1's new document starts from the learned memory
            ]
        else:  # the last 5 token rows
            want = [
                [x, x, x, e(b, 0), e(b, 1)],
                [x, e(b, 0), e(b, 1), e(b, 2), e(b, 3)],
                [e(b, 1), e(b, 2), e(b, 3), e(b, 4), e(b, 5)] if b == 0 else [x, x, x, e(b, 4), e(b, 5)],
            ]
        for k, (out, slots) in enumerate(zip(outs, want)):
            assert out.memory.cache.valid[b].tolist() == [s is not None for s in slots], f"lane {b} segment {k}"
            for c, row in enumerate(slots):
                if row is not None:
                    torch.testing.assert_close(out.memory.cache.hidden[0][b, c].double(), row, rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"lane {b} segment {k} slot {c}: {m}")


# ---------------------------------------------------------------- 3. forward against the row-stream reference

# Lane 0: one document; lane 1: a new document at segment 2; lane 2: new documents at segments 1 and 4.
RESETS = [None, torch.tensor([False, False, True]), torch.tensor([False, True, False]), None,
          torch.tensor([False, False, True])]


@pytest.mark.parametrize(
    "R,mem_len,clamp_len,same_length,untie_r,pre_lnorm,read_mem_from_cache,cache_memory_rows",
    [
        (2, 5, -1, False, False, False, "write", True),  # the write rows alone read the cache (write_mem_from_cache)
        (2, 0, -1, False, False, False, False, True),  # RMT alone
        (4, 0, 2, False, True, True, False, True),  # clamp_len < R - 1: negative distances keep their encodings
        (2, 5, -1, False, False, False, False, True),  # Tr-XL + RMT, the authors' defaults
        (2, 5, -1, False, False, False, True, True),  # read rows read the cache
        (3, 20, 3, False, True, True, False, True),  # the cache spans more than a segment's rows
        (2, 6, -1, False, False, False, False, False),  # token-only cache
        (2, 12, -1, False, False, False, True, False),  # token-only cache longer than a segment, read rows read it
        (2, 6, -1, True, False, False, False, True),  # same_length
        (2, 10, 4, True, False, False, True, False),  # same_length, token-only cache
    ],
)
def test_rmt_matches_row_stream_reference(R, mem_len, clamp_len, same_length, untie_r, pre_lnorm,
                                          read_mem_from_cache, cache_memory_rows):
    torch.manual_seed(11)
    cfg = tiny(num_mem_tokens=R, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length, untie_r=untie_r,
               pre_lnorm=pre_lnorm, aux_loss_weight=0.5, aux_token_id=7, init_std=0.3,  # peaked attention
               read_mem_from_cache=read_mem_from_cache is True, write_mem_from_cache=read_mem_from_cache == "write",
               cache_memory_rows=cache_memory_rows)
    model = build_model(cfg).eval()
    with torch.no_grad():  # fresh LayerNorms and biases are trivial; make the reference use them for real
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    N, B, S = 8, 3, len(RESETS)
    tokens = torch.randint(0, 50, (B, N * S))
    targets = torch.randint(0, 50, (B, N * S))
    targets[0, 3] = targets[1, 20] = -100
    with torch.no_grad():
        outs = run(model, tokens, targets, [N] * S, RESETS)
    aux = [[] for _ in range(S)]  # per segment: the reference's aux NLL of every lane's write rows
    for b in range(B):
        ref = rmt_reference(model, tokens[b].tolist(), targets[b].tolist(), N, lane_doc_starts(RESETS, b, N))
        for k, (out, seg) in enumerate(zip(outs, ref)):
            where = f"lane {b} segment {k}"
            torch.testing.assert_close(out.nll[b], torch.tensor(seg.nll, dtype=torch.float32), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{where} nll: {m}")
            torch.testing.assert_close(out.memory.tokens[b].double(), seg.write, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{where} memory tokens: {m}")
            if mem_len:
                assert out.memory.cache.valid[b].tolist() == [x is not None for x in seg.cache[0]], where
                for l in range(cfg.n_layer):
                    for c, row in enumerate(seg.cache[l]):
                        if row is not None:
                            torch.testing.assert_close(out.memory.cache.hidden[l][b, c].double(), row, rtol=1e-4,
                                                       atol=1e-4, msg=lambda m: f"{where} layer {l} slot {c}: {m}")
            aux[k] += seg.aux_nll
    for out, seg_aux in zip(outs, aux):
        torch.testing.assert_close(out.aux_loss, 0.5 * torch.tensor(seg_aux).mean(), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- 4. memory rows are dropped like tokens


def test_memory_rows_of_the_layer0_input_are_dropped():
    """With dropout, the whole [read | tokens | write] layer-0 input goes through one dropout, memory rows
    included (as the authors drop the memory-token embeddings with the token embeddings)."""
    R, Nn, B = 4, 8, 2
    model = build_model(tiny(num_mem_tokens=R, dropout=0.5, init_std=0.3)).train()
    W = Weights(model)
    tokens = torch.randint(0, 50, (B, Nn))
    calls = []
    handle = model.drop.register_forward_hook(lambda mod, inp, out: calls.append((inp[0].detach(), out.detach())))
    with torch.no_grad():
        model(tokens, model.init_memory(B), targets=tokens)
    handle.remove()
    layer0 = [(i, o) for i, o in calls if i.shape == (B, 2 * R + Nn, 32)]
    assert len(layer0) == 1, "one dropout over the whole [read | tokens | write] input"
    inp, out = layer0[0]
    init = W.learned["memory_init"].float()
    for b in range(B):
        torch.testing.assert_close(inp[b, :R], init)  # read block: the learned initial memory
        torch.testing.assert_close(inp[b, R + Nn :], init)  # write block: the same
        torch.testing.assert_close(inp[b, R : R + Nn].double(),
                                   torch.stack([W.embed(int(t)) for t in tokens[b]]), rtol=1e-5, atol=1e-6)
    for rows in (slice(0, R), slice(R + Nn, None)):
        kept = out[:, rows] != 0
        assert (~kept).any() and kept.any(), "memory rows are dropped, not passed through"
        torch.testing.assert_close(out[:, rows][kept], 2.0 * inp[:, rows][kept])  # inverted dropout, p = 0.5


# ---------------------------------------------------------------- 5. no leakage


@pytest.mark.parametrize("mem_len", [0, 6])
def test_no_leakage_from_future_tokens(mem_len):
    torch.manual_seed(3)
    model = build_model(tiny(mem_len=mem_len, num_mem_tokens=3)).eval()
    seg_lens = [8, 8, 8]
    tokens = torch.randint(0, 50, (2, 24))
    targets = torch.randint(0, 50, (2, 24))  # fixed: only the inputs after t change
    with torch.no_grad():
        base = nll_of(run(model, tokens, targets, seg_lens))
        for t in (0, 4, 7, 8, 13, 19, 22):
            changed = tokens.clone()
            changed[:, t + 1 :] = torch.randint(0, 50, changed[:, t + 1 :].shape)
            got = nll_of(run(model, changed, targets, seg_lens))
            assert torch.equal(got[:, : t + 1], base[:, : t + 1]), f"leak into positions <= {t}"
            assert not torch.equal(got[:, t + 1 :], base[:, t + 1 :])  # the change is visible later on


# ---------------------------------------------------------------- 6. document isolation


@pytest.mark.parametrize("mem_len", [0, 10])
def test_reset_isolates_documents(mem_len):
    torch.manual_seed(4)
    model = build_model(tiny(mem_len=mem_len)).eval()
    seg_lens = [8, 8, 8, 8]
    tokens = torch.randint(0, 50, (3, 32))
    targets = torch.randint(0, 50, (3, 32))
    reset = torch.tensor([False, True, False])
    resets = [None, None, reset, None]
    with torch.no_grad():
        outs = run(model, tokens, targets, seg_lens, resets)
        plain = run(model, tokens, targets, seg_lens)  # no reset anywhere
        fresh = run(model, tokens[:, 16:], targets[:, 16:], [8, 8])  # a fresh model on the new document
        other = tokens.clone()
        other[1, :16] = torch.randint(0, 50, (16,))  # a different previous document in lane 1
        other_outs = run(model, other, targets, seg_lens, resets)
    for i in (2, 3):
        assert torch.equal(outs[i].nll[1], fresh[i - 2].nll[1])
        assert torch.equal(outs[i].memory.tokens[1], fresh[i - 2].memory.tokens[1])
        assert torch.equal(other_outs[i].nll[1], outs[i].nll[1])
        assert torch.equal(other_outs[i].memory.tokens[1], outs[i].memory.tokens[1])
    for i in range(4):  # the other lanes never notice
        assert torch.equal(outs[i].nll[[0, 2]], plain[i].nll[[0, 2]])
    assert not torch.equal(outs[2].nll[1], plain[2].nll[1])  # the reset did something


# ---------------------------------------------------------------- 7. gradients through the memory


@pytest.mark.parametrize("mem_len", [0, 5])
def test_the_memory_carries_the_graph_as_far_as_the_caller_chains_it(mem_len):
    """The model never cuts its memory tokens itself: segment S's loss reaches every earlier segment the state was
    chained through, and the learned initial memory the first segment read. How far back training reaches is the
    trainer's schedule (model.bptt_depth: tests/trainer/loop/test_rmt_bptt.py measures it the same way)."""
    torch.manual_seed(5)
    model = build_model(tiny(mem_len=mem_len, bptt_depth=1)).train()
    n_seg = 5
    embeds = []
    hook = model.embed.register_forward_hook(lambda mod, inp, out: embeds.append(out))
    tokens = torch.randint(0, 50, (2, 8 * n_seg))
    outs = run(model, tokens, tokens.roll(-1, 1), [8] * n_seg)
    hook.remove()
    for S in range(1, n_seg + 1):
        earlier = list(range(S - 1))  # 0-based indices of segments 1..S-1
        inputs = [embeds[i] for i in earlier] + [model.learned.memory_init]
        grads = torch.autograd.grad(outs[S - 1].nll.sum(), inputs, allow_unused=True, retain_graph=True)
        assert all(g is not None and bool(g.abs().sum() > 0) for g in grads), f"segment {S}"
    for out in outs:  # the Transformer-XL cache is always cut
        assert all(not h.requires_grad for h in out.memory.cache.hidden)


def test_reset_lane_gets_learned_memory_gradient():
    torch.manual_seed(6)
    model = build_model(tiny(bptt_depth=0)).train()
    tokens = torch.randint(0, 50, (2, 24))
    before = run(model, tokens[:, :16], tokens[:, :16], [8, 8])[-1].memory.detached()  # as the trainer cuts at k = 0
    out = model(tokens[:, 16:], before, reset=torch.tensor([True, False]), targets=tokens[:, 16:])
    g0, = torch.autograd.grad(out.nll[0].sum(), model.learned.memory_init, retain_graph=True)
    g1, = torch.autograd.grad(out.nll[1].sum(), model.learned.memory_init, allow_unused=True)
    assert g0.abs().sum() > 0
    assert g1 is None or g1.abs().sum() == 0


def test_detached_cuts_the_graph():
    model = build_model(tiny(bptt_depth=2)).train()
    tokens = torch.randint(0, 50, (2, 8))
    out = model(tokens, model.init_memory(2), targets=tokens)
    assert out.memory.tokens.requires_grad
    cut = out.memory.detached()
    assert not cut.tokens.requires_grad and torch.equal(cut.tokens, out.memory.tokens)
    after = model(tokens, cut, targets=tokens)
    grad, = torch.autograd.grad(after.nll.sum(), out.memory.tokens, allow_unused=True)
    assert grad is None


# ---------------------------------------------------------------- 8. memory length is configuration


def test_state_dict_independent_of_mem_len():
    src = build_model(tiny(mem_len=8))
    state = src.state_dict()
    tokens = torch.randint(0, 50, (2, 8))
    for kw in (dict(mem_len=80), dict(mem_len=0), dict(mem_len=0, tgt_len=32)):
        dst = build_model(tiny(**kw))
        dst.load_state_dict(state, strict=True)
        assert {k: v.shape for k, v in dst.state_dict().items()} == {k: v.shape for k, v in state.items()}
        out = dst(tokens, dst.init_memory(2), targets=tokens)
        out = dst(tokens, out.memory, targets=tokens)
        assert out.nll.shape == (2, 8)


def test_memory_state_is_mappable_and_saveable():
    torch.manual_seed(7)
    model = build_model(tiny(mem_len=4)).eval()
    tokens = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        memory = model(tokens[:, :8], model.init_memory(3), targets=tokens[:, :8]).memory
        want = model(tokens[:, 8:], memory, targets=tokens[:, 8:]).nll
        lane = map_memory(lambda t: t[1:2], memory)  # lane selection keeps every field consistent
        assert isinstance(lane, RMTMemory) and lane.tokens.shape[0] == 1 and lane.fresh.shape == (1,)
        one = model(tokens[1:2, 8:], lane, targets=tokens[1:2, 8:]).nll
        torch.testing.assert_close(one, want[1:2], rtol=0, atol=1e-6)
        buf = io.BytesIO()
        torch.save(dataclasses.asdict(memory), buf)  # plain tensors, lists and ints
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        back = RMTMemory(tokens=saved["tokens"], fresh=saved["fresh"], cache=type(memory.cache)(**saved["cache"]))
        assert torch.equal(model(tokens[:, 8:], back, targets=tokens[:, 8:]).nll, want)


# ---------------------------------------------------------------- 9. auxiliary memory loss


def test_aux_loss_is_weighted_nll_of_the_fixed_token():
    torch.manual_seed(8)
    tokens = torch.randint(0, 50, (2, 8))
    off = build_model(tiny(mem_len=4))
    assert off(tokens, off.init_memory(2), targets=tokens).aux_loss is None
    model = build_model(tiny(mem_len=4, num_mem_tokens=3, aux_loss_weight=0.25, aux_token_id=11)).train()
    out = model(tokens, model.init_memory(2), targets=tokens)
    write = out.memory.tokens  # [B, R, D] the write block's final outputs
    logits = write @ model.head.weights[0].t() + model.head.bias  # tied plain softmax, by hand
    want = 0.25 * -(logits.log_softmax(-1)[..., 11]).mean()
    assert out.aux_loss.dim() == 0
    torch.testing.assert_close(out.aux_loss, want, rtol=1e-5, atol=1e-6)
    out.aux_loss.backward()
    assert model.learned.memory_init.grad.abs().sum() > 0  # the aux loss trains the memory
