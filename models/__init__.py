"""memlm models: every arch of registry.py (`memlm config --list` prints them; not listed here, so a new arch
touches no file but its own) behind one contract (docs/design.md §3).

    model = build_model(ModelConfig(arch="lamemo", ...))
    memory = model.init_memory(batch_size=B)
    out = model(tokens, memory, reset=reset, targets=targets)   # out.nll, out.logits, out.memory

`ModelConfig` and `ConfigError` import without torch (the command line parses configs before it needs a
model); everything else loads torch on first use.
"""

from .config import ARCHS, ConfigError, ModelConfig
from .registry import ARCHITECTURES, ArchSpec, arch_spec


def build_model(cfg: ModelConfig):
    """The nn.Module for cfg.arch (its registry entry's class); raises ConfigError for an impossible configuration."""
    cfg.validate()
    return arch_spec(cfg.arch).load("model")(cfg)


def __getattr__(name: str):
    if name in ("ModelOutput", "map_memory"):
        from . import output  # on first use: keeps `import memlm.models` (and memlm --help) torch-free

        return getattr(output, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = ["ARCHITECTURES", "ARCHS", "ArchSpec", "ConfigError", "ModelConfig", "ModelOutput", "arch_spec",
           "build_model", "map_memory"]
