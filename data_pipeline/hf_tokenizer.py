"""A Hugging Face backbone's own tokenizer (its folder's tokenizer.json), so data is counted in the backbone's tokens.

`memlm prepare --tokenizer-from FOLDER` takes it when FOLDER is a model folder as save_pretrained writes it: its
tokenizer.json (the `tokenizers` library's file; never a download, never the slow vocab.json/merges.txt or
tokenizer.model, which AutoTokenizer would convert) and config.json. Read with the `tokenizers` library (installed
with transformers, the 'pretrained' extra), imported only when such a tokenizer is built: `memlm --help` and every
other tokenizer stay free of it.

Encoding. A document is its text encoded whole, without the special tokens a post-processor would add (add_special_
tokens=False): the token before every document is the stream's boundary (format.py), here the backbone's bos token
(config.json's bos_token_id, else its eos_token_id, else tokenizer_config.json's bos_token / eos_token), as GPT-2
separates documents by <|endoftext|> and Llama starts each with <|begin_of_text|>. The vocabulary is the largest id
in tokenizer.json (the model's vocabulary and its added tokens) plus one, as models/pretrained/shape.tokenizer_vocab
counts it, so data ids always fit the backbone's embedding when the two agree.

Saved into DATA_DIR/tokenizer as memlm's own tokenizer.json (kind "hf", vocab_size, boundary_id, the sha256 of the
backbone's file) beside an exact copy of the backbone's file (hf-tokenizer.json), so `--tokenizer-from
DATA_DIR/tokenizer` reuses it like any other. The manifest's tokenizer entry adds `tokenizer_json_sha256` (of the
backbone's tokenizer.json bytes) and `source` (the folder as given): training on a backbone refuses data whose
tokenizer.json hash is not the backbone folder's (check_backbone_tokenizer).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .format import DataError
from .tokenizers import TOKENIZER_FORMAT, TOKENIZER_JSON, Tokenizer, _json_bytes

KIND = "hf"
HF_FILE = "hf-tokenizer.json"  # the backbone's tokenizer.json, copied byte for byte into DATA_DIR/tokenizer
CONVERT = ("python -c \"import sys; from transformers import AutoTokenizer as T; "
           "T.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[1])\" FOLDER")


def is_hf_tokenizer_json(config: dict) -> bool:
    """A `tokenizers` library file (its model is an object), not memlm's own tokenizer.json (which has a format)."""
    return "format" not in config and isinstance(config.get("model"), dict)


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


