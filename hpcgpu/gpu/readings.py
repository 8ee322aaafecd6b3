"""What NVML tells about each GPU, as plain data, and where readings come from.

The logic above this layer (busy detection, recommendations, the monitor, `hpcgpu hw`) reads
`GpuReading`s from a `GpuSource`, never pynvml directly, so it runs on CPU machines against recorded
readings (JSON files of real H100/A100 machines under tests/unit/fixtures/). HPCGPU_NVML_RECORDED=FILE
makes every command of this process read that file instead of the driver (tests, demos). A recording
is one snapshot, or a timeline of snapshots that a source steps through one read at a time.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from hpcgpu.contract import ENV_NVML_RECORDED
from hpcgpu.errors import HpcgpuError

RECORDED_ENV = ENV_NVML_RECORDED


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None: NVML could not tell (MIG, some containers)
    name: str | None = None


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one moment. Optional fields are None where the GPU or driver does not report them."""

    index: int  # NVML (physical, PCI order) index
    name: str
    uuid: str
    memory_total: int  # bytes
    memory_used: int
    memory_free: int
    compute_capability: tuple[int, int] | None = None
    utilization: float | None = None  # % of the last sample period a kernel ran
    temperature: float | None = None  # deg C
    power_draw: float | None = None  # W
    power_limit: float | None = None  # W
    sm_clock: int | None = None  # MHz
    processes: tuple[GpuProcess, ...] = field(default_factory=tuple)

    @property
    def memory_used_pct(self) -> float:
        return 100.0 * self.memory_used / self.memory_total if self.memory_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["compute_capability"] = ".".join(map(str, self.compute_capability)) if self.compute_capability else None
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GpuReading":
        cc = d.get("compute_capability")
        if isinstance(cc, str):
            cc = tuple(int(x) for x in cc.split("."))
        procs = tuple(GpuProcess(int(p["pid"]), p.get("used_bytes"), p.get("name")) for p in d.get("processes", ()))
        known = {k: d[k] for k in ("utilization", "temperature", "power_draw", "power_limit", "sm_clock") if k in d}
        return cls(index=int(d["index"]), name=str(d["name"]), uuid=str(d.get("uuid", f"GPU-{d['index']}")),
                   memory_total=int(d["memory_total"]), memory_used=int(d["memory_used"]),
                   memory_free=int(d.get("memory_free", int(d["memory_total"]) - int(d["memory_used"]))),
                   compute_capability=tuple(cc) if cc else None, processes=procs, **known)  # type: ignore[arg-type]


class GpuSource(Protocol):
    """Where readings come from: the driver (NvmlSource) or a recording (RecordedSource)."""

    def available(self) -> bool:
        """False where there is no NVIDIA driver: a normal state, never an error."""
        ...

    def driver_version(self) -> str | None:
        ...

    def read(self, indices: Sequence[int] | None = None, processes: bool = True) -> list[GpuReading]:
        """Readings of the given NVML indices (all GPUs when None); processes=False is cheaper."""
        ...


class RecordedSource:
    """Readings from a recording, for tests and demos: one snapshot, {"driver": ..., "gpus": [reading, ...]},
    or a timeline, {"driver": ..., "timeline": [{"gpus": [...]}, {"gpus": [...]}, ...]}.

    A timeline advances by read count, not by clock: the k-th read() of a source gets snapshot k
    (counting from 0), and the last snapshot once the timeline is used up. So a test knows what the
    k-th look of a process sees however slowly the machine runs; each process (each source) starts
    at snapshot 0. available() and driver_version() do not advance it.
    """

    def __init__(self, readings: Sequence[GpuReading], driver: str | None = "recorded",
                 timeline: Sequence[Sequence[GpuReading]] = ()):
        self.timeline = [list(step) for step in timeline] or [list(readings)]
        self.readings = self.timeline[0]
        self.driver = driver
        self.reads = 0  # read() calls so far: the next one gets snapshot min(reads, last)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "RecordedSource":
        try:
            data = json.loads(Path(path).read_text())
            steps = [data] if "timeline" not in data else data["timeline"]
            if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
                raise ValueError('"timeline" must be a non-empty list of {"gpus": [...]} snapshots')
            timeline = [[GpuReading.from_dict(g) for g in step.get("gpus", [])] for step in steps]
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise HpcgpuError(f"{RECORDED_ENV}: cannot read recorded GPU readings from {path}: {exc}") from None
        return cls(timeline[0], data.get("driver", "recorded"), timeline)

    def available(self) -> bool:
        return any(self.timeline)

    def driver_version(self) -> str | None:
        return self.driver if self.available() else None

    def read(self, indices: Sequence[int] | None = None, processes: bool = True) -> list[GpuReading]:
        step = self.timeline[min(self.reads, len(self.timeline) - 1)]
        self.reads += 1
        chosen = [r for r in step if indices is None or r.index in indices]
        if not processes:
            chosen = [_without_processes(r) for r in chosen]
        return chosen


def _without_processes(r: GpuReading) -> GpuReading:
    from dataclasses import replace

    return replace(r, processes=())
