"""Tokenize a raw input once into a prepared dataset (format.py), over worker processes.

The token stream is exactly what training tokenized in memory before: each document's ids (the
tokenizer's encode(), special tokens included) followed by the eos id, except when the input holds a
single document (a .txt file): then no eos. So a spec that switches from the raw file to the prepared
dataset trains on identical sequences.

data.format chat and prompt_completion: each example's ids then eos (always, one example or many), and
a loss mask beside them (mask.bin; examples.py says which tokens count). Rows with no trainable token
(trainable.py) are counted into the manifest; data where no row has one is refused.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from hpcgpu.data.examples import check_chat_template, encode_examples
from hpcgpu.data.format import (TokenWriter, check_output, dest_lock, is_prepared, read_manifest, write_manifest,
                                writing)
from hpcgpu.data.sources import (
    CHUNK_CHARS, FORMATS, Source, fingerprint, iter_chunks, iter_documents, open_source, progress_total,
    source_records)
from hpcgpu.data.tokenizer import (ByteTokenizer, as_tokenizer, describe, same_tokenizer, token_dtype,
                                   tokenizer_identity, vocab_size)
from hpcgpu.data.trainable import UntrainedRows
from hpcgpu.errors import HpcgpuError
from hpcgpu.procs import set_parent_death_signal

log = logging.getLogger("hpcgpu")

LOG_EVERY_S = 30.0  # progress lines when stderr is not a terminal (a SLURM log)
IN_FLIGHT_PER_WORKER = 2  # chunks queued per worker: enough to keep them busy, memory stays bounded


@dataclass
class PrepareResult:
    """What `prepare` gave: where the prepared dataset is (read it with PreparedData) and how it came about."""

    path: Path
    manifest: dict[str, Any]
    built: bool  # False: an existing cache entry was reused
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.manifest["num_tokens"] / self.seconds if self.seconds > 0 else 0.0


def default_workers() -> int:
    """The CPUs this process may run on (a SLURM job's share, not the whole node)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def prepare(source: str | Path, tokenizer: Any, output: str | Path, *, text_field: str = "text",
            workers: Optional[int] = None, dtype: Optional[str] = None, data_format: str = "text") -> PrepareResult:
    """Tokenize `source` into the prepared dataset `output` (replacing an older one there)."""
    src, tok = open_source(source), as_tokenizer(tokenizer)
    dest = Path(output).expanduser().absolute()
    check_output(dest)
    t0 = time.monotonic()
    waited: list[bool] = []

    def waiting() -> None:
        waited.append(True)
        log.info(f"another `data prepare` writes {dest}; waiting for it to finish")

    with dest_lock(dest, on_wait=waiting):
        if waited:  # the one we waited for may have made just this: its source, tokenizer, field, dtype
            done = reuse(dest, src, tokenizer_identity(tok), data_format, t0)
            if done is not None and done.manifest.get("text_field") == text_field \
                    and dtype in (None, done.manifest.get("dtype")):
                return done
        manifest = build(src, tok, dest, text_field=text_field, workers=workers, dtype=dtype,
                         data_format=data_format)
    return PrepareResult(dest, manifest, True, time.monotonic() - t0)


def build(src: Source, tokenizer: Any, dest: Path, *, text_field: str, workers: Optional[int],
          dtype: Optional[str], data_format: str = "text") -> dict[str, Any]:
    """Write the dataset of `src` to `dest` (call under dest_lock); returns its manifest."""
    identity = tokenizer_identity(tokenizer)
    check_format(data_format, tokenizer, identity)
    token_type = token_dtype(vocab_size(tokenizer), dtype)
    n_workers = workers_for(src, workers)
    log.info(f"preparing {src.path} with {describe(identity)}, {n_workers} worker(s) -> {dest}")
    t0 = time.monotonic()
    before = fingerprint(src)
    with writing(dest) as tmp:
        counts = write_tokens(src, tokenizer, tmp, token_type, text_field, n_workers, data_format)
        if not counts["num_tokens"]:  # nothing to train on: an error here, not a run that fails later
            raise HpcgpuError(f"{src.path}: no text in it (empty, or only blank lines); nothing to prepare")
        seconds = time.monotonic() - t0
        manifest = {"dtype": token_type, **counts, "tokenizer": identity, "text_field": text_field,
                    "data_format": data_format, "sources": source_records(src, before),
                    "seconds": round(seconds, 3)}
        write_manifest(tmp, manifest)
    rate = counts["num_tokens"] / seconds if seconds > 0 else 0.0
    log.info(f"prepared {src.path}: {counts['num_tokens']:,} tokens, {counts['num_documents']:,} documents, "
             f"{token_type}, {seconds:.1f} s ({rate:,.0f} tokens/s) -> {dest}")
    return manifest


