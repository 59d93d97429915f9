"""Which keys each query may read, in the form the attention kernels take it.

Shape letters (models/shapes.md): B lanes, Q queries, K keys.

Every memory layout in memlm masks a query's keys in two independent ways: by the layout itself (causality,
same_length, RMT's read/write blocks, LaMemo's look-ahead window), the same for every lane, and by which cached keys
hold a real position of the lane's document. The einsum path and FlexAttention take the two and-ed together as
`allowed` [B, Q, K]; the Triton kernels (attention_triton.py) take them apart, one [Q, K] tile per block and a
per-lane key flag, and with them the distance slot as an affine function of (query, key), which every layout here
has: slot(i, j) = offset + sign * (i - j).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class MaskLayout:
    structure: Tensor  # [Q, K] bool: pairs the layout allows, the same for every lane
    key_valid: Tensor  # [B, K] bool: keys that hold a real position of the lane's document
    offset: int  # the distance slot of query 0 and key 0
    sign: int  # +1: slots grow with i - j (keys to the left); -1: with j - i (LaMemo's look-ahead)

    @property
    def allowed(self) -> Tensor:
        """[B, Q, K] bool: True where the query may attend to the key."""
        return self.structure[None] & self.key_valid[:, None, :]


@dataclass(frozen=True)
class TritonMask:
    """What `attend` hands the Triton kernels: the layout and its tiles (attention_triton.triton_layout), built once
    per forward and shared by every layer that attends with it."""
    layout: MaskLayout
    tiles: Any  # attention_triton.TritonLayout (not imported here: triton is needed only when it runs)


def causal_layout(n_query: int, n_mem: int, mem_valid: Tensor, same_length: bool) -> MaskLayout:
    """Queries at positions n_mem..n_mem+Q-1 over keys 0..n_mem+Q-1: causal over the current block, memory slots
    only where valid ([B, n_mem] bool). With same_length (and a memory) every query sees exactly n_mem keys, itself
    and the n_mem - 1 before it, as Transformer-XL's evaluation option does. Slots are distances i - j."""
    device = mem_valid.device
    q_pos = torch.arange(n_query, device=device)[:, None] + n_mem
    k_pos = torch.arange(n_mem + n_query, device=device)[None, :]
    structure = k_pos <= q_pos
    if same_length and n_mem > 0:
        structure = structure & (q_pos - k_pos < n_mem)
    key_valid = torch.cat([mem_valid, mem_valid.new_ones(mem_valid.shape[0], n_query)], dim=1)  # [B, K]
    return MaskLayout(structure, key_valid, offset=n_mem, sign=1)
