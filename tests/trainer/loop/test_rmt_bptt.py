"""RMT's BPTT schedules in the trainer (trainer/loop/recurrence.py), measured by autograd on a real model:

* window mode (the paper): segment s's loss reaches exactly min(s, k) earlier segments, cut at a document start;
* chunk mode (truncated BPTT): reach 0, 1, ..., k, 0, 1, ..., k;
  both for every registered arch trained through its memory (RMT, ARMT): the schedule is the one place bptt_depth
  is enforced, the models carry the graph as far as they are chained;
* a checkpoint of older memlm (its states held a count of transitions; ARMT's an empty cache) resumes;
* window mode equals explicit loops written here (losses and every gradient, float64, with optimizer steps between):
  memlm's recipe its own reading of the paper, `bptt_recipe: authors` the RMT authors' train.py in their order;
* tokens per step: B x N in window mode, (k + 1) x B x N in chunk mode;
* the auxiliary memory loss is weighted once per scored segment, whatever k and the mode.

Nothing here uses DeepSpeed: the schedules take any forward callable, so the bare model stands in for the engine
(test_checkpoint.py and test_train.py run them through the real engine).
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch

from memlm.models import ARCHITECTURES, ConfigError, build_model
from memlm.models.rmt import RMTMemory
from memlm.models.txl import TXLMemory
from memlm.trainer.checkpoint.recurrent_state import RecurrenceStateError, plain_state
from memlm.trainer.loop.recurrence import ChunkBPTT, SegmentRecurrence, WindowBPTT, make_recurrence
from support.models import registry_config, tiny_model_config

B, N = 2, 8


tiny = functools.partial(tiny_model_config, arch="rmt", tgt_len=N, mem_len=0, num_mem_tokens=2)
# Every registered arch the trainer runs through its memory (window or chunk BPTT)
MEMORY_BPTT = sorted(name for name, spec in ARCHITECTURES.items() if spec.recurrence == "memory_bptt")


def bptt_config(arch: str, **fields):
    """RMT as `tiny`; any other arch as its registry tiny configuration, with a Transformer-XL cache only where
    asked for."""
    spec = ARCHITECTURES[arch]
    return registry_config(spec, tgt_len=N, **{"mem_len": 0, **fields}) if spec.mem_len != "positive" else \
        registry_config(spec, tgt_len=N, **fields)

def make_batches(n_seg: int, doc_starts: dict[int, set[int]], seed: int = 0) -> list[SimpleNamespace]:
    """n_seg batches [B, N] of distinct random tokens; lane b starts a document at segment 0 and at each segment
    in doc_starts[b]."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for s in range(n_seg):
        tokens = torch.randint(0, 50, (B, N), generator=gen)
        reset = torch.tensor([s == 0 or s in doc_starts.get(b, set()) for b in range(B)])
        batches.append(SimpleNamespace(tokens=tokens, targets=tokens.roll(-1, 1), reset=reset, index=s))
    return batches


class Recorder:
    """Forward callable for the schedules: runs the model and remembers, per call, which stream segment it read,
    the layer-0 token embeddings (kept for autograd) and the output."""

    def __init__(self, model, batches):
        self.model, self.batches, self.calls = model, batches, []
        self._embeds = []
        # memlm's layers embed with the module model.embed, a pretrained backbone with its transformers model's own
        embedding = model.embed if ARCHITECTURES[model.cfg.arch].memlm_layers else model.lm.get_input_embeddings()
        embedding.register_forward_hook(lambda mod, inp, out: self._embeds.append(out))

    def segment_of(self, tokens) -> int:
        return next(b.index for b in self.batches if torch.equal(b.tokens, tokens))

    def __call__(self, tokens, memory, reset=None, targets=None, tail_plan=None):
        out = self.model(tokens, memory, reset=reset, targets=targets, tail_plan=tail_plan)
        self.calls.append(SimpleNamespace(segment=self.segment_of(tokens), embed=self._embeds.pop(), out=out))
        return out


