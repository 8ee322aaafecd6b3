"""The prepared-dataset format, its writer and its reader.

    DIR/tokens.bin     every token id of every document, in input order, flat little-endian uint16
                       (vocabulary <= 65536 ids) or uint32
    DIR/docs.npy       int64 start offset of each document in tokens.bin, then the token count
                       (length documents + 1)
    DIR/mask.bin       data.format chat and prompt_completion only: one uint8 per token of tokens.bin,
                       1 = the token counts in the loss (a completion's, an assistant message's)
    DIR/manifest.json  format version, dtype, counts, max token id, eos id, tokenizer identity,
                       data_format (text | chat | prompt_completion; absent in older ones: text), sources

A dataset is written into a temporary sibling folder and renamed into place when complete, manifest
last: a folder named DIR with a manifest is complete, and an interrupted write leaves none.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from hpcgpu.errors import HpcgpuError

FORMAT = "hpcgpu-prepared"
VERSION = 1
TOKENS, DOCS, MANIFEST, MASK = "tokens.bin", "docs.npy", "manifest.json", "mask.bin"
OFFSETS_TMP = "docs.offsets.tmp"  # offsets streamed to disk while writing; docs.npy is made from it
COPY_ITEMS = 1 << 20


def is_prepared(path: str | Path) -> bool:
    """A folder that claims to be a prepared dataset (has a manifest of this format)."""
    manifest = Path(path, MANIFEST)
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


# ---------------------------------------------------------------- writing

class TokenWriter:
    """Appends tokenized documents to tokens.bin and their offsets to a temporary file, in order."""

    def __init__(self, folder: Path, dtype: str, masks: bool = False):
        self.folder, self.dtype = folder, np.dtype(dtype).newbyteorder("<")
        self.tokens = open(folder / TOKENS, "wb")
        self.offsets = open(folder / OFFSETS_TMP, "wb")
        self.masks = open(folder / MASK, "wb") if masks else None
        self.num_tokens = self.num_docs = 0

    def write_chunk(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """One chunk: the flat ids of its documents (already in the dtype) and each document's length."""
        self.tokens.write(ids.astype(self.dtype, copy=False).tobytes())
        starts = self.num_tokens + np.concatenate(([0], np.cumsum(lengths[:-1], dtype=np.int64)))
        self.offsets.write(starts.astype("<i8").tobytes() if len(lengths) else b"")
        self.num_tokens += int(lengths.sum())
        self.num_docs += len(lengths)

    def write_mask(self, mask: np.ndarray) -> None:
        """The loss mask of the chunk just written (examples only): one uint8 per id."""
        assert self.masks is not None
        self.masks.write(mask.astype(np.uint8, copy=False).tobytes())

    def drop_last_token(self) -> None:
        """The stream of a single document has no eos after it (training's rule since the start)."""
        self.tokens.flush()
        self.num_tokens -= 1
        self.tokens.truncate(self.num_tokens * self.dtype.itemsize)

    def close_files(self) -> None:
        for fh in (self.tokens, self.offsets, self.masks):
            if fh is not None:
                fh.close()

    abort = close_files  # the partial folder is removed by writing()

    def close(self) -> None:
        """Flush tokens.bin and turn the streamed offsets into docs.npy (copied in bounded pieces)."""
        self.close_files()
        raw = np.memmap(self.folder / OFFSETS_TMP, dtype="<i8", mode="r") if self.num_docs else np.zeros(0, "<i8")
        docs = np.lib.format.open_memmap(self.folder / DOCS, mode="w+", dtype="<i8", shape=(self.num_docs + 1,))
        for i in range(0, self.num_docs, COPY_ITEMS):
            stop = min(i + COPY_ITEMS, self.num_docs)
            docs[i: stop] = raw[i: stop]
        docs[self.num_docs] = self.num_tokens
        docs.flush()
        del docs, raw
        (self.folder / OFFSETS_TMP).unlink()


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, **manifest}, indent=2) + "\n")
    os.replace(tmp, folder / MANIFEST)


