"""metrics.jsonl: one JSON object per logged step, written by rank 0, flushed line by line."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, path: Path, enabled: bool = True):
        self.path = path
        self.enabled = enabled
        self._fh = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a", buffering=1)

    def write(self, kind: str, **fields: Any) -> None:
        if not self._fh:
            return
        record = {"kind": kind, "time": round(time.time(), 3)}
        record.update({k: _clean(v) for k, v in fields.items()})
        self._fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._fh:
            self._fh.close()
            self._fh = None


def _clean(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return v

