"""The rows of an inference input file, read and checked the same way on the host and in the job.

No torch, no transformers: `hpcgpu validate/submit` check an input before anything is queued, and
the job reads it with the same function. Formats:
  .jsonl  one JSON object a line: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}
          (mode generate), {"id": ..., "text": "..."} (mode score); "id" may be left out (the line
          number is used); blank lines are skipped
  .txt    one prompt (or text) a line; id = the line number
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcgpu.errors import HpcgpuError


@dataclass(frozen=True)
class Row:
    index: int  # position in the input (0-based, blank lines not counted): the order of outputs.jsonl
    id: Any  # as given (a string or a number), else the line number
    line: int  # 1-based line in the file, for error messages
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    text: str | None = None


def read_rows(path: str | Path, mode: str = "generate") -> list[Row]:
    """Every row of the input, in order; one HpcgpuError naming file:line for the first bad one."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise HpcgpuError(f"infer.input: file not found: {p}") from None
    except OSError as exc:
        raise HpcgpuError(f"infer.input: cannot read {p}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise HpcgpuError(f"{p}:{line}: not UTF-8 text") from None
    rows: list[Row] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = _jsonl_row(p, n, line, len(rows), mode) if p.suffix == ".jsonl" else _text_row(n, line, len(rows), mode)
        key = json.dumps(row.id)
        if key in seen:
            raise HpcgpuError(f"{p}:{n}: id {row.id!r} is repeated (first on line {seen[key]}); ids must be unique")
        seen[key] = n
        rows.append(row)
    if not rows:
        raise HpcgpuError(f"infer.input: {p} has no rows")
    return rows


def _text_row(n: int, line: str, index: int, mode: str) -> Row:
    value = line.rstrip("\r")
    return Row(index, n, n, text=value) if mode == "score" else Row(index, n, n, prompt=value)


def _jsonl_row(p: Path, n: int, line: str, index: int, mode: str) -> Row:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise HpcgpuError(f"{p}:{n}: not a JSON object ({exc.msg.removesuffix(' at')} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise HpcgpuError(f"{p}:{n}: expected a JSON object, got {type(obj).__name__}")
    row_id = obj.get("id", n)
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        raise HpcgpuError(f"{p}:{n}: \"id\" must be a string or an integer")
    if mode == "score":
        if not isinstance(obj.get("text"), str):
            raise HpcgpuError(f"{p}:{n}: mode score needs a \"text\" field (a string)")
        return Row(index, row_id, n, text=obj["text"])
    if "prompt" in obj and "messages" in obj:  # which one the row means is not for us to guess
        raise HpcgpuError(f"{p}:{n}: has both \"prompt\" and \"messages\"; keep the one the row means")
    if isinstance(obj.get("prompt"), str):
        return Row(index, row_id, n, prompt=obj["prompt"])
    messages = obj.get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return Row(index, row_id, n, messages=messages)
    raise HpcgpuError(f"{p}:{n}: expected a \"prompt\" (a string) or \"messages\" "
                      "(a list of {\"role\", \"content\"})")


def rows_fit_problem(rows: list[Row], lengths: list[int], limit: int | None, mode: str, max_new_tokens: int,
                     source: str) -> str | None:
    """The longest row if it does not fit the model's `limit` positions (max_position_embeddings): one
    line naming it, the same at validate (hpcgpu/launch/checks.py) and in the job."""
    if not lengths or not isinstance(limit, int) or limit <= 0:
        return None
    extra = max_new_tokens if mode == "generate" else 0
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    if lengths[longest] + extra <= limit:
        return None
    row = rows[longest]
    what = (f"its prompt is {lengths[longest]} tokens, + infer.max_new_tokens {extra}" if extra
            else f"its text is {lengths[longest]} tokens")
    return (f"{source}:{row.line}: row {json.dumps(row.id)} does not fit the model's {limit} positions "
            f"(max_position_embeddings): {what}; shorten it" + (" or lower infer.max_new_tokens" if extra else ""))
