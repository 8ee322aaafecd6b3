"""The raw inputs of a prepared dataset, read as a stream of documents: memory stays flat whatever
their size (a .jsonl is read line by line, parquet/arrow in record batches through `datasets`).

A .txt file (or any other suffix) is one document, read whole, as training read it before; a .jsonl
has one document a line (its `text_field`); .parquet/.arrow files, a folder of them or a folder
written by `Dataset.save_to_disk` have one document a row.

data.format chat and prompt_completion read a .jsonl of examples instead: one row a line,
{"messages": [{"role", "content"}, ...]} or {"prompt", "completion"}; example_row() checks a row, the
same way for the job and for the host-side checks (hpcgpu/launch/checks.py).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from hpcgpu.errors import HpcgpuError

FORMATS = ("text", "chat", "prompt_completion")  # data.format
EXAMPLE_SHAPES = {"chat": '{"messages": [{"role": ..., "content": ...}, ...]}',
                  "prompt_completion": '{"prompt": ..., "completion": ...}'}
CHUNK_DOCS = 1024  # documents handed to a worker at once
CHUNK_CHARS = 4 << 20  # ... or this many characters, whichever comes first
DATASET_BATCH = 1000  # rows read from parquet/arrow at a time
HASH_BLOCK = 1 << 20


@dataclass
class Source:
    """A raw input: its kind and the files that make it up (one, or a folder's)."""

    path: Path
    kind: str  # text | jsonl | parquet | arrow | saved
    files: list[Path]
    hashes: dict[Path, Any] = field(default_factory=dict)  # sha256 of text/jsonl files, updated while read

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def open_source(path: str | Path) -> Source:
    """Which kind of input `path` is; a missing path or a folder with nothing readable is an error."""
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise HpcgpuError(f"data file not found: {path}")
    if p.is_dir():
        return folder_source(p)
    kind = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}.get(p.suffix, "text")
    return Source(p, kind, [p])


def folder_source(p: Path) -> Source:
    if (p / "state.json").is_file():  # Dataset.save_to_disk
        files = sorted(f for f in p.iterdir() if f.is_file())
        return Source(p, "saved", files)
    parquet, arrow = sorted(p.rglob("*.parquet")), sorted(p.rglob("*.arrow"))
    if parquet and arrow:
        raise HpcgpuError(f"{p}: has both .parquet and .arrow files; give a folder of one kind")
    if not (parquet or arrow):
        raise HpcgpuError(f"{p}: a folder with no .parquet or .arrow files (and no state.json of "
                          "Dataset.save_to_disk); give a .txt, .jsonl, .parquet or .arrow file or such a folder")
    return Source(p, "parquet" if parquet else "arrow", parquet or arrow)


