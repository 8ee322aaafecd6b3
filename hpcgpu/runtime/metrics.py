"""metrics.jsonl: one JSON object per logged step, written by rank 0, flushed line by line.

Every record also goes to the job's trackers (runtime/track.py: TensorBoard, W&B), which pick the
kinds they mirror, so the call sites write once."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcgpu.runtime.track import Tracking


class MetricsWriter:
    def __init__(self, path: Path, enabled: bool = True, tracking: "Tracking | None" = None):
        self.path = path
        self.enabled = enabled
        self.tracking = tracking
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
        if self.tracking is not None:
            self.tracking.record(kind, fields)  # the raw numbers: a NaN loss stays a number there

    def close_trackers(self) -> None:
        """Flush and close TensorBoard and W&B now (close() again is harmless): before a requeue,
        whose SIGTERM to every process of the job would end W&B's helper with the run unwritten."""
        if self.tracking is not None:
            self.tracking.close()

    def close(self) -> None:
        if self._fh:
            self._fh.close()
            self._fh = None
        if self.tracking is not None:
            self.tracking.close()  # after the GPU monitor stopped: its last sample is in


def _clean(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return v
