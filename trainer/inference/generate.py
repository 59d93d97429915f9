"""Text generation with memory (`memlm generate`, docs/design.md §8), and the Python API for notebooks.

    from .generate import Generator
    gen = Generator.from_run("runs/demo/runs/lamemo")                  # config + latest checkpoint + tokenizer
    gen = Generator.from_run("exports/lamemo")                         # or an export folder (`memlm export`)
    text = gen.generate("def main(", tokens=200, top_p=0.9, seed=0)    # the continuation
    for piece in gen.stream("def main(", tokens=200): print(piece, end="", flush=True)

How a token is decoded. The model reads text in segments of N = model.tgt_len tokens with its memory, as in
training and evaluation. The prompt (after one boundary id, which starts every document the model was trained on)
is fed in segments: whole segments through the model's own forward, the rest incrementally. Each new token is then
sampled and fed with an incremental cache of the current segment's keys and values
(models/decoders.py),
so it costs attention over the M memory keys and the t tokens before it, not a rerun of the segment. When a segment
is full, the model's forward over those N tokens, from the memory the segment started with, gives the next memory:
the memory rule (Transformer-XL's cache of the last M layer inputs; LaMemo's refreshed context C, log-normaliser
S and layer-0 memory; RMT's write outputs and optional cache) is exactly the model's, with no copy of it here.
That forward costs one segment's computation per N tokens, about the cost of decoding them incrementally.

LaMemo's look-ahead during decoding. In LaMemo the memory attends ahead to the positions up to the *first* token
of the current segment, and its refreshed states are what the segment's tokens attend to at layers >= 1. During
decoding the first token of a segment triggers that refresh (the model's look-ahead and interpolation, layer by
layer); every later token of the segment attends to the refreshed memory as the model's segment forward does, and
the memory is not refreshed again until the next segment starts: the look-ahead window ends at the segment's first
token, so later tokens cannot change it. Decoding is therefore identical to scoring the same text segment by
segment (tests/trainer/inference/test_generate.py checks the log-probabilities against the model's forward for every
arch), and the
memory the next segment sees equals the one a full forward would carry.

Sampling: temperature (0 = greedy), then top-k, then top-p (nucleus) over the model's log-probabilities, drawn
from a torch.Generator seeded with `seed`: the same run, prompt and settings give the same text.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.tokenizers import ByteTokenizer, Tokenizer, WordTokenizer
from memlm.models.config import ConfigError
from memlm.models.decoders import make_decoder
from memlm.trainer.checkpoint.run_loader import load_run
from memlm.trainer.runtime import heartbeat
from memlm.trainer.runtime.process import prepare_process

# ---------------------------------------------------------------------------------------------------------------
# One lane's decoding state


class Session:
    """The model memory at the current segment's start plus the segment's incremental cache (batch of one).

    feed(ids) -> log-probabilities [len(ids), V] (or [1, V] for the last id only) of the token after each id.
    """

    def __init__(self, model: torch.nn.Module, device: str | torch.device | None = None):
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.seg_len = model.cfg.tgt_len
        self.memory = model.init_memory(batch_size=1, device=self.device)
        self.decoder = make_decoder(model)
        self.decoder.begin(self.memory)
        self.segment: list[int] = []  # ids of the current segment so far
        self.segments_done = 0

    @torch.no_grad()
    def feed(self, ids: list[int], all_logits: bool = False) -> Tensor:
        if not ids:
            raise ValueError("feed: no ids")
        out, i = [], 0
        while i < len(ids):
            chunk = ids[i : i + self.seg_len - len(self.segment)]
            i += len(chunk)
            tokens = torch.tensor([chunk], dtype=torch.long, device=self.device)
            if not self.segment and len(chunk) == self.seg_len:
                # A whole segment at once (a long prompt): the model's own forward scores it and carries memory.
                result = self.model(tokens, self.memory, return_logits=True)
                logp = result.logits[0]
                self._next_segment(result.memory)
            else:
                logp = self.decoder.extend(tokens)[0]
                self.segment.extend(chunk)
                if len(self.segment) == self.seg_len:
                    self._close_segment()
            out.append(logp if all_logits else logp[-1:])
        return torch.cat(out) if all_logits else out[-1]

    def _close_segment(self) -> None:
        """The segment is full: the model's forward over it gives the memory the next segment reads."""
        tokens = torch.tensor([self.segment], dtype=torch.long, device=self.device)
        self._next_segment(self.model(tokens, self.memory).memory)

    def _next_segment(self, memory) -> None:
        self.memory = memory
        self.decoder.begin(memory)
        self.segment = []
        self.segments_done += 1