def reach(loss_lane: torch.Tensor, calls, segment: int) -> int:
    """How many segments before `segment` the scalar loss reaches through their token embeddings."""
    earlier = [c for c in calls if c.segment < segment]
    if not earlier:
        return 0
    grads = torch.autograd.grad(loss_lane, [c.embed for c in earlier], allow_unused=True, retain_graph=True)
    reached = {c.segment for c, g in zip(earlier, grads) if g is not None and g.abs().sum() > 0}
    if not reached:
        return 0
    assert reached == set(range(min(reached), segment)), f"reach of segment {segment} has gaps: {sorted(reached)}"
    return segment - min(reached)


def measured_reach(mode: str, k: int, n_seg: int, doc_starts: dict[int, set[int]], mem_len: int = 0,
                   arch: str = "rmt"):
    """Per lane, the reach of each new segment's loss: lists of length n_seg."""
    torch.manual_seed(k)
    model = build_model(bptt_config(arch, bptt_depth=k, bptt_mode=mode, mem_len=mem_len)).train()
    batches = make_batches(n_seg, doc_starts)
    stream = iter(batches)
    recurrence = make_recurrence(model.cfg, model.init_memory(B), "cpu")
    forward = Recorder(model, batches)
    per_lane = [[] for _ in range(B)]
    while len(per_lane[0]) < n_seg:
        forward.calls = []
        recurrence.step(forward, lambda: next(stream))
        if mode == "window":
            new = forward.calls[-1:]  # the new segment; the others are replays
        else:
            new = forward.calls  # chunk: every segment is new and scored
        for c in new:
            for b in range(B):
                per_lane[b].append(reach(c.out.nll[b].sum(), forward.calls, c.segment))
        recurrence.advance()
    return per_lane


def expected_reach(mode: str, k: int, n_seg: int, starts: set[int]) -> list[int]:
    """From the definitions: window reaches k back, chunk back to its chunk's start; never past a document start."""
    out = []
    for s in range(n_seg):
        last_start = max(d for d in {0} | starts if d <= s)
        back = k if mode == "window" else s % (k + 1)
        out.append(min(back, s - last_start))
    return out


