"""Layers compiled alone (`compile_layers`): one graph per kind of layer, equal to the eager model. The whole-model
compile of every registered arch is tests/models/test_compile_once.py's.

Captured with the aot_eager backend (the same graph capture, guards and recompiles as inductor, without its
minutes of C++ code generation on CI's CPUs); bench/benchmarks/bench_mfu.py --compile measures inductor.
"""

import pytest
import torch

from memlm.models import build_model
from support.models import tiny_model_config

ARCHS = {"transformer": dict(arch="transformer", mem_len=0), "txl": dict(arch="txl"), "lamemo": dict(arch="lamemo"),
         "rmt": dict(arch="rmt", mem_len=4, num_mem_tokens=2)}


def _detached(memory):
    """The state cut from the graph, as the trainer carries it between micro-batches."""
    import dataclasses

    if isinstance(memory, torch.Tensor):
        return memory.detach()
    if isinstance(memory, list):
        return [_detached(m) for m in memory]
    if dataclasses.is_dataclass(memory):
        return dataclasses.replace(memory, **{f.name: _detached(getattr(memory, f.name))
                                              for f in dataclasses.fields(memory)})
    return memory


# Layers compiled alone (`compile_layers`): the graphs one layer's work makes, however many layers run it.
LAYER_GRAPHS = {"transformer": 1, "txl": 1, "lamemo": 2, "rmt": 1}  # LaMemo's last layer updates only its cache


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_compiled_layers_share_one_graph_and_compute_what_the_eager_model_does(arch):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = tiny_model_config(**ARCHS[arch], n_layer=4, dropout=0.0)
    eager, compiled = build_model(cfg).train(), build_model(cfg).train()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_layers(backend="aot_eager", dynamic=False)
    B, N = 3, cfg.tgt_len
    tokens = torch.randint(0, cfg.vocab_size, (B, 4 * N + 1), generator=torch.Generator().manual_seed(2))
    memories = {"eager": eager.init_memory(B), "compiled": compiled.init_memory(B)}
    for segment in range(4):
        seq = tokens[:, segment * N : (segment + 1) * N + 1]
        reset = torch.tensor([segment == 0, segment == 2, False])
        losses = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            out = model(seq[:, :-1], memories[name], reset=reset, targets=seq[:, 1:])
            losses[name] = out.nll.mean()
            losses[name].backward()
            memories[name] = _detached(out.memory)
        torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-6, atol=1e-6)
    for (name, want), got in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert int(counters["stats"]["unique_graphs"]) == LAYER_GRAPHS[arch]
    assert not counters["graph_break"], dict(counters["graph_break"])
