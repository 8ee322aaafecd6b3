"""The cache of prepared datasets for raw files: the first use of a raw file (a job's start, or
`hpcgpu data prepare SPEC`) tokenizes it, later ones map the result.

An entry is keyed by a hash of the source (absolute path, size and mtime of each of its files), the
tokenizer (class, vocabulary size, sha256 of its files), the text field, the format version and
data.format (chat, prompt_completion; text adds nothing, so the keys of text entries made before
data.format existed stay the same): a source that changed, another tokenizer or another data.format
gives another key, so a stale entry is never reused (reuse() also compares the manifest's data_format).
Exactly one process builds an entry, wherever the cache lives: it holds an flock on a lock file next
to the entry while it writes, and the entry appears by an atomic rename; the others wait on the lock,
then find the finished entry.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

from hpcgpu.data.format import VERSION, dest_lock
from hpcgpu.data.pipeline import PrepareResult, build, reuse
from hpcgpu.data.sources import Source, fingerprint, open_source
from hpcgpu.data.tokenizer import as_tokenizer, tokenizer_identity

log = logging.getLogger("hpcgpu")

ENV_DATA_CACHE = "HPCGPU_DATA_CACHE"


def default_cache_dir() -> Path:
    """$HPCGPU_DATA_CACHE, else ~/.cache/hpcgpu/data ($XDG_CACHE_HOME/hpcgpu/data where that is set)."""
    env = os.environ.get(ENV_DATA_CACHE)
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "hpcgpu" / "data"


def cache_key(src: Source, identity: dict[str, Any], text_field: str, data_format: str = "text") -> str:
    tokenizer = {k: identity[k] for k in ("class", "vocab_size", "sha256")}  # not its path: a copy is the same
    doc = {"sources": fingerprint(src), "tokenizer": tokenizer, "text_field": text_field, "version": VERSION}
    if data_format != "text":  # text keys stay those of the entries made before data.format existed
        doc["data_format"] = data_format
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def entry_path(src: Source, identity: dict[str, Any], text_field: str, cache_dir: str | Path | None,
               data_format: str = "text") -> Path:
    root = Path(cache_dir).expanduser().absolute() if cache_dir else default_cache_dir().absolute()
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", src.path.name)[:60]
    return root / f"{stem}-{cache_key(src, identity, text_field, data_format)[:20]}"


def cache_entry(source: str | Path, tokenizer: Any, text_field: str = "text",
                cache_dir: str | Path | None = None, data_format: str = "text") -> Path:
    """Where the prepared dataset of `source` lives (or will) in the cache."""
    tok = as_tokenizer(tokenizer)
    return entry_path(open_source(source), tokenizer_identity(tok), text_field, cache_dir, data_format)


def prepared_for(source: str | Path, tokenizer: Any, text_field: str = "text",
                 cache_dir: str | Path | None = None, workers: Optional[int] = None,
                 data_format: str = "text") -> Path:
    """The prepared dataset of a raw file (or folder), built on first use, reused after.

    `tokenizer`: a tokenizer folder, a loaded tokenizer, or None for the byte-level one."""
    return ensure_prepared(source, tokenizer, text_field, cache_dir, workers, data_format=data_format).path


def ensure_prepared(source: str | Path, tokenizer: Any, text_field: str = "text",
                    cache_dir: str | Path | None = None, workers: Optional[int] = None, *,
                    data_format: str = "text") -> PrepareResult:
    src, tok = open_source(source), as_tokenizer(tokenizer)
    identity = tokenizer_identity(tok)
    dest = entry_path(src, identity, text_field, cache_dir, data_format)
    t0 = time.monotonic()
    reused = reuse(dest, src, identity, data_format, t0)
    if reused is not None:
        return reused
    def waiting() -> None:
        log.info(f"waiting for another process that prepares {src.path} into {dest}")

    with dest_lock(dest, on_wait=waiting):
        reused = reuse(dest, src, identity, data_format, t0)  # the process we waited for built it
        if reused is not None:
            return reused
        manifest = build(src, tok, dest, text_field=text_field, workers=workers, dtype=None,
                         data_format=data_format)
    return PrepareResult(dest, manifest, True, time.monotonic() - t0)
