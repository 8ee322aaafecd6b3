"""Prepared datasets: raw text tokenized once into a flat token file that every rank memory-maps.

No torch here (host-side commands use it); numpy only, transformers and datasets imported lazily.
See format.py for the files, prepare.py for the tokenization, cache.py for raw files used directly.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from hpcgpu.data.cache import cache_entry, default_cache_dir, ensure_prepared, prepared_for
from hpcgpu.data.format import MANIFEST, MASK, TOKENS, PreparedData, is_prepared
from hpcgpu.data.pipeline import PrepareResult, prepare
from hpcgpu.data.tokenizer import (
    ByteTokenizer, describe, load_tokenizer, load_tokenizer_dir, same_tokenizer, tokenizer_identity)
from hpcgpu.errors import HpcgpuError

__all__ = ["MASK", "ByteTokenizer", "PrepareResult", "PreparedData", "cache_entry", "default_cache_dir",
           "ensure_prepared", "format_mismatch", "is_prepared", "load_tokenizer", "load_tokenizer_dir",
           "looks_prepared", "open_training_data", "prepare", "prepared_for"]


def looks_prepared(path: str | Path) -> bool:
    """A folder meant as a prepared dataset (complete or not): it gets the reader's errors, not the
    raw-folder ones."""
    p = Path(path)
    return p.is_dir() and ((p / MANIFEST).exists() or (p / TOKENS).exists())


def open_training_data(path: str, tokenizer: Any, text_field: str = "text",
                       cache_dir: Optional[str] = None, data_format: str = "text") -> PreparedData:
    """The prepared dataset behind a data.train/data.eval value: a prepared folder as it is (made with
    this tokenizer and data.format), a raw file through the cache."""
    if looks_prepared(path):
        data = PreparedData(path)
        mine = tokenizer_identity(tokenizer)
        if not same_tokenizer(data.tokenizer, mine):
            raise HpcgpuError(f"{path} was prepared with {describe(data.tokenizer)}, but the model's tokenizer "
                              f"is {describe(mine)}; prepare it again with the model's tokenizer "
                              "(hpcgpu data prepare SPEC)")
        if data.data_format != data_format:
            raise HpcgpuError(format_mismatch(path, data.data_format, data_format))
        return data
    return PreparedData(prepared_for(path, tokenizer, text_field, cache_dir, data_format=data_format))


def format_mismatch(path: str | Path, prepared: str, wanted: str) -> str:
    """The one line for a prepared folder of another data.format (the job and the host checks)."""
    return (f"data.format: {path} was prepared as data.format {prepared}, the spec says {wanted}; "
            f"set data.format: {prepared} or prepare the data again with data.format {wanted}")
