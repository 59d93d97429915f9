"""Each architecture's own configuration checks: its registry entry names them (`ArchSpec.checks`), and
`ModelConfig.validate` runs them after the checks every arch shares. A check raises ConfigError naming the keys.

Beyond values out of range, a check refuses the combinations an arch could only run under a rule of its own that
nobody asked for (the Compressive Transformer's memory length against its compression rate), and options that
would be silently ignored where a user could think they act (RMT's window-only choices in chunk mode). Like
config.py and registry.py, this module loads without torch; the registry imports it on first use, after config.py.
"""

from __future__ import annotations

from .config import BPTT_CHOICES, BPTT_MODES, BPTT_RECIPES, COMPRESSIONS, RPE_KINDS, ConfigError


def lamemo(cfg) -> None:
    if cfg.rpe not in RPE_KINDS:
        raise ConfigError(f"model.rpe: unknown value {cfg.rpe!r}; valid: {', '.join(RPE_KINDS)}")
    if cfg.interp_eps < 0:
        raise ConfigError(f"model.interp_eps must be >= 0, got {cfg.interp_eps}")


def memory_bptt(cfg) -> None:
    """Memory tokens trained by BPTT through the memory (RMT, ARMT)."""
    if cfg.num_mem_tokens < 1:
        raise ConfigError(f"model.num_mem_tokens must be >= 1 for arch {cfg.arch!r} (the RMT paper uses 1-25, the "
                          "ARMT paper 10)")
    if cfg.bptt_depth < 0:
        raise ConfigError(f"model.bptt_depth must be >= 0, got {cfg.bptt_depth}")
    if cfg.bptt_mode not in BPTT_MODES:
        raise ConfigError(f"model.bptt_mode: unknown value {cfg.bptt_mode!r}; valid: {', '.join(BPTT_MODES)} "
                          "(window replays the last bptt_depth segments as the RMT paper trains; chunk is truncated "
                          "BPTT over bptt_depth + 1 new segments)")
    if cfg.bptt_replay_loss and cfg.bptt_mode != "window":
        raise ConfigError("model.bptt_replay_loss only applies to model.bptt_mode=window; remove it")


def rmt(cfg) -> None:
    memory_bptt(cfg)
    if cfg.aux_loss_weight < 0:
        raise ConfigError(f"model.aux_loss_weight must be >= 0, got {cfg.aux_loss_weight}")
    if not 0 <= cfg.aux_token_id < cfg.vocab_size:
        raise ConfigError(f"model.aux_token_id must be in [0, vocab_size={cfg.vocab_size}), got {cfg.aux_token_id}")
    if cfg.bptt_recipe not in BPTT_RECIPES:
        raise ConfigError(f"model.bptt_recipe: unknown value {cfg.bptt_recipe!r}; valid: {', '.join(BPTT_RECIPES)}")
    if cfg.cache_keys_values and cfg.mem_len < 1:
        raise ConfigError("model.cache_keys_values applies to the Transformer-XL cache, and model.mem_len is 0; set "
                          "mem_len >= 1 or remove it")
    for name, values in BPTT_CHOICES.items():
        if getattr(cfg, name) not in ("", *values):
            raise ConfigError(f"model.{name}: unknown value {getattr(cfg, name)!r}; valid: {', '.join(values)} (or "
                              "leave it empty for model.bptt_recipe's)")
    if cfg.bptt_mode != "window":
        # The window step's choices: chunk mode has no replay to start, no cache to recompute, no replayed loss.
        # (memory_init_grad is the model's and applies to both.)
        window_only = [name for name in ("bptt_start_memory", "bptt_new_segment_cache", "bptt_replay_reduction")
                       if getattr(cfg, name)] + (["bptt_recipe"] if cfg.bptt_recipe != "memlm" else [])
        if window_only:
            raise ConfigError(f"model.{window_only[0]} only applies to model.bptt_mode=window (the replay of the "
                              f"window; bptt_mode is {cfg.bptt_mode!r}); remove it, or set model.memory_init_grad "
                              "alone")


def armt(cfg) -> None:
    memory_bptt(cfg)
    if cfg.assoc_dim < 1:
        raise ConfigError("model.assoc_dim must be >= 1 for arch 'armt' (the associative keys' width before the DPFP "
                          "feature map; the ARMT paper uses 64)")
    if cfg.assoc_value_init_std < 0:
        raise ConfigError(f"model.assoc_value_init_std must be >= 0, got {cfg.assoc_value_init_std}")


def compressive(cfg) -> None:
    if cfg.compressed_len < 1:
        raise ConfigError("model.compressed_len must be >= 1 for arch 'compressive' (the compressed memory's slots per "
                          "layer; LaMemo's Table 1 uses 150)")
    if cfg.compression_rate < 1 or cfg.tgt_len % cfg.compression_rate:
        raise ConfigError(f"model.compression_rate must be >= 1 and divide model.tgt_len={cfg.tgt_len} (the segment's "
                          f"evicted rows compress into tgt_len / rate slots), got {cfg.compression_rate}")
    if cfg.mem_len % cfg.compression_rate:
        # After a document start the rows leave in blocks of tgt_len behind mem_len empty slots: a slot would
        # compress empty slots and the document's first rows together, and those rows would never be compressed.
        raise ConfigError(f"model.mem_len={cfg.mem_len} must be a multiple of model.compression_rate="
                          f"{cfg.compression_rate} for arch 'compressive' (a compressed slot would straddle a "
                          "document start)")
    if cfg.compression not in COMPRESSIONS:
        raise ConfigError(f"model.compression: unknown function {cfg.compression!r}; valid: "
                          f"{', '.join(COMPRESSIONS)}")
    if cfg.compression_loss_weight < 0:
        raise ConfigError(f"model.compression_loss_weight must be >= 0, got {cfg.compression_loss_weight}")


def infinite_former(cfg) -> None:
    widths = list(cfg.ltm_widths)
    if not widths or any(not w > 0 for w in widths):
        raise ConfigError(f"model.ltm_widths must be a non-empty list of positive widths, got {widths}")
    if cfg.ltm_basis < 1 or cfg.ltm_basis % len(widths):
        raise ConfigError(f"model.ltm_basis must be >= 1 and a multiple of len(model.ltm_widths)={len(widths)} for "
                          f"arch 'infinite_former' (LaMemo's Table 1 uses 150), got {cfg.ltm_basis}")
    if cfg.ltm_samples < 1:
        raise ConfigError(f"model.ltm_samples must be >= 1, got {cfg.ltm_samples}")
    if not 0 < cfg.ltm_tau < 1:
        raise ConfigError(f"model.ltm_tau must be in (0, 1) (the part of [0, 1] the old signal is contracted into), "
                          f"got {cfg.ltm_tau}")
    if not cfg.ltm_ridge > 0:
        raise ConfigError(f"model.ltm_ridge must be > 0 (the ridge penalty), got {cfg.ltm_ridge}")
    if cfg.ltm_sticky_bins < 1:
        raise ConfigError(f"model.ltm_sticky_bins must be >= 1, got {cfg.ltm_sticky_bins}")
