"""The data folder's tokenizer as a local folder that load_tokenizer reads, also when the data is at a URL.

A URL cannot be listed, so the files come from what the tokenizer names: tokenizer.json, and the file its "model"
key names (spm.model, hf-tokenizer.json). Together they must hash to the manifest's tokenizer sha256 (the identity
tokenizers.py defines), so a tokenizer from another prepare is refused before any text is encoded.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from ..format import TOKENIZER_DIR, DataError
from .fetch import Fetcher
from .location import Location, as_location, is_remote

_FETCHED: dict[tuple[str, str], Path] = {}  # (data folder, tokenizer sha256) -> its local copy in this process


def tokenizer_folder(data_dir, manifest: dict) -> Path:
    """The local folder holding the data's tokenizer (for a URL: fetched once per process and checked)."""
    rel = manifest["tokenizer"].get("path", TOKENIZER_DIR)
    if not is_remote(data_dir):
        # A Location's root string, or the folder itself (not getattr(.., "root"): every Path has a .root, "/")
        return Path(data_dir.root if isinstance(data_dir, Location) else data_dir) / rel
    location = as_location(data_dir)
    expected = str(manifest["tokenizer"].get("sha256", ""))
    key = (location.root, expected)
    if key in _FETCHED and _FETCHED[key].is_dir():
        return _FETCHED[key]
    fetcher = Fetcher(location.options)
    config_bytes = fetcher.read_bytes(location.url(f"{rel}/tokenizer.json"))
    files = {"tokenizer.json": config_bytes}
    try:
        config = json.loads(config_bytes)
    except ValueError as err:
        raise DataError(f"{location.display(rel + '/tokenizer.json')} is not readable JSON ({err}); upload the data "
                        "folder again") from None
    model = config.get("model") if isinstance(config, dict) else None
    if isinstance(model, str) and model and "/" not in model and model != "tokenizer.json":
        files[model] = fetcher.read_bytes(location.url(f"{rel}/{model}"))
    digest = hashlib.sha256()
    for name, content in sorted(files.items()):
        digest.update(name.encode() + b"\0" + str(len(content)).encode() + b"\0" + content)
    if digest.hexdigest() != expected:
        raise DataError(f"the tokenizer at {location.display(rel)} has sha256 {digest.hexdigest()[:12]}..., the "
                        f"manifest says {expected[:12]}...: it is from another prepare (upload the data folder again)")
    folder = _local_folder(location.options.cache_dir, expected)
    for name, content in files.items():
        partial = folder / f".{name}.partial"
        partial.write_bytes(content)
        partial.replace(folder / name)
    _FETCHED[key] = folder
    return folder


def _local_folder(cache_dir: str, sha256: str) -> Path:
    if cache_dir:
        folder = Path(cache_dir).expanduser() / "tokenizers" / sha256
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    folder = Path(tempfile.mkdtemp(prefix="memlm-tokenizer-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder
