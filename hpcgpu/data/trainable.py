"""Rows with no trainable token: the one rule, shared by the host checks and the job.

A chat row trains on its assistant messages, a prompt_completion row on its completion (examples.py
says which tokens count). A row has no trainable token when its chat has no assistant message with
content, or its completion is empty: `trainable` decides it, from the row alone (no tokenizer).

Data where no row has one would train on nothing (every step's loss 0): the same one line refuses it
on the host (`hpcgpu validate/sbatch/submit`, launch/checks.py, reading a raw .jsonl up to SEARCH_BYTES)
and in the job (pipeline.py, as it prepares every row, for data the host did not read). Data where
only some rows have none trains: the count and the first row's file:line are a note on the host, a
log line of `data prepare` and of the job, and the manifest's `untrained_rows`/`first_untrained`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from hpcgpu.data.sources import Example, example_row
from hpcgpu.errors import HpcgpuError

# of a raw .jsonl, the host counts the rows of the first COUNT_BYTES (the job counts them all), and reads
# on to SEARCH_BYTES only while no row with a trainable token was seen (the data may be refused)
COUNT_BYTES, SEARCH_BYTES = 32 << 20, 256 << 20
WHY = {"chat": "no assistant message with content", "prompt_completion": "an empty completion"}
NONE = {"chat": "none has an assistant message with content", "prompt_completion": "every completion is empty"}
FIX = {"chat": "add the assistant's replies (only assistant messages count in the loss)",
       "prompt_completion": "give the rows their completions (only the completion counts in the loss)"}


def trainable(example: Example) -> bool:
    """Whether a row has a token the loss counts: an assistant message with content, or a completion."""
    if example.messages is not None:
        return any(m["role"] == "assistant" and m["content"] for m in example.messages)
    return bool(example.completion)


def none_trainable(first: str, data_format: str) -> str:
    """The one line refusing data of which no row has a trainable token; `first`: its first row, file:line."""
    return (f"{first}: no row has a trainable token ({NONE[data_format]}), so every step's loss would be 0; "
            f"{FIX[data_format]}")


def some_untrained(count: int, rows: int, first: str, data_format: str, scope: str = "") -> str:
    """The note for data of which some rows have no trainable token; `scope` says which rows were read."""
    return (f"{count:,} of {rows:,} rows{scope} have no trainable token ({WHY[data_format]}), the first at "
            f"{first}; they add nothing to the loss")


@dataclass
class UntrainedRows:
    """A count of the rows without a trainable token, as they are read."""

    data_format: str
    rows: int = 0
    untrained: int = 0
    first: Optional[str] = None  # file:line of the first one

    def see(self, example: Example) -> None:
        self.rows += 1
        if not trainable(example):
            self.untrained += 1
            self.first = self.first or example.where

    def watch(self, documents: Iterator[tuple[Any, int]]) -> Iterator[tuple[Any, int]]:
        """The documents (Examples, None for a blank line) as they pass, each seen."""
        for example, units in documents:
            if example is not None:
                self.see(example)
            yield example, units

    def refusal(self) -> Optional[str]:
        """The refusal when no row read has a trainable token (and some row was read)."""
        if self.rows and self.untrained == self.rows and self.first:
            return none_trainable(self.first, self.data_format)
        return None

    def note(self, scope: str = "") -> Optional[str]:
        if not self.untrained or not self.first:
            return None
        return some_untrained(self.untrained, self.rows, self.first, self.data_format, scope)

    def manifest(self) -> dict[str, Any]:
        """What a prepared dataset records of it (the job reports it from there)."""
        return {"untrained_rows": self.untrained, "first_untrained": self.first}


def manifest_note(manifest: dict[str, Any]) -> Optional[str]:
    """The note of a prepared dataset's manifest, or None (none untrained, or prepared before it counted)."""
    count, first, fmt = manifest.get("untrained_rows"), manifest.get("first_untrained"), manifest.get("data_format")
    if not count or not first or fmt not in WHY:
        return None
    return some_untrained(int(count), int(manifest.get("num_documents") or 0), str(first), fmt)


def scan_rows(path: Path, data_format: str, count: int, search: int) -> tuple[UntrainedRows, int, bool]:
    """The count over a raw .jsonl's rows, read with the job's reader (see COUNT_BYTES); the bytes read
    and whether that was the whole file."""
    tally = UntrainedRows(data_format)
    read = 0
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            example = example_row(raw, data_format, path, n)
            if example is not None:
                tally.see(example)
            read += len(raw)
            if (read >= count and tally.untrained < tally.rows) or read >= search:
                return tally, read, False
    return tally, read, True


Note = Callable[[str], None]


def untrained_problem(key: str, value: str, data_format: str, note: Optional[Note]) -> Optional[str]:
    """The host's check of data.train/data.eval (`key`): the refusal when no row of a raw .jsonl has a
    trainable token; where some rows have none, a note (through `note`) and None. A prepared folder's
    count is its manifest's. A file the row check refuses, or another kind of input, is left alone."""
    path = Path(value).expanduser()
    if path.is_dir():
        text = folder_note(path)
    elif path.suffix != ".jsonl" or not path.is_file():
        return None
    else:
        try:
            tally, read, whole = scan_rows(path, data_format, COUNT_BYTES, SEARCH_BYTES)
        except (OSError, HpcgpuError):
            return None  # the row check (or the job's reader) says what is wrong
        if whole and (refusal := tally.refusal()):
            return refusal
        scope = f" in its first {max(1, round(read / 2 ** 20))} MiB (the job counts them all)"
        text = tally.note("" if whole else scope)
    if text and note:
        note(f"note: {key}: {text}")
    return None


def folder_note(path: Path) -> Optional[str]:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest_note(manifest) if isinstance(manifest, dict) else None
