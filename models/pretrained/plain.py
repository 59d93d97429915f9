"""The backbone of a pretrained-backbone model as transformers alone: what `memlm export --hf-backbone` saves with
save_pretrained, so that the folder is a plain Hugging Face model (transformers' own parameter names) that
`model.backbone` loads as any other.

Two things memlm adds to the transformers model it trains are taken off a copy (the model itself is left as it is):
LoRA adapters (model.backbone_train: lora) are merged into the weights they adapt, W + (alpha / r) B A, by peft's own
merge, and each adapted module is replaced by its base layer, as peft's merge_and_unload does; ARMT's associative
wrapper around each decoder layer (armt.AssociativeLayer) is replaced by the layer it wraps. The memory's own
parameters (memory_init, the associative projections) are not part of the backbone and are not in the copy.

Imports neither transformers nor peft: an adapted module is found as peft's unload finds it (a `base_layer` and a
`merge`), so this module stays out of the list of those that wrap a Hugging Face model.
"""

from __future__ import annotations

import copy

from torch import nn

from .armt import AssociativeLayer
from .causal_lm import PretrainedCausalLM


def plain_backbone(model: PretrainedCausalLM) -> nn.Module:
    """A copy of model.lm with LoRA merged and the memory's layer wrappers removed (a transformers *ForCausalLM)."""
    lm = copy.deepcopy(model.lm)
    unwrap_layers(lm)
    merge_adapters(lm)
    if hasattr(lm, "peft_config"):  # peft's record of the adapters, gone with them (transformers would save adapters)
        del lm.peft_config
    return lm


def unwrap_layers(lm: nn.Module) -> None:
    """Put every decoder layer that ARMT wraps back in its ModuleList in place of its wrapper."""
    for modules in lm.modules():
        if isinstance(modules, nn.ModuleList):
            for i, layer in enumerate(modules):
                if isinstance(layer, AssociativeLayer):
                    modules[i] = layer.layer


def merge_adapters(lm: nn.Module) -> None:
    """Merge every LoRA-adapted module into its base layer and put the base layer in its place."""
    adapted = [(name, module) for name, module in lm.named_modules()
               if hasattr(module, "base_layer") and callable(getattr(module, "merge", None))]
    for name, module in adapted:
        module.merge()  # base weight += scale * B @ A (transposed for GPT-2's Conv1D: peft's fan_in_fan_out)
        parent_name, _, child = name.rpartition(".")
        setattr(lm.get_submodule(parent_name) if parent_name else lm, child, module.get_base_layer())
