"""What every model in the peer benchmark shares: the shape, the batches, the training step, parameter counts.

A `Runner` owns one model, its optimizer (torch Adam, lr 2.5e-4) and the memory it carries between segments.
Its training step is the same for every model: forward of one segment [B, N] with the carried memory (under
bf16 autocast when asked), mean NLL over the non-ignored targets, backward, gradient clipping at 0.25, Adam step,
gradients set to None. Subclasses only build the model, reset the memory and say how one segment's mean NLL is
computed with their library's API (`forward_loss`), carrying the memory the way that API does.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

LR = 2.5e-4
CLIP = 0.25
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Shape:
    """One benchmark shape; every model in it gets the same width, depth, heads, FFN FLOPs, N, M and vocabulary."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    d_head: int
    d_inner: int
    vocab: int
    tgt_len: int  # N: tokens per segment
    mem_len: int  # M: Transformer-XL cache length
    lanes: int  # B
    mem_tokens: int = 10  # R: RMT memory tokens
    cutoffs: tuple[int, ...] = ()  # adaptive softmax clusters (empty: one plain softmax)
    token_law: str = "uniform"  # "uniform" or "zipf" (word vocabularies: id = frequency rank)
    warmup: int = 3
    steps: int = 20
    groups: tuple[tuple[str, ...], ...] = field(default=())  # models interleaved together; () = all in one

    def to_json(self) -> dict:
        return asdict(self)


def autocast(precision: str, device_type: str = "cpu"):
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")


def make_batches(shape: Shape, count: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    """`count` segments (tokens [B, N], targets [B, N]) drawn once and shared by every model."""
    gen = torch.Generator().manual_seed(seed)
    size = (shape.lanes, shape.tgt_len + 1)
    out = []
    for _ in range(count):
        if shape.token_law == "zipf":
            weights = 1.0 / torch.arange(1, shape.vocab + 1, dtype=torch.float64)
            seq = torch.multinomial(weights, size[0] * size[1], replacement=True, generator=gen).view(size)
        else:
            seq = torch.randint(0, shape.vocab, size, generator=gen)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def mean_nll(nll_sum: Tensor, targets: Tensor) -> Tensor:
    return nll_sum / (targets != -100).sum().clamp(min=1)


class Runner:
    """One model under the common training step. Subclasses set the class attributes and implement the hooks."""

    key: str = ""  # command-line name
    label: str = ""  # table row
    library: str = ""  # where the model comes from (package==version or "memlm")
    compare_with: str | None = None  # for a peer: the key of the memlm model it is compared with
    vocab_pattern = r"$^"  # parameter names that belong to the vocabulary (embedding, softmax)
    position_pattern = r"$^"  # parameter names of learned position tables
    notes: tuple[str, ...] = ()

    variants: tuple[str, ...] = ()  # e.g. memlm's "peer-head"; an entry "key:variant" in a group selects one

    def __init__(self, shape: Shape, variant: str = "", seed: int = 0, device: str = "cpu"):
        if variant and variant not in self.variants:
            raise ValueError(f"{self.key} has no variant {variant!r} (has: {', '.join(self.variants) or 'none'})")
        self.shape = shape
        self.variant = variant
        self.device = torch.device(device)  # memory the adapters create goes here too
        torch.manual_seed(seed)
        self.model = self.build(shape).to(self.device).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.params, lr=LR)
        self.reset_memory()

    # hooks ------------------------------------------------------------------------------------------------
    def build(self, shape: Shape) -> nn.Module:
        raise NotImplementedError

    def reset_memory(self) -> None:
        raise NotImplementedError

    def forward_loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean NLL of one segment; stores the (detached) memory for the next segment."""
        raise NotImplementedError

    def settings(self) -> dict:
        """The library options this benchmark set, for the JSON."""
        return {}

    # shared -----------------------------------------------------------------------------------------------
    def step(self, batch: tuple[Tensor, Tensor], precision: str) -> float:
        tokens, targets = batch
        with autocast(precision, self.device.type):
            loss = self.forward_loss(tokens, targets)
        loss.backward()
        self.sync()
        t = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        self.optimizer_s = time.perf_counter() - t  # the same torch code for every library: reported apart
        return float(loss.detach())

    def sync(self) -> None:
        """Wait for the GPU (a no-op on the CPU), so a host clock times the work and not its launch."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def loss_at_init(self, batch: tuple[Tensor, Tensor], precision: str) -> float:
        """Loss of the untrained model on `batch` from an empty (initial) memory; the memory is reset after."""
        self.reset_memory()
        with autocast(precision, self.device.type):
            loss = float(self.forward_loss(*batch))
        self.reset_memory()
        return loss

    def param_counts(self) -> dict:
        """Unique parameters (tied ones once): total, vocabulary (embedding + softmax), learned position tables,
        and the rest ("body": attention, FFN, norms, memory tokens, relative-position projections and biases)."""
        vocab = position = total = 0
        for name, p in self.model.named_parameters():  # named_parameters() yields a tied parameter once
            total += p.numel()
            if re.search(self.vocab_pattern, name):
                vocab += p.numel()
            elif re.search(self.position_pattern, name):
                position += p.numel()
        return {"total": total, "vocab": vocab, "position_tables": position, "body": total - vocab - position}


def ffn_mult_for_geglu(d_model: int, d_inner: int) -> float:
    """ff_mult for a GEGLU FFN of hidden width int(d_model * mult * 2/3) with the FLOPs of a d_inner ReLU FFN.

    GEGLU has three d_model x h matrices, the ReLU FFN two d_model x d_inner ones: equal when h = 2/3 d_inner
    (h is the nearest integer).
    The 0.5 keeps int() from rounding a float like 1399.9999 down.
    """
    hidden = round(2 * d_inner / 3)
    return (hidden + 0.5) * 3 / (2 * d_model)
