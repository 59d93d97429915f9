"""FLOPs and parameters of the pretrained-backbone archs, from the backbone's widths alone (shape.py; torch-free),
in models/flops.py's conventions: matmuls only, 2 FLOPs a multiply-accumulate, the full score matrix counted, per
lane and segment.

Shape letters (models/shapes.md): B lanes, N segment length, R memory tokens, Q queries: the rows a segment's forward
runs, L layers, D model width, H heads, E head width (D / H), I inner width, V vocabulary, F feature width of the
associative keys.
"""

from __future__ import annotations

from ..flops import matmul_flops as mm
from .shape import LORA_DEFAULT_TARGETS, BackboneShape, backbone_shape

DPFP_NU = 3  # models/armt.py's (that module imports torch; this one stays torch-free)


def module_widths(shape: BackboneShape) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear module of a layer, by the name LoRA targets match (GPT-2's, Llama's)."""
    D, I, E = shape.d_model, shape.d_inner, shape.d_model // shape.n_head
    if shape.model_type == "gpt2":
        return {"attn.c_attn": (D, 3 * D), "attn.c_proj": (D, D), "mlp.c_fc": (D, I), "mlp.c_proj": (I, D)}
    return {"self_attn.q_proj": (D, shape.n_head * E), "self_attn.k_proj": (D, shape.n_kv_head * E),
            "self_attn.v_proj": (D, shape.n_kv_head * E), "self_attn.o_proj": (shape.n_head * E, D),
            "mlp.gate_proj": (D, I), "mlp.up_proj": (D, I), "mlp.down_proj": (I, D)}


def lora_modules(cfg, shape: BackboneShape) -> dict[str, tuple[int, int]]:
    """(in, out) of each module of a layer that LoRA adapts (peft matches a target as the name or its dotted end)."""
    targets = list(cfg.lora_targets) or LORA_DEFAULT_TARGETS[shape.model_type]
    return {name: (i, o) for name, (i, o) in module_widths(shape).items()
            if any(name == t or name.endswith("." + t) for t in targets)}


def segment_flops(cfg, rows: int, shape: BackboneShape) -> dict[str, float]:
    """One lane's segment of `rows` rows through the backbone, the head scoring the N token rows."""
    Q, D = rows, shape.d_model
    widths = module_widths(shape)
    attention = sum(mm(Q, i, o) for name, (i, o) in widths.items() if "attn" in name)
    ffn = sum(mm(Q, i, o) for name, (i, o) in widths.items() if "mlp" in name)
    seg = dict(embedding=0.0, attn_proj=shape.n_layer * attention, attn_content=shape.n_layer * mm(Q, D, Q),
               attn_context=shape.n_layer * mm(Q, Q, D), ffn=shape.n_layer * ffn,
               head=mm(cfg.tgt_len, D, shape.vocab_size))
    if cfg.backbone_train == "lora":  # each adapted module also runs x A B: [Q, in] [in, r] [r, out]
        r = cfg.lora_rank
        seg["lora"] = shape.n_layer * sum(mm(Q, i, r) + mm(Q, r, o) for i, o in lora_modules(cfg, shape).values())
    return seg


def associative_flops(cfg, shape: BackboneShape, rows: int) -> float:
    """ARMT's read of every row and write of the R memory rows, per layer (models/armt.py's layer_flops terms)."""
    D, R, d = shape.d_model, cfg.num_mem_tokens, cfg.assoc_dim
    width = 2 * DPFP_NU * d
    read = mm(rows, D, d) + mm(rows, width, D) + mm(rows, width, 1)
    write = mm(R, D, d) + mm(R, D, D) + mm(R, D, 1) + mm(R, width, 1) + mm(R, width, D) + mm(width, R, D)
    write += mm(1, R, width)
    return shape.n_layer * (read + write)


def backbone_flops(cfg, memory_rows: int) -> dict[str, float]:
    """One lane's segment of N + memory_rows rows, by component (flops_per_token divides by N)."""
    return segment_flops(cfg, cfg.tgt_len + memory_rows, backbone_shape(cfg))


def hf_flops(cfg, batch_size: int = 1) -> dict[str, float]:
    return backbone_flops(cfg, 0)


def hf_rmt_flops(cfg, batch_size: int = 1) -> dict[str, float]:
    return backbone_flops(cfg, 2 * cfg.num_mem_tokens)  # [read R | tokens N | write R]


def hf_armt_flops(cfg, batch_size: int = 1) -> dict[str, float]:
    seg = backbone_flops(cfg, cfg.num_mem_tokens)  # [tokens N | write R]
    seg["associative"] = associative_flops(cfg, backbone_shape(cfg), cfg.tgt_len + cfg.num_mem_tokens)
    return seg


def lora_params(cfg, shape: BackboneShape) -> int:
    """The LoRA adapters' parameters: r (in + out) per adapted module per layer."""
    return shape.n_layer * sum(cfg.lora_rank * (i + o) for i, o in lora_modules(cfg, shape).values())


def hf_params(cfg) -> int:
    """Every parameter of the backbone (tied tables once) and of its LoRA adapters."""
    shape = backbone_shape(cfg)
    D, L = shape.d_model, shape.n_layer
    widths = module_widths(shape)
    gpt2 = shape.model_type == "gpt2"
    layer = sum(i * o for i, o in widths.values())
    layer += sum(o for _, o in widths.values()) if gpt2 else 0  # GPT-2's Conv1D biases
    layer += 4 * D if gpt2 else 2 * D  # two LayerNorms (weight, bias) or two RMSNorms
    total = shape.vocab_size * D + shape.positions * D + L * layer + (2 * D if gpt2 else D)  # + final norm
    total += 0 if shape.tied else shape.vocab_size * D
    return total + (lora_params(cfg, shape) if cfg.backbone_train == "lora" else 0)


def hf_rmt_params(cfg) -> int:
    return hf_params(cfg) + cfg.num_mem_tokens * backbone_shape(cfg).d_model  # memory_init


def hf_armt_params(cfg) -> int:
    """The backbone's, memory_init, and per layer W_q, W_k, W_v, w_b and its bias."""
    D, L = backbone_shape(cfg).d_model, backbone_shape(cfg).n_layer
    return hf_rmt_params(cfg) + L * (2 * cfg.assoc_dim * D + D * D + D + 1)
