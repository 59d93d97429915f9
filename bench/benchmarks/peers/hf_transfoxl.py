"""Hugging Face TransfoXL (transformers 4.34.1, the last release that ships it), configured to memlm's shape.

The adaptive softmax (`model.crit`) shifts hidden states and labels by one inside (HF's labels are the inputs);
memlm scores all N targets of a segment, so the hidden states get one padding row at the end and the targets
one padding column at the start: after the crit's shift, hidden[t] is scored against targets[t] for all N.
Under bf16 autocast the hidden states enter the crit in bf16 (see forward_loss): as shipped, the crit fails on
CPU autocast, and its log-softmax then runs in bf16 where memlm's runs in fp32.
The first segment reads an empty memory (zero-length `mems`), as memlm's masked initial memory; after it the
memory holds M positions, carried as HF's `mems` (detached by the model).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import Runner, Shape, mean_nll


class HFTransfoXL(Runner):
    key, label = "hf-transfoxl", "HF TransfoXL"
    compare_with = "memlm-txl"
    vocab_pattern = r"^(transformer\.word_emb|crit)\."

    def build(self, shape: Shape) -> nn.Module:
        import transformers
        from transformers import TransfoXLConfig, TransfoXLLMHeadModel

        self.library = f"transformers=={transformers.__version__}"
        self.options = dict(
            vocab_size=shape.vocab, cutoffs=list(shape.cutoffs), d_model=shape.d_model, d_embed=shape.d_model,
            n_head=shape.n_head, d_head=shape.d_head, d_inner=shape.d_inner, n_layer=shape.n_layer,
            mem_len=shape.mem_len,
            div_val=1,  # default 4: one embedding width for all clusters, as memlm's div_val 1
            untie_r=False,  # default True: one global u/v pair, as memlm's default
            same_length=False,  # default True: plain causal mask, as memlm's default
            clamp_len=-1,  # default 1000 (no effect at these lengths); memlm: no clamping
            pre_lnorm=False, attn_type=0, adaptive=True, sample_softmax=-1, proj_share_all_but_first=True,
            tie_word_embeddings=True, dropout=0.0, dropatt=0.0, init="normal", init_std=0.02, proj_init_std=0.01,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "output of TransfoXL will be updated in v5" (DeprecationWarning)
            return TransfoXLLMHeadModel(TransfoXLConfig(**self.options))

    def reset_memory(self) -> None:
        B, D = self.shape.lanes, self.shape.d_model
        self.mems = [torch.zeros(0, B, D, device=self.device) for _ in range(self.shape.n_layer)]  # [mlen, B, D] per layer, mlen 0

    def forward_loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        out = self.model.transformer(input_ids=tokens, mems=self.mems, return_dict=True)
        self.mems = out.mems  # detached inside HF's _update_mems
        hidden = F.pad(out.last_hidden_state, (0, 0, 0, 1))  # [B, N+1, D]: the crit drops the last row
        if torch.is_autocast_enabled(self.device.type):
            # The crit allocates its NLL in the hidden's dtype (fp32 here: LayerNorm output) and assigns
            # log_softmax's result into it, which autocast leaves in bf16 -> "Index put requires the source
            # and destination dtypes match". Hand it the hidden in the autocast dtype, in which its logits are
            # computed anyway.
            hidden = hidden.to(torch.get_autocast_dtype(self.device.type))
        labels = F.pad(targets, (1, 0))  # [B, N+1]: the crit drops the first column
        nll = self.model.crit(hidden, labels)  # [B*N] per-token NLL (0 where the target is -100)
        return mean_nll(nll.float().sum(), targets)

    def settings(self) -> dict:
        return dict(self.options)
