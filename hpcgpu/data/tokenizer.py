"""Tokenizers as the prepared data sees them: loading, identity (what a prepared dataset was made with)
and the token dtype. No torch here; transformers is imported only when a tokenizer folder is loaded."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hpcgpu.errors import HpcgpuError

UINT16_IDS = 1 << 16
DTYPES = ("uint16", "uint32")
# the files of a tokenizer in a model folder (weights and config.json do not change the token ids)
TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "spiece",
                           "sentencepiece", "hpcgpu_tokenizer")
TOKENIZER_FILE_SUFFIXES = (".model", ".tiktoken")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255: needs no files, works for any text."""

    vocab_size = 256
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save_pretrained(self, path: str | Path) -> None:
        Path(path, "hpcgpu_tokenizer.json").write_text(json.dumps({"type": "bytes", "vocab_size": 256}) + "\n")


def load_tokenizer(name_or_path: str | None) -> Any:
    """The model's own tokenizer if its directory has one, else the byte-level tokenizer."""
    if name_or_path:
        marker = Path(name_or_path, "hpcgpu_tokenizer.json")
        if marker.exists():
            return ByteTokenizer()
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError):
            pass  # a model directory without tokenizer files
    return ByteTokenizer()


def load_tokenizer_dir(path: str | Path | None) -> Any:
    """The tokenizer saved in `path` (None: the byte-level one); unlike load_tokenizer, one that does not
    load is an error, not a silent fall back to bytes: a prepared dataset must be made with the one named."""
    if path is None:
        return ByteTokenizer()
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise HpcgpuError(f"tokenizer folder not found: {path}")
    if (folder / "hpcgpu_tokenizer.json").exists():
        return ByteTokenizer()
    if not tokenizer_files(folder):
        raise HpcgpuError(f"tokenizer {path}: no tokenizer files in it (tokenizer.json, tokenizer_config.json, "
                          "vocab/merges files); give the folder a tokenizer was saved to")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a folder it can't read
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise HpcgpuError(f"tokenizer {path} does not load with AutoTokenizer.from_pretrained: {reason}") from None


def as_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object, or the one saved in a folder (str/Path), or bytes for None."""
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        return load_tokenizer_dir(tokenizer)
    return tokenizer


def vocab_size(tokenizer: Any) -> int:
    """Ids the tokenizer can produce: len() counts added tokens, which vocab_size leaves out."""
    try:
        return int(len(tokenizer))
    except TypeError:
        return int(tokenizer.vocab_size)


def token_dtype(vocab: int, forced: str | None = None) -> str:
    """uint16 when every id fits in 16 bits, else uint32; a forced dtype must hold the vocabulary."""
    if forced is None:
        return "uint16" if vocab <= UINT16_IDS else "uint32"
    if forced not in DTYPES:
        raise HpcgpuError(f"token dtype {forced!r} is not one of {', '.join(DTYPES)}")
    if vocab > np.iinfo(np.dtype(forced)).max + 1:
        raise HpcgpuError(f"the tokenizer's vocabulary of {vocab} ids does not fit {forced} "
                          f"(at most {np.iinfo(np.dtype(forced)).max + 1}); use uint32 or leave the dtype to hpcgpu")
    return forced


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What a prepared dataset records about the tokenizer it was made with."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"path": None, "class": "ByteTokenizer", "vocab_size": ByteTokenizer.vocab_size, "sha256": "bytes"}
    name = getattr(tokenizer, "name_or_path", None) or None
    folder = Path(name).expanduser().resolve() if name and Path(name).expanduser().is_dir() else None
    return {"path": str(folder) if folder else name, "class": type(tokenizer).__name__,
            "vocab_size": vocab_size(tokenizer), "sha256": tokenizer_sha256(tokenizer, folder)}


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same files, class and vocabulary; the path may differ (a copy of the model on another node)."""
    return all(a.get(k) == b.get(k) for k in ("class", "vocab_size", "sha256"))


def describe(identity: dict[str, Any]) -> str:
    if identity.get("sha256") == "bytes":
        return "the byte-level tokenizer"
    return f"{identity.get('class')} from {identity.get('path')} (vocab {identity.get('vocab_size')})"


def tokenizer_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and (
        p.name.startswith(TOKENIZER_FILE_PREFIXES) or p.name.endswith(TOKENIZER_FILE_SUFFIXES)))


def tokenizer_sha256(tokenizer: Any, folder: Path | None) -> str:
    """sha256 over the tokenizer's files; for one loaded from the hub cache (no folder), over its
    serialised form."""
    h = hashlib.sha256()
    if folder is not None:
        for path in tokenizer_files(folder):
            h.update(path.name.encode() + b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
        return h.hexdigest()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    h.update(text.encode())
    return h.hexdigest()
