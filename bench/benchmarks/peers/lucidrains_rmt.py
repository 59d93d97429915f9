"""lucidrains' recurrent-memory-transformer-pytorch, with and without its XL memories, at memlm's shape.

Equal width, depth, heads, memory tokens and FFN FLOPs: its FFN is GEGLU (three d x h matrices) with
h = int(d * ff_mult * 2/3), so ff_mult is chosen to make h the integer nearest 2/3 d_inner (683 for d_inner
1024: +0.05% FLOPs; 1400 for 2100: exact). `num_residual_streams=1` turns its hyper-connections (4 residual
streams by default, ~4x the residual-stream work and extra parameters) into a plain residual as every other
model here has. Everything else is the library's default: pre-RMSNorm, learned absolute positions (no relative
positions), a null key/value, value residual mixing, untied input/output embeddings, a full softmax (it has no
adaptive softmax), 0.1 embedding gradient. Its XL memories are the layers' keys/values of the last M rows (not
layer inputs recomputed with the current weights, as Transformer-XL and memlm do). The memory tokens are
detached between steps (its segment-by-segment API; memory-replay BPTT is a separate wrapper path), as memlm's
RMT with bptt_depth 0.
"""

from __future__ import annotations

from importlib.metadata import version

from torch import Tensor, nn

from .common import Runner, Shape, ffn_mult_for_geglu


class LucidrainsRMT(Runner):
    key, label = "lucidrains-rmt", "lucidrains RMT"
    compare_with = "memlm-rmt"
    vocab_pattern = r"^(token_emb|to_logits)\."
    position_pattern = r"^pos_emb\."
    use_xl = False

    def build(self, shape: Shape) -> nn.Module:
        from recurrent_memory_transformer_pytorch import RecurrentMemoryTransformer

        self.library = f"recurrent-memory-transformer-pytorch=={version('recurrent-memory-transformer-pytorch')}"
        self.options = dict(
            dim=shape.d_model, num_tokens=shape.vocab, depth=shape.n_layer, num_memory_tokens=shape.mem_tokens,
            seq_len=shape.tgt_len, causal=True, dim_head=shape.d_head, heads=shape.n_head,
            ff_mult=ffn_mult_for_geglu(shape.d_model, shape.d_inner), attn_dropout=0.0, ff_dropout=0.0,
            use_flash_attn=False, ignore_index=-100, use_xl_memories=self.use_xl,
            xl_mem_len=shape.mem_len if self.use_xl else None, num_residual_streams=1,
        )
        model = RecurrentMemoryTransformer(**self.options)
        self.ffn_hidden = model.layers[0][1].branch[-1].in_features  # GEGLU hidden width h
        return model

    def reset_memory(self) -> None:
        self.memories = None  # first segment: the learned read-memory embedding
        self.xl_memories = None

    def forward_loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        loss, memories, xl_memories = self.model(tokens, self.memories, labels=targets, xl_memories=self.xl_memories)
        self.memories = memories.detach()
        self.xl_memories = xl_memories  # detached by the model; None without XL memories
        return loss  # F.cross_entropy mean over targets != ignore_index

    def settings(self) -> dict:
        return {**self.options, "ffn_hidden": self.ffn_hidden}


class LucidrainsRMTXL(LucidrainsRMT):
    key, label = "lucidrains-rmt-xl", "lucidrains RMT + XL memories"
    compare_with = "memlm-rmt-xl"
    use_xl = True