class HFTokenizer(Tokenizer):
    """The `tokenizers` library's Tokenizer from a tokenizer.json's bytes; boundary_id: the backbone's bos/eos id."""

    kind = KIND

    def __init__(self, content: bytes, boundary_id: int, where: str):
        try:
            from tokenizers import Tokenizer as Library  # the 'pretrained' extra: only data on a backbone needs it
        except ImportError:
            raise DataError(f"{where} is a Hugging Face tokenizer.json and reading it needs the tokenizers library: "
                            "pip install -e '.[pretrained]'") from None
        try:
            self.library = Library.from_str(content.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - the library raises its own Exception type for a bad file
            raise DataError(f"{where} is not a tokenizer.json the tokenizers library reads ({e}): save the "
                            f"backbone's tokenizer again ({CONVERT})") from None
        self.content = content
        ids = self.library.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(ids) + 1 if ids else 0
        if not 0 <= boundary_id < self.vocab_size:
            raise DataError(f"{where}: the bos/eos id {boundary_id} is outside its tokenizer's {self.vocab_size} ids: "
                            "set bos_token_id in config.json to the tokenizer's bos or eos token")
        self.boundary_id = boundary_id

    def encode(self, text: str) -> np.ndarray:
        return np.array(self.library.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self.library.decode(np.asarray(ids, dtype=np.int64).tolist(), skip_special_tokens=False)

    def _files(self) -> dict[str, bytes]:
        return {
            TOKENIZER_JSON: _json_bytes({
                "format": TOKENIZER_FORMAT, "kind": self.kind, "vocab_size": self.vocab_size,
                "boundary_id": self.boundary_id, "model": HF_FILE, "model_sha256": sha256(self.content),
            }),
            HF_FILE: self.content,
        }

    def identity(self) -> dict:
        return {**super().identity(), "tokenizer_json_sha256": sha256(self.content)}


def from_backbone(folder: Path) -> HFTokenizer:
    """The tokenizer of a model folder as save_pretrained writes it (tokenizer.json, config.json)."""
    folder = Path(folder)
    content = (folder / TOKENIZER_JSON).read_bytes()
    return HFTokenizer(content, boundary_id(folder, content), f"{folder / TOKENIZER_JSON}")


def from_saved(directory: Path, config: dict) -> HFTokenizer:
    """What HFTokenizer.save wrote (memlm's tokenizer.json naming the copied file); ValueError when it is damaged."""
    path = Path(directory) / config["model"]
    if not path.is_file():
        raise ValueError(f"{path.name} is missing")
    content = path.read_bytes()
    if sha256(content) != config["model_sha256"]:
        raise ValueError(f"{path.name} does not match the sha256 recorded in {TOKENIZER_JSON}")
    return HFTokenizer(content, int(config["boundary_id"]), str(path))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not readable JSON ({e}): save the backbone again with save_pretrained") from None
    return data if isinstance(data, dict) else {}


def boundary_id(folder: Path, content: bytes) -> int:
    """The id that goes before every document: config.json's bos_token_id, else eos_token_id, else the
    tokenizer_config.json's bos_token / eos_token looked up in tokenizer.json's added tokens."""
    config = _read_json(folder / "config.json")
    for key in ("bos_token_id", "eos_token_id"):
        value = config.get(key)
        if isinstance(value, list) and value:  # Llama 3's eos_token_id is a list: its first
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    special = _read_json(folder / "tokenizer_config.json")
    added = {token.get("content"): token.get("id") for token in json.loads(content).get("added_tokens", [])}
    for key in ("bos_token", "eos_token"):
        token = special.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(added.get(token), int):
            return added[token]
    raise DataError(f"{folder} names no bos or eos token (config.json's bos_token_id or eos_token_id, "
                    "tokenizer_config.json's bos_token or eos_token): memlm puts one before every document; set "
                    "bos_token_id in its config.json")


def missing_tokenizer_line(folder: Path) -> str | None:
    """The one line for a model folder that has no tokenizer.json (None when `folder` is not a model folder)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return None
    slow = [name for name in ("tokenizer.model", "vocab.json", "merges.txt") if (folder / name).is_file()]
    if slow:
        return (f"{folder} is a model folder without {TOKENIZER_JSON} (it has {', '.join(slow)}, which memlm does "
                f"not read): convert them there with {CONVERT.replace('FOLDER', str(folder))}")
    return (f"{folder} is a model folder without {TOKENIZER_JSON}: save the backbone's tokenizer there "
            "(tokenizer.save_pretrained(FOLDER) writes it); memlm never downloads one")


def check_backbone_tokenizer(manifest: dict, backbone: str, data_dir) -> None:
    """Refuse training a backbone on data tokenized by another tokenizer than its folder's tokenizer.json.

    A folder without tokenizer.json has nothing to compare (models/pretrained/checks.py still compares the
    vocabularies); otherwise the data's recorded tokenizer.json hash must be the folder's, so two tokenizers of one
    vocabulary size (a retrained BPE, another family's) are told apart too."""
    path = Path(backbone) / TOKENIZER_JSON
    if not backbone or not path.is_file():
        return
    own = sha256(path.read_bytes())
    data_tok = manifest.get("tokenizer", {})
    recorded = data_tok.get("tokenizer_json_sha256")
    if recorded == own:
        return
    what = (f"another tokenizer.json (sha256 {str(recorded)[:12]}, from {data_tok.get('source')})" if recorded
            else f"memlm's {data_tok.get('kind')} tokenizer")
    raise DataError(f"data.path {data_dir} was prepared with {what}, not the backbone {backbone}'s tokenizer.json "
                    f"(sha256 {own[:12]}): prepare it with `memlm prepare ... --tokenizer-from {backbone}`")
