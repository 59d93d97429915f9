"""RMT + Transformer-XL cache holding projected keys and values (model.cache_keys_values, lucidrains' XL memories)
against the default cache of layer inputs re-projected every segment: with the same weights both compute the same
thing, so over segments with resets and a filling cache the NLL, the memory tokens and the attention inputs agree,
and the cached keys and values are exactly the projections of the cached layer inputs; gradients agree except the
key/value projection's, which the cached rows no longer reach; incremental decoding equals the segment forward;
the option needs a cache and arch rmt."""

import pytest
import torch

from memlm.models import ConfigError, ModelConfig, build_model
from memlm.trainer.inference.generate import Session
from support.models import perturbed, tiny_model_config

SETTINGS = {
    "default": {},
    "tokens-only": dict(cache_memory_rows=False),
    "memory-reads-cache": dict(read_mem_from_cache=True),
    "pre-ln-same-length-untied": dict(pre_lnorm=True, same_length=True, untie_r=True),
}


def _pair(**fields):
    cfg = dict(arch="rmt", mem_len=7, num_mem_tokens=2, dropout=0.0, dropatt=0.0, **fields)
    torch.manual_seed(0)
    plain = perturbed(build_model(tiny_model_config(**cfg))).double()
    cached = build_model(tiny_model_config(**cfg, cache_keys_values=True)).double()
    cached.load_state_dict(plain.state_dict())
    return plain, cached


def _segments(B=3, S=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    N = tiny_model_config().tgt_len
    tokens = torch.randint(0, tiny_model_config().vocab_size, (S, B, N + 1), generator=g)
    resets = [None, torch.tensor([False, True, False]), None, torch.tensor([True, False, False])]
    return [(t[:, :-1], t[:, 1:], resets[s % len(resets)]) for s, t in enumerate(tokens)]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_cached_keys_values_compute_the_reprojected_cache(setting):
    plain, cached = _pair(**SETTINGS[setting])
    mem_plain, mem_cached = plain.init_memory(3, dtype=torch.float64), cached.init_memory(3, dtype=torch.float64)
    with torch.no_grad():
        for tokens, targets, reset in _segments():
            a = plain(tokens, mem_plain, reset=reset, targets=targets)
            b = cached(tokens, mem_cached, reset=reset, targets=targets)
            torch.testing.assert_close(b.nll, a.nll, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(b.memory.tokens, a.memory.tokens, rtol=1e-10, atol=1e-10)
            assert torch.equal(b.memory.cache.valid, a.memory.cache.valid)
            for layer, rows, kv in zip(plain.layers, a.memory.cache.hidden, b.memory.cache.hidden):
                assert kv.shape == (3, 7, 2 * plain.cfg.n_head * plain.cfg.d_head)
                valid = a.memory.cache.valid  # empty slots hold whatever the lane's last rows were
                torch.testing.assert_close(kv[valid], layer.attn.kv_net(layer.attn_input(rows))[valid],
                                           rtol=1e-10, atol=1e-10)
            mem_plain, mem_cached = a.memory, b.memory


def test_gradients_agree_but_the_key_value_projection_s():
    """First segment (an empty cache): every gradient agrees. Later the cached rows no longer reach kv_net."""
    plain, cached = _pair()
    (t0, y0, _), (t1, y1, _) = _segments()[:2]
    grads = []
    for model in (plain, cached):
        first = model(t0, model.init_memory(3, dtype=torch.float64), targets=y0)
        g_first = torch.autograd.grad(first.nll.sum(), list(model.parameters()))
        second = model(t1, first.memory.detached(), targets=y1)
        g_second = torch.autograd.grad(second.nll.sum(), list(model.parameters()))
        grads.append((g_first, g_second))
    names = [name for name, _ in plain.named_parameters()]
    for name, a, b in zip(names, grads[0][0], grads[1][0]):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10, msg=name)
    for name, a, b in zip(names, grads[0][1], grads[1][1]):
        if "kv_net" in name:
            assert not torch.allclose(a, b, rtol=1e-6, atol=1e-8), name
        else:
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10, msg=name)


def test_incremental_decoding_equals_segment_forward():
    V, N = 50, 8
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="rmt", vocab_size=V, tgt_len=N, mem_len=8, num_mem_tokens=2, init_std=0.3,
                                    cache_keys_values=True)).eval()
    seq = torch.randint(0, V, (1, 4 * N))
    memory, reference = model.init_memory(1), []
    with torch.no_grad():
        for start in range(0, seq.shape[1], N):
            out = model(seq[:, start : start + N], memory, return_logits=True)
            memory = out.memory
            reference.append(out.logits[0])
    session = Session(model)
    per_token = torch.cat([session.feed([int(t)], all_logits=True) for t in seq[0]])
    torch.testing.assert_close(per_token, torch.cat(reference), atol=1e-4, rtol=0)


def test_the_option_needs_a_cache_and_arch_rmt():
    with pytest.raises(ConfigError, match="cache_keys_values.*mem_len is 0"):
        ModelConfig(arch="rmt", num_mem_tokens=2, mem_len=0, cache_keys_values=True).validate()
    with pytest.raises(ConfigError, match="cache_keys_values only applies to arch 'rmt'"):
        ModelConfig(arch="txl", mem_len=4, cache_keys_values=True).validate()
