"""Compile once, for every registered arch: a whole-model torch.compile captures one graph at the first segment,
with no graph break (the adaptive softmax's tails included: their rows come from a tail plan built on the host,
head_plan.py), and never recompiles, whatever the later segments bring (resets, a memory that fills, tokens spread
anew over the clusters). The carried state is what the model returned, detached (as the trainer carries it): no
`.contiguous()` or copy on the caller's side, so a state whose layout differs from the one it replaces (a slice
of a concatenation) shows up here as a recompile at the second segment.

Two settings: the training step with the einsum attention (forward and backward), and the GPU's kernels
(`attention: flex`, `head_loss: chunked`) forward-only, as FlexAttention has no backward on a CPU. Captured with
the aot_eager backend (inductor's graph capture, guards and recompiles, without its code generation).
"""

import pytest
import torch

from memlm.models import ARCHITECTURES, build_model
from memlm.models.head_plan import tail_plan
from support.models import layer_fields, registry_config

# `-m 'not slow'` leaves these out: torch.compile of every arch, 100 s in all on 2 busy cores
pytestmark = pytest.mark.slow

# One layer: what compiles is the same at any depth, at half the trace time. Three segments: the first captures;
# a recompile would come at the second (the carried state's layout) or at a reset.
SEGMENTS = 3


def _config(name: str, **fields):
    """The arch's tiny model with a 300-token vocabulary; memlm's layers at one layer, with adaptive softmax tails
    and the kernels `fields` name (a pretrained backbone has its own layers, head and attention)."""
    spec = ARCHITECTURES[name]
    return registry_config(spec, vocab_size=300,
                           **layer_fields(spec, **{"cutoffs": [40, 120], "dropout": 0.0, "n_layer": 1, **fields}))


def _graphs_per_segment(model, train: bool) -> tuple[list[int], dict]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    B, N = 3, model.cfg.tgt_len
    memory = model.init_memory(B)
    gen = torch.Generator().manual_seed(1)
    graphs = []
    for segment in range(SEGMENTS):
        tokens = torch.randint(0, model.cfg.vocab_size, (B, N + 1), generator=gen)
        reset = torch.tensor([segment == 0, segment == 2, False])
        plan = tail_plan(tokens[:, 1:], model.cfg.cutoffs, model.cfg.vocab_size)
        with torch.set_grad_enabled(train):
            out = compiled(tokens[:, :-1], memory, reset=reset, targets=tokens[:, 1:], tail_plan=plan)
            if train:
                loss = out.nll.sum() + (out.aux_loss if out.aux_loss is not None else 0.0)
                loss.backward()
        memory = out.memory.detached()
        graphs.append(int(counters["stats"]["unique_graphs"]))
    return graphs, dict(counters["graph_break"])


# The Compressive Transformer's attention-reconstruction loss (training only) reads the layer's weights as
# constants by switching their requires_grad off around the read (compressive.weights_as_constants, so that ZeRO-3's
# gathering hooks still run); dynamo cannot trace that switch and splits the training forward around each layer's
# reconstruction (13 graphs at 2 layers), though it never recompiles. Its evaluation forward is one graph.
SPLIT_IN_TRAINING = {"compressive"}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_training_step_compiles_once(name):
    torch.manual_seed(0)
    model = build_model(_config(name, attention="eager", head_loss="chunked")).train()
    graphs, breaks = _graphs_per_segment(model, train=True)
    if name in SPLIT_IN_TRAINING:
        assert graphs == [graphs[0]] * SEGMENTS, f"graphs captured by the end of each segment: {graphs}"
        return
    assert graphs == [1] * SEGMENTS, f"graphs captured by the end of each segment: {graphs}"
    assert not breaks, breaks


# memlm's layers' kernels: a pretrained backbone attends with its own (transformers' SDPA) and has no chunked head
@pytest.mark.parametrize("name", sorted(name for name, spec in ARCHITECTURES.items() if spec.memlm_layers))
def test_gpu_kernels_compile_once(name):
    torch.manual_seed(0)
    model = build_model(_config(name, attention="flex", head_loss="chunked")).eval()
    graphs, breaks = _graphs_per_segment(model, train=False)
    assert graphs == [1] * SEGMENTS, f"graphs captured by the end of each segment: {graphs}"
    assert not breaks, breaks