def fingerprint(source: Source) -> list[dict[str, Any]]:
    """Path, size and mtime of every file: what tells a cached preparation is stale, without reading."""
    out = []
    for f in source.files:
        st = f.stat()
        out.append({"path": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def source_records(source: Source, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifest's sources: the fingerprint taken before reading plus each file's sha256.

    A file that changed while it was read is an error: the tokens would match neither version."""
    if fingerprint(source) != before:
        raise HpcgpuError(f"{source.path} changed while it was being prepared; run the preparation again")
    out = []
    for rec in before:
        path = Path(rec["path"])
        hasher = source.hashes.get(path)
        out.append({**rec, "sha256": hasher.hexdigest() if hasher is not None else file_sha256(path)})
    return out


# ---------------------------------------------------------------- documents

def progress_total(source: Source) -> tuple[Optional[int], str]:
    """How much input there is, and in which unit the reader reports progress (bytes or rows)."""
    if source.kind in ("text", "jsonl"):
        return source.total_bytes, "B"
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        rows = 0
        for f in source.files:
            try:
                rows += pq.ParquetFile(f).metadata.num_rows
            except Exception as exc:  # pyarrow's ArrowInvalid (not parquet), OSError, ...
                raise HpcgpuError(f"{f}: cannot be read as parquet: {first_line(exc)}") from None
        return rows, "rows"
    return None, "rows"


def iter_documents(source: Source, text_field: str, data_format: str = "text") -> Iterator[tuple[Any, int]]:
    """(document, progress units) pairs in input order; the document is None for a blank .jsonl line
    (skipped, as training always skipped them, but its bytes count as progress). For chat and
    prompt_completion a document is an Example."""
    if data_format != "text":
        yield from example_documents(source, data_format)
    elif source.kind == "text":
        yield from text_document(source)
    elif source.kind == "jsonl":
        yield from jsonl_documents(source, text_field)
    else:
        yield from dataset_documents(source, text_field)


def text_document(source: Source) -> Iterator[tuple[str, int]]:
    path = source.files[0]
    data = path.read_bytes()
    source.hashes[path] = hashlib.sha256(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HpcgpuError(f"{path}: not UTF-8 text (byte {exc.start}); convert it or give a .jsonl") from None
    yield text, len(data)


def jsonl_documents(source: Source, text_field: str) -> Iterator[tuple[str, int]]:
    path = source.files[0]
    hasher = source.hashes[path] = hashlib.sha256()
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            hasher.update(raw)
            yield jsonl_text(raw, text_field, path, n), len(raw)


def jsonl_text(raw: bytes, text_field: str, path: Path, n: int) -> Any:
    """The document of one line, None for a blank one."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HpcgpuError(f"{path}:{n}: not UTF-8 text; convert the file to UTF-8") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise HpcgpuError(f"{path}:{n}: not a JSON object ({json_error(exc)}); a .jsonl holds one object a line") from None
    text = obj.get(text_field) if isinstance(obj, dict) else None
    if not isinstance(text, str):
        raise HpcgpuError(f"{path}:{n}: expected a JSON object with a \"{text_field}\" field (a string); "
                          f"{text_field_hint(obj)}")
    return text


def json_error(exc: json.JSONDecodeError) -> str:
    """The JSON error with its column (json's own msg alone reads cut: "Unterminated string starting at")."""
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


def text_field_hint(obj: Any) -> str:
    """What to set for a row without the text field: the format its keys look like, else text_field."""
    keys = set(obj) if isinstance(obj, dict) else set()
    if "messages" in keys:
        return "its \"messages\" look like chat rows: set data.format: chat (--format chat)"
    if {"prompt", "completion"} <= keys:
        return "it looks like a prompt/completion row: set data.format: prompt_completion (--format prompt_completion)"
    return "set data.text_field (--text-field) to the field that holds the text"


def dataset_documents(source: Source, text_field: str) -> Iterator[tuple[str, int]]:
    ds = open_dataset(source)
    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise HpcgpuError(f"{source.path}: no column \"{text_field}\" (columns: {', '.join(columns)}); "
                          "set data.text_field (--text-field) to the column that holds the text")
    row = 0
    for batch in ds.select_columns([text_field]).iter(batch_size=DATASET_BATCH):
        for text in batch[text_field]:
            if not isinstance(text, str):
                raise HpcgpuError(f"{source.path}: row {row}: column \"{text_field}\" is "
                                  f"{type(text).__name__}, not a string")
            row += 1
            yield text, 1


def open_dataset(source: Source) -> Any:
    """A `datasets` view of local parquet/arrow files that reads them in batches (streaming, no copy)."""
    import datasets

    try:
        if source.kind == "saved":
            ds = datasets.load_from_disk(str(source.path))
            if isinstance(ds, datasets.DatasetDict):
                raise HpcgpuError(f"{source.path}: holds several splits ({', '.join(ds)}); give one split's folder")
            return ds
        files = [str(f) for f in source.files]
        return datasets.load_dataset(source.kind, data_files=files, split="train", streaming=True)
    except HpcgpuError:
        raise
    except Exception as exc:  # datasets/pyarrow raise many kinds for a file they cannot read
        raise HpcgpuError(f"{source.path}: cannot be read as {source.kind} with datasets: "
                          f"{first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    """An exception's message for a one-line error: its first line, at most 200 characters."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def iter_chunks(docs: Iterator[tuple[Any, int]]) -> Iterator[tuple[list[Any], int]]:
    """Documents grouped into chunks for the workers, with the progress units they cover."""
    texts: list[Any] = []
    chars = units = 0
    for text, n in docs:
        units += n
        if text is None:
            continue
        texts.append(text)
        chars += len(text) if isinstance(text, str) else n  # an Example: its line's bytes
        if len(texts) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield texts, units
            texts, chars, units = [], 0, 0
    if texts or units:
        yield texts, units


# ---------------------------------------------------------------- examples (chat, prompt_completion)

@dataclass(frozen=True)
class Example:
    """One row of a chat or prompt_completion .jsonl; `where` (file:line) names it in errors."""

    where: str
    messages: Optional[list[dict[str, str]]] = None
    prompt: Optional[str] = None
    completion: Optional[str] = None


def example_documents(source: Source, data_format: str) -> Iterator[tuple[Optional[Example], int]]:
    if source.kind != "jsonl":
        raise HpcgpuError(f"{source.path}: data.format {data_format} reads a .jsonl file, one "
                          f"{EXAMPLE_SHAPES[data_format]} a line; give one, or set data.format: text")
    path = source.files[0]
    hasher = source.hashes[path] = hashlib.sha256()
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            hasher.update(raw)
            yield example_row(raw, data_format, path, n), len(raw)


def example_row(raw: bytes, data_format: str, path: Path | str, n: int) -> Optional[Example]:
    """The example of one .jsonl line (None for a blank one); a bad row is one error naming file:line."""
    where = f"{path}:{n}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HpcgpuError(f"{where}: not UTF-8 text; convert the file to UTF-8") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise HpcgpuError(f"{where}: not a JSON object ({json_error(exc)})") from None
    if not isinstance(obj, dict):
        raise HpcgpuError(f"{where}: expected a JSON object {EXAMPLE_SHAPES[data_format]}, "
                          f"got {type(obj).__name__}")
    if data_format == "chat":
        return Example(where, messages=chat_messages(obj, where))
    for key in ("prompt", "completion"):
        if not isinstance(obj.get(key), str):
            raise HpcgpuError(f"{where}: data.format prompt_completion needs a \"{key}\" field (a string) "
                              f"in every row: {EXAMPLE_SHAPES[data_format]}")
    return Example(where, prompt=obj["prompt"], completion=obj["completion"])


def chat_messages(obj: dict[str, Any], where: str) -> list[dict[str, str]]:
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HpcgpuError(f"{where}: data.format chat needs \"messages\" (a non-empty list of "
                          "{\"role\", \"content\"}) in every row")
    for i, message in enumerate(messages, 1):
        for key in ("role", "content"):
            if not isinstance(message, dict) or not isinstance(message.get(key), str):
                raise HpcgpuError(f"{where}: message {i} has no \"{key}\" (a string); each message is "
                                  "{\"role\": ..., \"content\": ...}")
    return messages  # as given: a template may read other keys of a message too