@pytest.mark.parametrize("arch", MEMORY_BPTT)
@pytest.mark.parametrize("mode", ["window", "chunk"])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_gradient_reach_per_segment(mode, k, arch):
    """Lane 0 reads one long document, lane 1 starts a new one at segment 5 (inside a window)."""
    n_seg = (k + 1) * max(3, -(-8 // (k + 1)))  # whole chunks, at least 8 segments and 3 windows
    doc_starts = {1: {5}}
    got = measured_reach(mode, k, n_seg, doc_starts, arch=arch)
    print(f"\n{mode} k={k}: lane 0 {got[0]}  lane 1 (document start at 5) {got[1]}")
    assert got[0] == expected_reach(mode, k, n_seg, set())
    assert got[1] == expected_reach(mode, k, n_seg, {5})
    if mode == "window":
        assert got[0][k:] == [k] * (n_seg - k)  # [0, 1, ..., k, k, k, ...]
    else:
        assert got[0] == [s % (k + 1) for s in range(n_seg)]  # [0..k, 0..k, ...]


def test_gradient_reach_with_the_transformer_xl_cache():
    """The stop-gradient cache adds no path: Tr-XL + RMT's window reach is the same."""
    got = measured_reach("window", 2, 8, {1: {4}}, mem_len=5)
    assert got[0] == expected_reach("window", 2, 8, set())
    assert got[1] == expected_reach("window", 2, 8, {4})


# ---------------------------------------------------------------- window == explicit loops
# Two references, each a plain loop with an SGD step after every new segment, in float64 with every gradient
# compared: memlm's reading of the paper (`memlm_loop`) and the RMT authors' train.py in their own order of
# operations (`authors_loop`). Neither calls the schedule under test; both call the model.


def sgd(model, loss: torch.Tensor, lr: float) -> tuple[float, dict]:
    """Backward, the gradients kept, one SGD step: (loss, {name: gradient})."""
    model.zero_grad()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return float(loss.detach()), grads


def memlm_loop(model, batches, k, steps, lr, replay_loss=False, start="replayed", new_cache="stored",
               reduction="token_mean"):
    """memlm's window (docs/design.md §3) written plainly: before each new segment t, rerun segments t-k..t-1
    with the current weights, starting from the memory that segment t-k-1 wrote the last time it ran (in the
    previous step, where it was the first segment run). Segment t reads the Transformer-XL cache the new segment
    before it left; a rerun reads the one that was there when it was new.

    One of the authors' choices at a time (models/config.py BPTT_CHOICES): start="stored" starts the rerun from
    the memory the new segment before t-k wrote; new_cache="replayed" gives segment t the cache its reruns just
    produced (its own reruns later still read the one from before); reduction="segment_sum" adds the scored
    segments' mean NLLs. Returns [(loss, grads)] per step."""
    empty = model.init_memory(B, dtype=torch.float64)
    cache_before = {}  # segment -> the cache the new segment before it left
    wrote_when_new = {}  # segment -> the memory the new segment before it wrote
    live_cache, last_new, previous_first = empty.cache, empty, None
    history = []
    for t in range(steps):
        wrote_when_new[t], cache_before[t] = last_new.detached(), live_cache
        first = max(0, t - k)
        if first == 0:
            mem = empty
        elif start == "stored":
            mem = wrote_when_new[first]
        else:
            assert previous_first[0] == first - 1
            mem = previous_first[1].detached()
        parts, aux = [], []
        for j in range(first, t + 1):
            b = batches[j]
            scored = j == t or replay_loss
            cache = mem.cache if j == t and new_cache == "replayed" and first < t else cache_before[j]
            out = model(b.tokens, dataclasses.replace(mem, cache=cache), reset=b.reset,
                        targets=b.targets if scored else None)
            if scored:
                parts.append((out.nll.sum(), int((b.targets != -100).sum())))
                if out.aux_loss is not None:
                    aux.append(out.aux_loss)
            if j == first:
                previous_first = (j, out.memory)
            mem = out.memory
        live_cache, last_new = mem.cache, mem
        if reduction == "segment_sum":
            nll_term = sum(nll / count for nll, count in parts)
        else:
            nll_term = sum(nll for nll, _ in parts) / sum(count for _, count in parts)
        history.append(sgd(model, nll_term + (sum(aux) / len(aux) if aux else 0.0), lr))
    return history


def authors_loop(model, batches, k, steps, lr, bptt_bp=False):
    """The RMT authors' training loop (booydar/LM-RMT pytorch/train.py, train(); k = --mem_backprop_depth),
    statement by statement in their order. Per batch:

      mem_tokens <- the previous batch's new-segment output, detached; at the first batch the learned memory
                    itself (`model.mem_tokens.repeat(...)`), in the graph
      if k > 0:
        prev_data       <- its last k entries + [this batch]
        prev_mems       <- its last k entries + [mems]    mems: the cache the previous batch's NEW segment returned
        prev_mem_tokens <- its last k entries + [mem_tokens.detach()]
        mem_tokens      <- prev_mem_tokens[0]             train.py writes `mem_tokens.values = ...`, which sets an
                                                          attribute and leaves the tensor; train_synthetic.py's
                                                          `mem_tokens = prev_mem_tokens[0]` is what it means
        for each earlier listed segment, with its listed cache: forward, then mem_tokens, mems <- its outputs
                                                          (--bptt_bp: its mean loss is backpropagated too)
      forward this batch on mem_tokens and mems as they now are (after a replay: the cache it recomputed), then
      mem_tokens, mems <- its outputs; its mean loss backpropagated; optimizer step.

    Their stream never starts a document. Here a document start is the model's own reset (the lane reads the
    learned memory, its cache emptied); the lane reads it as their first batch does: in the graph at k = 0 (no
    replay branch), through a detached copy at k > 0, where the caller freezes memory_init. The first batch goes
    in without its reset flags: the loop supplies its first memory itself, as theirs does."""
    mems = model.init_memory(B, dtype=torch.float64).cache
    mem_tokens = None
    prev_data, prev_mems, prev_mem_tokens = [], [], []

    def forward(batch, tokens, cache):
        reset = torch.zeros_like(batch.reset) if batch is batches[0] else batch.reset
        memory = RMTMemory(tokens=tokens, fresh=torch.zeros(B, dtype=torch.bool), cache=cache)
        out = model(batch.tokens, memory, reset=reset, targets=batch.targets)
        return out.memory.tokens, out.memory.cache, out.nll.sum() / int((batch.targets != -100).sum())

    history = []
    for t in range(steps):
        data = batches[t]
        if mem_tokens is not None:
            mem_tokens = mem_tokens.detach()
        else:
            mem_tokens = model.learned.memory_init[None].expand(B, -1, -1)
        losses = []
        if k > 0:
            prev_data = prev_data[-k:] + [data]
            prev_mems = prev_mems[-k:] + [mems]
            prev_mem_tokens = prev_mem_tokens[-k:] + [mem_tokens.detach()]
            mem_tokens = prev_mem_tokens[0]
            for pd, pm in zip(prev_data[:-1], prev_mems[:-1]):
                mem_tokens, mems, loss = forward(pd, mem_tokens, pm)
                if bptt_bp:
                    losses.append(loss)
        mem_tokens, mems, loss = forward(data, mem_tokens, mems)
        losses.append(loss)
        history.append(sgd(model, sum(losses), lr))
    return history


def recurrence_run(model, batches, k, steps, lr, replay_loss=False):
    stream = iter(batches)
    recurrence = make_recurrence(model.cfg, model.init_memory(B, dtype=torch.float64), "cpu")
    assert isinstance(recurrence, WindowBPTT) and recurrence.replay_loss == replay_loss
    history = []
    for _ in range(steps):
        mb = recurrence.step(model, lambda: next(stream))
        history.append(sgd(model, mb.loss, lr))
        recurrence.advance()
    return history


def twin_models(cfg_a, cfg_b):
    """Two float64 models with the same weights, configured as given."""
    torch.manual_seed(13)
    model_a = build_model(cfg_a).double().train()
    model_b = build_model(cfg_b).double().train()
    model_b.load_state_dict(model_a.state_dict())
    return model_a, model_b


def assert_same_training(want, got):
    """The same loss and every gradient at every step; both runs' weights really moved."""
    for t, ((loss_w, grads_w), (loss_g, grads_g)) in enumerate(zip(want, got, strict=True)):
        assert loss_g == pytest.approx(loss_w, rel=1e-10, abs=1e-12), f"step {t}"
        assert grads_g.keys() == grads_w.keys(), f"step {t}"
        for name in grads_w:
            torch.testing.assert_close(grads_g[name], grads_w[name], rtol=1e-9, atol=1e-12, msg=f"step {t} {name}")
    assert want[-1][0] != want[0][0]


@pytest.mark.parametrize("k,mem_len,replay_loss,aux", [(2, 0, False, 0.0), (3, 5, False, 0.1), (2, 4, True, 0.1)])
def test_window_equals_memlm_loop(k, mem_len, replay_loss, aux):
    steps = 3 * k + 2
    batches = make_batches(steps, {0: {4}, 1: {2, 6}}, seed=3)
    cfg = tiny(bptt_depth=k, mem_len=mem_len, bptt_replay_loss=replay_loss, aux_loss_weight=aux)
    model_a, model_b = twin_models(cfg, cfg)
    want = memlm_loop(model_a, batches, k, steps, lr=0.5, replay_loss=replay_loss)
    got = recurrence_run(model_b, batches, k, steps, lr=0.5, replay_loss=replay_loss)
    assert_same_training(want, got)


@pytest.mark.parametrize("mem_len", [0, 4])
@pytest.mark.parametrize("k,bptt_bp", [(0, False), (1, True), (2, False), (2, True), (3, True)])
def test_authors_recipe_equals_the_authors_loop(k, bptt_bp, mem_len):
    """bptt_recipe: authors against their train.py's loop: 8 steps, document starts inside the window (lane 0 at
    segment 4, lane 1 at 2 and 6), with and without the Transformer-XL cache and --bptt_bp. The learned initial
    memory trains at k = 0 only (their first batch reads it in the graph; at k > 0 only a detached copy)."""
    steps = 8
    batches = make_batches(steps, {0: {4}, 1: {2, 6}}, seed=5)
    common = dict(bptt_depth=k, mem_len=mem_len, bptt_replay_loss=bptt_bp)
    model_a, model_b = twin_models(tiny(**common), tiny(**common, bptt_recipe="authors"))
    if k > 0:
        model_a.learned.memory_init.requires_grad_(False)
    want = authors_loop(model_a, batches, k, steps, lr=0.5, bptt_bp=bptt_bp)
    got = recurrence_run(model_b, batches, k, steps, lr=0.5, replay_loss=bptt_bp)
    assert_same_training(want, got)
    assert ("learned.memory_init" in got[0][1]) == (k == 0)


# The RMT authors' choice for each option alone (against memlm's loop with that one choice).
AUTHORS_OPTIONS = {
    "stored_start": dict(cfg={"bptt_start_memory": "stored"}, loop={"start": "stored"}),
    "replayed_cache": dict(cfg={"bptt_new_segment_cache": "replayed"}, loop={"new_cache": "replayed"}),
    "segment_sum": dict(cfg={"bptt_replay_reduction": "segment_sum"}, loop={"reduction": "segment_sum"}),
    "detached_init": dict(cfg={"memory_init_grad": "detached"}, loop={}),
}


@pytest.mark.parametrize("option", sorted(AUTHORS_OPTIONS))
def test_each_authors_choice_equals_memlm_loop_with_it(option):
    """Losses and every gradient over several SGD steps, with a Transformer-XL cache, replay loss and aux loss on,
    and document starts inside windows. A detached initial memory is checked against a loop whose model holds
    memory_init as a constant: the same function, and no gradient ever reaches it."""
    k, steps = 2, 8
    spec = AUTHORS_OPTIONS[option]
    batches = make_batches(steps, {0: {4}, 1: {2, 6}}, seed=5)
    common = dict(bptt_depth=k, mem_len=4, bptt_replay_loss=True, aux_loss_weight=0.1)
    model_a, model_b = twin_models(tiny(**common), tiny(**common, **spec["cfg"]))
    detached = model_b.cfg.bptt_choice("memory_init_grad") == "detached"
    if detached:
        model_a.learned.memory_init.requires_grad_(False)
    want = memlm_loop(model_a, batches, k, steps, lr=0.5, replay_loss=True, **spec["loop"])
    got = recurrence_run(model_b, batches, k, steps, lr=0.5, replay_loss=True)
    assert_same_training(want, got)
    assert ("learned.memory_init" in got[0][1]) != detached


def test_the_authors_choices_change_the_training():
    """Each choice alone, and the whole recipe, makes a difference a test could see (otherwise the tests above
    would prove nothing)."""
    k, steps = 2, 6
    batches = make_batches(steps, {1: {3}}, seed=5)
    choices = {name: spec["cfg"] for name, spec in AUTHORS_OPTIONS.items()}
    runs = {}
    for option, cfg in {"memlm": {}, **choices, "authors_recipe": {"bptt_recipe": "authors"}}.items():
        torch.manual_seed(13)
        model = build_model(tiny(bptt_depth=k, mem_len=4, bptt_replay_loss=True, **cfg)).double().train()
        runs[option] = recurrence_run(model, batches, k, steps, lr=0.5, replay_loss=True)
    for option in runs.keys() - {"memlm"}:
        differs = any(abs(a[0] - b[0]) > 1e-6 or any(not torch.allclose(a[1][n], b[1].get(n, torch.zeros(0)))
                                                     for n in a[1] if n in b[1])
                      for a, b in zip(runs["memlm"], runs[option]))
        assert differs, option


# ---------------------------------------------------------------- tokens per step and the aux weight


class CountingStream:
    def __init__(self, batches):
        self.batches, self.taken = iter(batches), 0

    def __call__(self):
        self.taken += 1
        return next(self.batches)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_tokens_per_step(k):
    model = build_model(tiny(bptt_depth=k)).train()
    for mode, per_step in (("window", 1), ("chunk", k + 1)):
        stream = CountingStream(make_batches(4 * (k + 1), {}))
        recurrence = make_recurrence(tiny(bptt_depth=k, bptt_mode=mode), model.init_memory(B), "cpu")
        for step in range(1, 4):
            mb = recurrence.step(model, stream)
            recurrence.advance()
            assert mb.inputs == per_step * B * N, mode
            assert stream.taken == step * per_step, mode


def raw_aux_nll(model, write: torch.Tensor) -> torch.Tensor:
    """Mean NLL of aux_token_id from the write outputs [B, R, D], by hand through the tied plain softmax."""
    logits = write @ model.head.weights[0].t() + model.head.bias
    return -(logits.log_softmax(-1)[..., model.cfg.aux_token_id]).mean()


@pytest.mark.parametrize("mode", ["window", "chunk"])
def test_aux_loss_weight_does_not_change_with_k(mode):
    """With every target ignored the micro-batch loss is the aux term alone: weight x the mean over the scored
    segments of their write rows' aux NLL, for every k."""
    weight = 0.3
    for k in (0, 1, 3):
        torch.manual_seed(2)
        cfg = tiny(bptt_depth=k, bptt_mode=mode, aux_loss_weight=weight, aux_token_id=7)
        model = build_model(cfg).eval()  # no dropout: the recorded write rows are the ones the loss used
        batches = make_batches(3 * (k + 1), {})
        for b in batches:
            b.targets = torch.full_like(b.targets, -100)
        forward = Recorder(model, batches)
        stream = iter(batches)
        recurrence = make_recurrence(cfg, model.init_memory(B), "cpu")
        for _ in range(2):
            forward.calls = []
            mb = recurrence.step(forward, lambda: next(stream))
            scored = forward.calls[-1:] if mode == "window" else forward.calls
            raw = torch.stack([raw_aux_nll(model, c.out.memory.tokens) for c in scored]).mean()
            assert float(mb.loss) == pytest.approx(weight * float(raw), rel=1e-5), (k, mode)
            recurrence.advance()


@pytest.mark.parametrize("arch", ["rmt", "armt"])  # the archs whose states older memlm saved (not a newer arch's)
@pytest.mark.parametrize("mode", ["window", "chunk"])
def test_a_checkpoint_of_older_memlm_resumes(mode, arch):
    """Older memlm saved the models' count of BPTT transitions in RMT's and ARMT's states, and ARMT's empty
    Transformer-XL cache in its state and in each window segment (the window read it as RMT's): a resume drops them
    (`retired_fields`) and goes on as the run that wrote the checkpoint; another unknown field is still refused."""
    torch.manual_seed(0)
    model = build_model(bptt_config(arch, bptt_depth=2, bptt_mode=mode)).train()
    stream = iter(make_batches(7, {}))  # two chunk steps of 3 segments and one more
    writer = make_recurrence(model.cfg, model.init_memory(B), "cpu")
    for _ in range(2):
        writer.step(model, lambda: next(stream))
        writer.advance()
    old = writer.state_dict()
    memory = writer.memory
    old["memory"]["transitions"] = 0
    if not hasattr(memory, "cache"):
        cfg = model.cfg
        empty = plain_state(TXLMemory(hidden=[torch.zeros(B, 0, cfg.d_model)] * cfg.n_layer,
                                      valid=torch.zeros(B, 0, dtype=torch.bool)))
        old["memory"]["cache"] = empty
        for segment in old.get("window", []):
            segment["cache"] = empty
    reader = make_recurrence(model.cfg, model.init_memory(B), "cpu")
    reader.load_state_dict(old)
    batch = next(stream)
    losses = [float(r.step(model, lambda: batch).loss) for r in (writer, reader)]
    assert losses[0] == losses[1]
    old["memory"]["bogus"] = 0
    with pytest.raises(RecurrenceStateError, match="the checkpoint's memory has fields"):
        make_recurrence(model.cfg, model.init_memory(B), "cpu").load_state_dict(old)


def test_non_rmt_archs_take_one_segment():
    cfg = tiny(arch="txl", num_mem_tokens=0, mem_len=8)
    model = build_model(cfg)
    recurrence = make_recurrence(cfg, model.init_memory(B), "cpu")
    assert isinstance(recurrence, SegmentRecurrence)
    assert isinstance(make_recurrence(tiny(bptt_mode="chunk"), None, "cpu"), ChunkBPTT)
    assert isinstance(make_recurrence(tiny(), None, "cpu"), WindowBPTT)  # the paper's schedule is the default


@pytest.mark.parametrize("option", [dict(bptt_start_memory="stored"), dict(bptt_new_segment_cache="replayed"),
                                    dict(bptt_replay_reduction="segment_sum"), dict(bptt_recipe="authors")])
def test_window_only_choices_are_refused_in_chunk_mode(option):
    """Chunk mode has no replay: the window step's choices would be silently ignored there."""
    name = next(iter(option))
    with pytest.raises(ConfigError, match=f"^model.{name} only applies to model.bptt_mode=window"):
        tiny(bptt_mode="chunk", **option).validate()
    tiny(bptt_mode="chunk", memory_init_grad="detached").validate()  # the model's choice: both modes