def check_format(data_format: str, tokenizer: Any, identity: dict[str, Any]) -> None:
    if data_format not in FORMATS:
        raise HpcgpuError(f"data.format {data_format!r} is not one of {', '.join(FORMATS)}")
    if data_format == "chat":
        check_chat_template(tokenizer, describe(identity))


def workers_for(src: Source, requested: Optional[int]) -> int:
    """No more workers than there are chunks to give them (a small file is tokenized in-process)."""
    if requested is not None and requested < 1:
        raise HpcgpuError(f"workers must be at least 1, got {requested}")
    want = requested or default_workers()
    if src.kind == "text":
        return 1  # one document
    return max(1, min(want, 1 + src.total_bytes // CHUNK_CHARS))


def write_tokens(src: Source, tokenizer: Any, folder: Path, dtype: str, text_field: str,
                 workers: int, data_format: str = "text") -> dict[str, Any]:
    """Tokenize every document into `folder`; returns the counts for the manifest."""
    eos = getattr(tokenizer, "eos_token_id", None)
    examples = data_format != "text"
    total = progress_total(src)  # reads parquet footers: an unreadable file fails before anything is opened
    writer = TokenWriter(folder, dtype, masks=examples)
    top = -1
    progress = TokenizeProgress(*total, label=src.path.name)
    untrained = UntrainedRows(data_format) if examples else None
    try:
        for chunk, units in tokenized_chunks(src, tokenizer, text_field, workers, eos, dtype, data_format,
                                             untrained):
            writer.write_chunk(chunk.ids, chunk.lengths)
            if chunk.mask is not None:
                writer.write_mask(chunk.mask)
            top = max(top, chunk.max_id)
            progress.update(units, len(chunk.ids))
        if untrained is not None and (refusal := untrained.refusal()):
            raise HpcgpuError(refusal)
    except BaseException:
        writer.abort()
        raise
    finally:
        progress.close()
    if writer.num_docs == 1 and eos is not None and not examples:
        writer.drop_last_token()
    elif writer.num_docs > 1 and eos is not None:
        top = max(top, int(eos))
    writer.close()
    if untrained is not None and (note := untrained.note()):
        log.warning(note)
    return {"num_tokens": writer.num_tokens, "num_documents": writer.num_docs,
            "max_token_id": top if writer.num_tokens else None, "eos_id": eos,
            **(untrained.manifest() if untrained is not None else {})}


# ---------------------------------------------------------------- tokenizing chunks

@dataclass
class Chunk:
    ids: np.ndarray  # every document's ids then eos, flat, in the dataset's dtype
    lengths: np.ndarray  # tokens per document (eos included)
    max_id: int  # the largest id of the documents (eos not counted), -1 if none
    mask: Optional[np.ndarray] = None  # chat/prompt_completion: uint8 per token, 1 = counts in the loss


def tokenize_chunk(tokenizer: Any, texts: list[Any], eos: Optional[int], dtype: str,
                   data_format: str = "text") -> Chunk:
    if data_format != "text":
        return tokenize_examples(tokenizer, texts, eos, dtype, data_format)
    arrays = encode_all(tokenizer, texts)
    top = max((int(a.max()) for a in arrays if len(a)), default=-1)
    limit = int(np.iinfo(np.dtype(dtype)).max)
    if top > limit:
        raise HpcgpuError(f"token id {top} does not fit {dtype}; prepare with uint32")
    if eos is not None:
        tail = np.asarray([eos], dtype=np.int64)
        arrays = [piece for a in arrays for piece in (a, tail)]
        lengths = np.asarray([len(a) + 1 for a in arrays[::2]], dtype=np.int64)
    else:
        lengths = np.asarray([len(a) for a in arrays], dtype=np.int64)
    ids = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype=dtype)
    return Chunk(ids, lengths, top)


def tokenize_examples(tokenizer: Any, examples: list[Any], eos: Optional[int], dtype: str,
                      data_format: str) -> Chunk:
    """Each example's ids (eos included) and loss mask, flat."""
    encoded = encode_examples(tokenizer, examples, data_format, eos)
    top = max((int(ids.max()) for ids, _ in encoded if len(ids)), default=-1)
    limit = int(np.iinfo(np.dtype(dtype)).max)
    if top > limit:
        raise HpcgpuError(f"token id {top} does not fit {dtype}; prepare with uint32")
    lengths = np.asarray([len(ids) for ids, _ in encoded], dtype=np.int64)
    if not encoded:
        return Chunk(np.zeros(0, dtype=dtype), lengths, top, np.zeros(0, dtype=np.uint8))
    ids = np.concatenate([ids for ids, _ in encoded]).astype(dtype)
    return Chunk(ids, lengths, top, np.concatenate([mask for _, mask in encoded]))


def encode_all(tokenizer: Any, texts: list[str]) -> list[np.ndarray]:
    """Each text's ids, as tokenizer.encode(text) gives them; fast tokenizers get one batch call."""
    if isinstance(tokenizer, ByteTokenizer):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    if getattr(tokenizer, "is_fast", False) and texts:
        # ids only: the attention masks (and token type ids) the call builds by default are thrown away
        enc = tokenizer(texts, verbose=False, return_attention_mask=False, return_token_type_ids=False)
        return [np.asarray(ids, dtype=np.int64) for ids in enc["input_ids"]]
    return [np.asarray(tokenizer.encode(t), dtype=np.int64) for t in texts]


_worker: dict[str, Any] = {}


def init_worker(tokenizer: Any, eos: Optional[int], dtype: str, data_format: str = "text") -> None:
    # a prepare killed outright (kill -9) takes its workers along, without a BrokenPipeError each
    set_parent_death_signal()
    # the processes already use every core: no Rust thread pool inside each of them
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=tokenizer, eos=eos, dtype=dtype, data_format=data_format)