# ---------------------------------------------------------------------------------------------------------------
# Sampling and text


def sample_next(logp: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> int:
    """One id from log-probabilities [V]: temperature (0 = argmax), then top-k, then top-p (nucleus)."""
    if temperature == 0:
        return int(logp.argmax())
    logits = logp.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely ids
        drop = before >= top_p  # keep the smallest prefix whose mass reaches top_p (the top id always stays)
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class TextStream:
    """Token ids -> the text each one adds, as it comes. Word and sentencepiece ids decode per line (a boundary
    ends one), so each piece is what decoding the line so far adds; bytes go through an incremental UTF-8 decoder,
    which holds back an incomplete character until its last byte arrives."""

    def __init__(self, tokenizer: Tokenizer, context: list[int]):
        self.tokenizer = tokenizer
        self.bytes_decoder = codecs.getincrementaldecoder("utf-8")(errors="replace") if isinstance(
            tokenizer, ByteTokenizer) else None
        boundary = tokenizer.boundary_id
        last = max((i for i, t in enumerate(context) if t == boundary), default=-1)
        self.line = list(context[last + 1 :])  # the prompt's last line: spacing of the first word depends on it
        self.shown = self._decode_line() if self.bytes_decoder is None else ""
        if self.bytes_decoder is not None:
            self.bytes_decoder.decode(bytes(context))

    def _decode_line(self) -> str:
        return self.tokenizer.decode(self.line)

    def push(self, token: int) -> str:
        if self.bytes_decoder is not None:
            return self.bytes_decoder.decode(bytes([token]))
        self.line.append(token)
        if token == self.tokenizer.boundary_id:
            piece = self._rest()
            self.line, self.shown = [], ""
            return piece
        # A trailing U+FFFD may be the start of a character whose other bytes (sentencepiece byte-fallback pieces)
        # are still to come: it is shown once something follows it, or at the end of the line.
        text = self._decode_line().rstrip("\ufffd")
        if not text.startswith(self.shown):  # decoding more changed what was shown: wait for the line's end
            return ""
        piece, self.shown = text[len(self.shown) :], text
        return piece

    def _rest(self) -> str:
        text = self._decode_line()
        return text[len(self.shown) :] if text.startswith(self.shown) else ""

    def flush(self) -> str:
        """What is still held back at the end of generation."""
        if self.bytes_decoder is not None:
            return self.bytes_decoder.decode(b"", final=True)
        return self._rest()


# ---------------------------------------------------------------------------------------------------------------
# The API


@dataclass
class SamplingSettings:
    tokens: int = 100
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> "SamplingSettings":
        if self.tokens < 1:
            raise ConfigError(f"--tokens must be >= 1, got {self.tokens}")
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1] (1 = off), got {self.top_p}")
        return self


