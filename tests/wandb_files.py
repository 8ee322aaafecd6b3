"""Reading W&B's offline run files (`.wandb`) in tests of the trackers (tests/unit, tests/slurm)."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def wandb_records(path: Path) -> list[Any]:
    """The records of a .wandb file: wandb's LevelDB-style log (a 7-byte header, 32 KiB blocks of
    chunks with a 7-byte header each), the format wandb-core writes and `wandb sync` reads. wandb
    0.31 has no Python reader for it, so this is that reader, over wandb's own protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if left < 7 or kind == 0:  # the rest of a block is padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_history(path: Path) -> list[dict[str, Any]]:
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def wandb_config(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        items = record.config.update if kind == "config" else record.run.config.update if kind == "run" else []
        out.update({item.key: json.loads(item.value_json) for item in items})
    return out
