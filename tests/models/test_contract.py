"""The model contract every architecture keeps (docs/design.md §3): no leakage of future tokens, document isolation
under `reset`, memory length as configuration only, logits consistent with nll, detached caches."""

import functools

import pytest
import torch

from memlm.models import ARCHITECTURES, build_model, map_memory
from support.models import registry_fields, tiny_model_config

VARIANTS = {
    "transformer": dict(arch="transformer", mem_len=0),
    "txl": dict(arch="txl"),
    "txl-same-length-clamp": dict(arch="txl", same_length=True, clamp_len=5),
    "lamemo": dict(arch="lamemo"),
    "lamemo-short-mem": dict(arch="lamemo", mem_len=3),
    "lamemo-xl-rpe": dict(arch="lamemo", rpe="xl"),
    "lamemo-no-lookahead": dict(arch="lamemo", lookahead=False),
    "lamemo-no-interp": dict(arch="lamemo", interpolate=False),
    "rmt": dict(arch="rmt", mem_len=0, num_mem_tokens=2, bptt_depth=1),
    "rmt-cache-aux": dict(arch="rmt", num_mem_tokens=3, bptt_depth=2, aux_loss_weight=0.1, same_length=True),
    "rmt-token-cache-read": dict(arch="rmt", num_mem_tokens=2, read_mem_from_cache=True, cache_memory_rows=False),
    "rmt-row-cache-read": dict(arch="rmt", num_mem_tokens=2, mem_len=13, read_mem_from_cache=True),
    "compressive": dict(arch="compressive", compressed_len=4, compression_rate=2),
    "compressive-short-mem-pool": dict(arch="compressive", mem_len=4, compressed_len=6, compression_rate=4,
                                       compression="max"),
    "infinite_former": dict(arch="infinite_former", ltm_basis=6, ltm_samples=5),
    "infinite_former-sticky-short-mem": dict(arch="infinite_former", mem_len=2, ltm_basis=4, ltm_samples=3,
                                             ltm_sticky=True, ltm_sticky_bins=6),
    # W_v random (not the authors' zeros): a new model's state then carries the past
    "armt": dict(arch="armt", mem_len=0, num_mem_tokens=2, assoc_dim=3, assoc_value_init_std=0.1),
    "armt-one-token-bptt": dict(arch="armt", mem_len=0, num_mem_tokens=1, assoc_dim=2, bptt_depth=2,
                                assoc_value_init_std=0.1),
}
# Every registered arch is under the contract: a new one by its registry entry's tiny settings (support.models)
for _spec in ARCHITECTURES.values():
    VARIANTS.setdefault(_spec.name, registry_fields(_spec))


tiny = functools.partial(tiny_model_config, vocab_size=40, tgt_len=4, mem_len=6)

def run(model, tokens, resets=None):
    """tokens [B, S*N] processed N at a time; resets: {segment index: [B] bool}. Returns log-probs [B, S*N, V]."""
    N = model.cfg.tgt_len
    memory = model.init_memory(tokens.shape[0])
    outs = []
    for k, s in enumerate(range(0, tokens.shape[1], N)):
        reset = (resets or {}).get(k)
        out = model(tokens[:, s : s + N], memory, reset=reset, targets=None, return_logits=True)
        memory = out.memory
        outs.append(out.logits)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_leakage_from_future_tokens(variant):
    torch.manual_seed(0)
    model = build_model(tiny(**VARIANTS[variant])).eval()
    tokens = torch.randint(0, 40, (2, 16))
    base = run(model, tokens)
    for t in range(15):
        changed = tokens.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 7) % 40
        out = run(model, changed)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6, msg=f"leak into position {t}")
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :]), "the change had no effect at all"


@pytest.mark.parametrize("variant", VARIANTS)
def test_reset_isolates_documents(variant):
    """Lane 0 reads doc A (2 segments) then doc B with reset; its outputs on B equal a fresh model's on B alone,
    whatever A was. Lane 1 never resets and must be unaffected by lane 0's reset."""
    torch.manual_seed(1)
    model = build_model(tiny(**VARIANTS[variant])).eval()
    doc_a, doc_b = torch.randint(0, 40, (2, 8)), torch.randint(0, 40, (2, 8))
    tokens = torch.cat([doc_a, doc_b], dim=1)
    reset = {2: torch.tensor([True, False])}
    got = run(model, tokens, reset)
    fresh = run(model, doc_b)
    torch.testing.assert_close(got[0, 8:], fresh[0], rtol=0, atol=1e-6)
    other_a = torch.randint(0, 40, (2, 8))
    got_other = run(model, torch.cat([other_a, doc_b], dim=1), reset)
    torch.testing.assert_close(got_other[0, 8:], got[0, 8:], rtol=0, atol=1e-6)
    if ARCHITECTURES[VARIANTS[variant]["arch"]].has_memory:  # lane 1 did not reset, so its past still matters
        assert not torch.allclose(got_other[1, 8:], got[1, 8:])


@pytest.mark.parametrize("variant", VARIANTS)
def test_memory_length_is_configuration_only(variant):
    """A state dict trained with M loads strictly into the same arch built with 10 M (and another N), and runs."""
    options = VARIANTS[variant]
    small = build_model(tiny(**options))
    mem = options.get("mem_len", 6)
    n = 2 * options["compression_rate"] if "compression_rate" in options else 7  # segments must compress whole
    big = build_model(tiny(**{**options, "mem_len": 10 * mem, "tgt_len": n}))
    big.load_state_dict(small.state_dict(), strict=True)
    tokens = torch.randint(0, 40, (2, 3 * n))
    out = run(big.eval(), tokens)
    assert out.shape == (2, 3 * n, 40) and torch.isfinite(out).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_nll_is_cross_entropy_of_logits_and_ignores_padding(variant):
    torch.manual_seed(2)
    model = build_model(tiny(**VARIANTS[variant])).eval()
    tokens = torch.randint(0, 40, (3, 4))
    targets = torch.randint(0, 40, (3, 4))
    targets[1, 2:] = -100
    out = model(tokens, model.init_memory(3), targets=targets, return_logits=True)
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 40), targets.reshape(-1), reduction="none",
                                             ignore_index=-100)
    torch.testing.assert_close(out.nll.reshape(-1), want, rtol=1e-5, atol=1e-5)
    assert (out.nll[1, 2:] == 0).all()
    plain = model(tokens, model.init_memory(3), targets=targets)  # the training path, without logits
    torch.testing.assert_close(plain.nll, out.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", [v for v, options in VARIANTS.items()  # not RMT's or ARMT's: trained through
                                     if ARCHITECTURES[options["arch"]].recurrence == "segment"])
def test_cached_memory_is_stop_gradient(variant):
    model = build_model(tiny(**VARIANTS[variant])).train()
    tokens = torch.randint(0, 40, (2, 4))
    out = model(tokens, model.init_memory(2), targets=tokens)
    leaves = []
    map_memory(lambda t: leaves.append(t) or t, out.memory)
    assert leaves and not any(t.requires_grad for t in leaves)
