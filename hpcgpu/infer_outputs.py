"""task: infer's output files: what each replica appends as it goes, read back on a resume, and the
merge into `outputs.jsonl` at the end. No torch here.

    outputs/replica-N.jsonl  one JSON object a line, one line per row, appended by replica (rank) N a
                             batch at a time (one write, flushed and fsynced); a resumed job appends
                             to the same files
    outputs.jsonl            every row once, in input order; written by rank 0 under a temporary
                             name and renamed when whole

A line is a row's record: {"id", "index", ...} (runtime/tasks/infer.py says what else). A row is done
when a whole line (valid JSON, ending in a newline) holds it, in any replica's file: a job resumed with
another replica count skips the rows every earlier replica wrote. A last line cut short by a kill -9
is truncated away by repair() before anything is read, and its row is redone.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

from hpcgpu.contract import RunPaths
from hpcgpu.errors import HpcgpuError
from hpcgpu.infer_inputs import Row

log = logging.getLogger("hpcgpu")

_REPLICA_FILE = re.compile(r"replica-(\d+)\.jsonl$")


def replica_files(paths: RunPaths) -> list[Path]:
    """Every replica's file of this run, by replica number (also those of replicas a resumed job with
    fewer ranks no longer has)."""
    folder = paths.replica_outputs(0).parent
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _REPLICA_FILE.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def _whole_lines(data: bytes) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
    """(line number, end offset, record or None where the line is not a whole row) of each line, up to
    the first that is not whole: a line without its newline, or not a JSON object with an integer
    "index" (a write cut by a kill, or a disk that lost the end of the file)."""
    start, number = 0, 0
    while start < len(data):
        end = data.find(b"\n", start)
        number += 1
        if end < 0:
            yield number, len(data), None
            return
        try:
            record = json.loads(data[start:end])
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("index"), int) and "id" in record):
            yield number, end + 1, None
            return
        yield number, end + 1, record
        start = end + 1


def repair(path: Path) -> int | None:
    """Cut the file back to its whole rows; returns the number of the first line cut away (None when
    the file was whole). Only before the replicas start writing: the rows cut are redone."""
    data = path.read_bytes()
    keep, bad = 0, None
    for number, end, record in _whole_lines(data):
        if record is None:
            bad = number
            break
        keep = end
    if bad is None:
        return None
    with open(path, "r+b") as fh:
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    return bad


def repair_all(paths: RunPaths) -> None:
    """Rank 0, before any replica reads or writes: every replica file back to its whole rows."""
    for path in replica_files(paths):
        bad = repair(path)
        if bad is not None:
            log.warning(f"{path.relative_to(paths.run_dir)}: line {bad} is not a whole row (a write cut short, "
                        "e.g. by a kill -9); it and anything after it are removed and those rows are redone")


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """The whole rows of one replica file (a line being appended right now is left out)."""
    for _, _, record in _whole_lines(path.read_bytes()):
        if record is None:
            return
        yield record


def check_record(record: dict[str, Any], rows: Sequence[Row], path: Path) -> int:
    """The row index of a record, checked against the input: a record of another input is one clear error."""
    index = record["index"]
    if not 0 <= index < len(rows) or rows[index].id != record["id"]:
        raise HpcgpuError(f"{path}: a row ({{\"index\": {index}, \"id\": {json.dumps(record['id'])}}}) that the "
                          f"input does not have at that position; the input changed since the run started: "
                          f"restore it, or start a fresh run (submit --new)")
    return index


def done_rows(paths: RunPaths, rows: Sequence[Row]) -> set[int]:
    """The indices of the rows some replica has written (every replica file of the run)."""
    done: set[int] = set()
    for path in replica_files(paths):
        for record in read_records(path):
            done.add(check_record(record, rows, path))
    return done


class ReplicaWriter:
    """Appends one replica's rows, a group at a time (a batch, or the rows the slot engine finished since
    the last write): one write, flushed and fsynced, so that a row reported done is on disk."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, "ab")

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        if not records:
            return
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        self._fh.write(data)
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "ReplicaWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merge(paths: RunPaths, rows: Sequence[Row]) -> Path:
    """outputs.jsonl: every row once, in input order, from all the replica files (rank 0, after every
    replica finished). Written under a temporary name, fsynced, renamed."""
    lines: list[str | None] = [None] * len(rows)
    for path in replica_files(paths):
        for record in read_records(path):
            index = check_record(record, rows, path)
            if lines[index] is None:
                lines[index] = json.dumps(record, ensure_ascii=False) + "\n"
    missing = [i for i, line in enumerate(lines) if line is None]
    if missing:
        first = rows[missing[0]]
        raise HpcgpuError(f"{len(missing)} of {len(rows)} rows are in no replica's output (the first: id "
                          f"{json.dumps(first.id)}, line {first.line}); run the job again to redo them")
    out = paths.outputs
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(lines)  # type: ignore[arg-type]
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out)
    return out