class Generator:
    """Sampling from a trained memory LM with its memory carried across segments (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, device: str | torch.device | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = device

    @classmethod
    def from_run(cls, run_dir: str | os.PathLike, mem_len: int | None = None, tag: str | None = None,
                 device: str | torch.device = "cpu") -> "Generator":
        model, tokenizer, _ = load_run(run_dir, mem_len=mem_len, tag=tag, device=device)
        return cls(model, tokenizer, device)

    def encode_prompt(self, text: str) -> list[int]:
        """The boundary id that starts every training document, then the prompt's ids. A prompt that does not
        end in a newline does not end its line (no trailing boundary). DataError for an empty prompt or, with a
        word tokenizer, words outside the vocabulary (they would all read as <unk>)."""
        tok = self.tokenizer
        if not text.strip():
            raise DataError("the prompt is empty: give the text to continue with --prompt TEXT or --prompt-file F")
        if isinstance(tok, WordTokenizer):
            unknown = list(dict.fromkeys(w for w in text.split() if w not in tok.index))
            if unknown:
                shown = ", ".join(repr(w) for w in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
                raise DataError(f"the prompt has {len(unknown)} word(s) outside the run's {tok.vocab_size}-word "
                                f"vocabulary ({shown}); use words of the training text (or <unk>)")
        ids = [int(i) for i in tok.encode(text)]
        if not isinstance(tok, ByteTokenizer) and not text.endswith("\n") and ids and ids[-1] == tok.boundary_id:
            ids.pop()
        return [tok.boundary_id] + ids

    def stream(self, prompt: str, tokens: int = 100, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               seed: int = 0, on_token: Callable[[int], None] | None = None) -> Iterator[str]:
        """Yield the continuation's text piece by piece (one piece per sampled token, possibly empty)."""
        settings = SamplingSettings(tokens, temperature, top_k, top_p, seed).validate()
        ids = self.encode_prompt(prompt)
        session = Session(self.model, self.device)
        generator = torch.Generator().manual_seed(settings.seed)
        text = TextStream(self.tokenizer, ids)
        logp = session.feed(ids)[-1]
        for n in range(settings.tokens):
            token = sample_next(logp, settings.temperature, settings.top_k, settings.top_p, generator)
            if on_token is not None:
                on_token(token)
            yield text.push(token)
            if n + 1 < settings.tokens:
                logp = session.feed([token])[-1]
        yield text.flush()

    def generate(self, prompt: str, **settings) -> str:
        """The continuation as one string (keyword arguments as in `stream`)."""
        return "".join(self.stream(prompt, **settings))


# ---------------------------------------------------------------------------------------------------------------
# `memlm generate`


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise DataError("give the prompt once: --prompt TEXT or --prompt-file F")
    if prompt_file is not None:
        path = Path(prompt_file)
        if not path.is_file():
            raise DataError(f"--prompt-file {path} does not exist")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"--prompt-file {path} is not UTF-8 text") from None
    return prompt


def main(args) -> int:
    """The command: the prompt, then the continuation streamed to stdout as it is sampled."""
    import contextlib
    import sys

    settings = SamplingSettings(args.tokens, args.temperature, args.top_k, args.top_p, args.seed).validate()
    prompt = read_prompt(args.prompt, args.prompt_file)
    prepare_process(who="generate")  # threads that fit the cores; its line goes to stderr, the text to stdout
    device = "cuda" if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu" else "cpu"
    # stdout carries the generated text only: DeepSpeed (imported while loading a checkpoint) logs to the stdout
    # it finds at import time, so it is imported with stdout pointing at stderr.
    heartbeat.phase(f"loading the weights of {args.run_dir}")  # memlm/start_watch.py: a line within 10 s
    with contextlib.redirect_stdout(sys.stderr):
        gen = Generator.from_run(args.run_dir, mem_len=args.mem_len, device=device)
    gen.encode_prompt(prompt)  # refuse a bad prompt before anything is printed
    heartbeat.phase(None)  # the prompt is the first line, at once (a pipe would hold it until the first token)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    for piece in gen.stream(prompt, tokens=settings.tokens, temperature=settings.temperature, top_k=settings.top_k,
                            top_p=settings.top_p, seed=settings.seed):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