def tokenize_in_worker(texts: list[Any]) -> Chunk:
    return tokenize_chunk(_worker["tokenizer"], texts, _worker["eos"], _worker["dtype"], _worker["data_format"])


def tokenized_chunks(src: Source, tokenizer: Any, text_field: str, workers: int, eos: Optional[int],
                     dtype: str, data_format: str = "text",
                     untrained: Optional[UntrainedRows] = None) -> Iterator[tuple[Chunk, int]]:
    """Tokenized chunks in input order, with the progress units each covers; `untrained` sees each example."""
    documents = iter_documents(src, text_field, data_format)
    chunks = iter_chunks(untrained.watch(documents) if untrained is not None else documents)
    if workers == 1:
        for texts, units in chunks:
            yield tokenize_chunk(tokenizer, texts, eos, dtype, data_format), units
        return
    ctx = mp.get_context(start_method())
    with ctx.Pool(workers, initializer=init_worker, initargs=(tokenizer, eos, dtype, data_format)) as pool:
        pending: deque[tuple[Any, int]] = deque()
        for texts, units in chunks:  # apply_async by hand: Pool.imap would read the whole input ahead
            pending.append((pool.apply_async(tokenize_in_worker, (texts,)), units))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                result, n = pending.popleft()
                yield result.get(), n
        while pending:
            result, n = pending.popleft()
            yield result.get(), n


def start_method() -> str:
    """fork (quick: no re-import, no tokenizer pickling) unless this process runs a job's CUDA or
    process group, whose threads may hold locks a forked child would inherit: then spawn."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "fork"
    dist = getattr(torch, "distributed", None)
    in_group = dist is not None and dist.is_available() and dist.is_initialized()
    return "spawn" if in_group or torch.cuda.is_initialized() else "fork"


# ---------------------------------------------------------------- progress

class TokenizeProgress:
    """A tqdm bar with tokens/s and ETA on a terminal; elsewhere a log line every LOG_EVERY_S."""

    def __init__(self, total: Optional[int], unit: str, label: str):
        self.total, self.unit, self.label = total, unit, label
        self.t0 = self.last_log = time.monotonic()
        self.done = self.tokens = 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, unit_scale=True, desc=f"tokenizing {label}", leave=False)

    def update(self, units: int, tokens: int) -> None:
        self.done += units
        self.tokens += tokens
        now = time.monotonic()
        rate = self.tokens / max(now - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(units)
            self.bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
        elif now - self.last_log >= LOG_EVERY_S:
            self.last_log = now
            log.info(f"tokenizing {self.label}: {self.where()}, {self.tokens:,} tokens, {rate:,.0f} tokens/s"
                     f"{self.eta(now)}")

    def where(self) -> str:
        if self.total:
            return f"{100 * self.done / self.total:.0f}%"
        return f"{self.done:,} {self.unit}"

    def eta(self, now: float) -> str:
        if not self.total or not self.done:
            return ""
        left = (self.total - self.done) * (now - self.t0) / self.done
        return f", ETA {int(left // 60)}:{int(left % 60):02d}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def reuse(dest: Path, src: Source, identity: dict[str, Any], data_format: str, t0: float) -> Optional[PrepareResult]:
    """The finished entry at `dest` if it is one for this very source, tokenizer and format, else None."""
    if not is_prepared(dest):
        return None
    manifest = read_manifest(dest)
    recorded = [{k: s[k] for k in ("path", "size", "mtime_ns")} for s in manifest.get("sources", [])]
    if recorded != fingerprint(src) or not same_tokenizer(manifest["tokenizer"], identity) \
            or (manifest.get("data_format") or "text") != data_format:
        return None  # a hash collision or a hand-edited entry: never reuse what does not match
    log.info(f"reusing prepared data for {src.path}: {dest} ({manifest['num_tokens']:,} tokens, "
             f"{manifest['dtype']})")
    return PrepareResult(dest, manifest, False, time.monotonic() - t0)