def partial_dir(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.partial"


def lock_path(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.lock"


@contextlib.contextmanager
def dest_lock(dest: Path, on_wait: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """An exclusive flock on a file next to `dest`: one process writes a given folder at a time, on
    one machine or several (a shared filesystem). The OS releases it when its holder dies."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(dest), "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def writing(dest: Path) -> Iterator[Path]:
    """A fresh temporary sibling folder to write into, renamed to `dest` on success.

    Call under dest_lock. A leftover of a killed writer is removed first; on an error the partial
    folder goes too. An existing `dest` is replaced only if it is a prepared dataset (a rerun)."""
    tmp = partial_dir(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, dest)


def publish(tmp: Path, dest: Path) -> None:
    if dest.exists() and not dest.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        raise HpcgpuError(f"{dest} exists and is a file; give another output folder")
    if dest.is_dir() and any(dest.iterdir()):
        if not is_prepared(dest):
            shutil.rmtree(tmp, ignore_errors=True)
            raise HpcgpuError(f"{dest} exists and is not a prepared dataset; give another output folder")
        old = dest.parent / f".{dest.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
        return
    if dest.is_dir():
        dest.rmdir()
    os.rename(tmp, dest)


def check_output(dest: Path) -> None:
    """Refuse an output folder that holds something else before any work is done."""
    if dest.exists() and not dest.is_dir():
        raise HpcgpuError(f"{dest} exists and is a file; give another output folder")
    if dest.is_dir() and any(dest.iterdir()) and not is_prepared(dest):
        raise HpcgpuError(f"{dest} exists and is not a prepared dataset; give another output folder")


# ---------------------------------------------------------------- reading

class PreparedData:
    """A prepared dataset, memory-mapped read-only: opening it reads the manifest, not the tokens."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        m = self.manifest
        self.dtype = np.dtype(m["dtype"]).newbyteorder("<")
        self.num_tokens, self.num_documents = int(m["num_tokens"]), int(m["num_documents"])
        self.max_token_id: Optional[int] = m.get("max_token_id")
        self.tokenizer: dict[str, Any] = m["tokenizer"]
        self.data_format: str = m.get("data_format") or "text"
        self.eos_id: Optional[int] = m.get("eos_id")
        check_sizes(self.path, self.num_tokens * self.dtype.itemsize)
        self.tokens = map_file(self.path / TOKENS, self.dtype, self.num_tokens)
        self.mask: Optional[np.ndarray] = None  # text: every token counts
        if self.data_format != "text":
            check_mask(self.path, self.num_tokens)
            self.mask = map_file(self.path / MASK, np.dtype(np.uint8), self.num_tokens)

    def documents(self) -> np.ndarray:
        """Start offsets of the documents, then the token count (memory-mapped)."""
        return np.load(self.path / DOCS, mmap_mode="r")


def map_file(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if not count:
        return np.zeros(0, dtype=dtype)  # np.memmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def check_mask(path: Path, num_tokens: int) -> None:
    """A chat/prompt_completion dataset has one mask byte per token."""
    try:
        size = (path / MASK).stat().st_size
    except FileNotFoundError:
        raise HpcgpuError(f"{path}: no {MASK} (the loss mask of a chat/prompt_completion dataset); "
                          "run hpcgpu data prepare again") from None
    if size != num_tokens:
        raise HpcgpuError(f"{path}/{MASK}: {size} bytes, the manifest says {num_tokens} tokens; "
                          "run hpcgpu data prepare again")


def read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise HpcgpuError(f"prepared dataset not found: {path}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise HpcgpuError(f"{path}: not a complete prepared dataset (no {MANIFEST}); "
                          "run hpcgpu data prepare again") from None
    except (OSError, ValueError) as exc:
        raise HpcgpuError(f"{path}/{MANIFEST}: unreadable ({exc.__class__.__name__}); "
                          "run hpcgpu data prepare again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise HpcgpuError(f"{path}/{MANIFEST}: not a manifest of hpcgpu data prepare")
    if manifest.get("version") != VERSION:
        raise HpcgpuError(f"{path}: prepared with format version {manifest.get('version')}, this hpcgpu reads "
                          f"version {VERSION}; run hpcgpu data prepare again")
    if manifest.get("dtype") not in ("uint16", "uint32"):
        raise HpcgpuError(f"{path}/{MANIFEST}: dtype {manifest.get('dtype')!r} is not uint16 or uint32")
    return manifest


def check_sizes(path: Path, token_bytes: int) -> None:
    """tokens.bin holds exactly what the manifest counts, and docs.npy is there."""
    try:
        size = (path / TOKENS).stat().st_size
    except FileNotFoundError:
        raise HpcgpuError(f"{path}: no {TOKENS}; run hpcgpu data prepare again") from None
    if size != token_bytes:
        raise HpcgpuError(f"{path}/{TOKENS}: {size} bytes, the manifest says {token_bytes}; "
                          "run hpcgpu data prepare again")
    if not (path / DOCS).is_file():
        raise HpcgpuError(f"{path}: no {DOCS}; run hpcgpu data prepare again")
