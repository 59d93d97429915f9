"""memlm models: Transformer+RPE, Transformer-XL, LaMemo and RMT behind one contract (docs/design.md §3).

    model = build_model(ModelConfig(arch="lamemo", ...))
    memory = model.init_memory(batch_size=B)
    out = model(tokens, memory, reset=reset, targets=targets)   # out.nll, out.logits, out.memory

`ModelConfig` and `ConfigError` import without torch (the command line parses configs before it needs a
model); everything else loads torch on first use.
"""

from .config import ARCHS, ConfigError, ModelConfig


def build_model(cfg: ModelConfig):
    """The nn.Module for cfg.arch; raises ConfigError for an impossible configuration."""
    cfg.validate()
    if cfg.arch in ("transformer", "txl"):
        from .txl import TransformerXL

        return TransformerXL(cfg)
    if cfg.arch == "lamemo":
        from .lamemo import LaMemo

        return LaMemo(cfg)
    from .rmt import RecurrentMemoryTransformer

    return RecurrentMemoryTransformer(cfg)


def __getattr__(name: str):
    if name in ("ModelOutput", "map_memory"):
        from . import output

        return getattr(output, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = ["ARCHS", "ConfigError", "ModelConfig", "ModelOutput", "build_model", "map_memory"]
