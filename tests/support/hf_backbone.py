"""A tiny Hugging Face backbone folder built in the test (no hub): a byte-level BPE trained with the `tokenizers`
library on a few hundred WikiText-2 lines and a random GPT-2 saved beside it with save_pretrained, as a model folder
downloaded from the hub holds them (config.json, model.safetensors, tokenizer.json). Needs the 'pretrained' extra."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT2 = ROOT.parent / "shared" / "data" / "wikitext-2"
EOS = "<|endoftext|>"


def wiki_lines(count: int = 300) -> list[str]:
    return (WIKITEXT2 / "wiki.train.tokens").read_text(encoding="utf-8").splitlines()[:count]


def train_bpe(lines: list[str], vocab: int):
    """A byte-level BPE of `vocab` ids whose decode gives the text back byte for byte."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def gpt2_folder(folder: Path, tok=None, *, vocab_size: int = 256, seed: int = 0, **config) -> Path:
    """A random 2-layer GPT-2 of width 32 saved in FOLDER, with tok's tokenizer.json (its vocabulary, <|endoftext|>
    as bos and eos) when tok is given."""
    import torch
    import transformers

    settings = dict(n_layer=2, n_embd=32, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    vocab_size=vocab_size, bos_token_id=None, eos_token_id=None)
    if tok is not None:
        eos = tok.token_to_id(EOS)
        settings.update(vocab_size=tok.get_vocab_size(), bos_token_id=eos, eos_token_id=eos)
    settings.update(config)
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings)).save_pretrained(folder)
    if tok is not None:
        tok.save(str(Path(folder) / "tokenizer.json"))
    return Path(folder)
