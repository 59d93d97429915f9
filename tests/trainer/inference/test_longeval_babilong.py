"""Scoring a model on BABILong's files (trainer/inference/longeval_babilong.py): its greedy answers against `memlm
generate`'s greedy decoding (models/decoders.py's incremental cache, another implementation) on real models of
several archs, prompts ending anywhere in a segment; and, with an oracle whose every prediction the test chooses,
that the answer is cut at the longest label, stops at the boundary id and is judged by BABILong's rule."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from memlm.data_pipeline.tokenizers import ByteTokenizer
from memlm.models import ModelConfig, build_model
from memlm.trainer.inference.longeval_babilong import answers, greedy_answer

N = 8


@pytest.mark.parametrize("arch", [dict(arch="txl", mem_len=8), dict(arch="lamemo", mem_len=8),
                                  dict(arch="rmt", mem_len=0, num_mem_tokens=2),
                                  dict(arch="armt", mem_len=0, num_mem_tokens=3, assoc_dim=4)])
def test_greedy_answers_are_memlm_generates_greedy_text(arch):
    from memlm.trainer.inference.generate import Generator

    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, vocab_size=256,
                                    tgt_len=N, init_std=0.3, **arch)).double().eval()
    tok = ByteTokenizer()
    for length in (3, 6, 7, 8, 15, 21):  # the prompt + SEP's last id at every place of a segment, and at its end
        prompt = "Mary went to the office. Q: Where is Mary?"[-length:]
        written: list[int] = []
        list(Generator(model, tok).stream(prompt + ">", tokens=12, temperature=0, on_token=written.append))
        if tok.boundary_id in written:
            written = written[:written.index(tok.boundary_id)]
        ids = [tok.boundary_id] + list(tok.encode(prompt + ">"))
        assert greedy_answer(model, ids, max_new=12, stop_id=tok.boundary_id) == written, length


@dataclass
class Seen:
    count: torch.Tensor  # [B] ids read so far in the sample


class Oracle(torch.nn.Module):
    """Predicts, after the ids it has read of sample k, the next character of `texts[k]` (prompt + SEP + what the
    test wants written): it counts positions in its memory, which the scorer must empty at the sample's start and
    carry over segments. A position past the text predicts the boundary id."""

    def __init__(self, texts: list[str]):
        super().__init__()
        self.texts = texts
        self.sample = -1
        self.cfg = type("Cfg", (), {"tgt_len": N})()

    def init_memory(self, batch_size, device="cpu"):
        self.sample += 1  # the scorer starts the next sample
        return Seen(torch.zeros(batch_size, dtype=torch.long))

    def forward(self, tokens, memory, reset=None, targets=None, return_logits=False):
        from memlm.models.output import ModelOutput

        B, T = tokens.shape
        count = torch.where(reset, 0, memory.count)
        text = self.texts[self.sample]
        logits = torch.full((B, T, 256), -5.0)
        for t in range(T):
            at = int(count[0]) + t  # the input here is the text's id at - 1 (the boundary at 0)
            logits[0, t, ord(text[at]) if at < len(text) else 10] = 0.0
        return ModelOutput(nll=torch.zeros(B, T), logits=logits, memory=Seen(count + T))


def test_answers_stop_at_the_boundary_and_at_the_longest_label():
    from memlm.data_pipeline import babilong

    labels = babilong.TASK_LABELS["qa1"]  # the longest: bathroom, 8 bytes
    prompts = ["Mary went to the office. Q: Where is Mary?", "x" * 30 + " Q: Where is John?",
               "Q: Where?", "John went to the kitchen. Q: Where is John?"]
    written = ["office", "bedroom or kitchen", "bathroomhallway", "kit"]
    model = Oracle([p + ">" + w for p, w in zip(prompts, written)])
    got = answers(model, ByteTokenizer(), prompts, labels)
    assert got == ["office", "bedroom ", "bathroom", "kit"]
    assert [babilong.right(t, g, "Where is Mary?", labels) for t, g in zip(
        ["office", "bedroom", "bathroom", "kitchen"], got)] == [True, True, True, False]
