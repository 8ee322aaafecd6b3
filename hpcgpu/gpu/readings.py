"""What NVML tells about each GPU, as plain data, and where readings come from.

The logic above this layer (busy detection, recommendations, the monitor, `hpcgpu hw`) reads
`GpuReading`s from a `GpuSource`, never pynvml directly, so it runs on CPU machines against recorded
readings (JSON files of real H100/A100 machines under tests/unit/fixtures/). HPCGPU_NVML_RECORDED=FILE
makes every command of this process read that file instead of the driver (tests, demos).
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
    """Readings from a JSON file ({"driver": ..., "gpus": [reading, ...]}) or a list, for tests and demos."""

    def __init__(self, readings: Sequence[GpuReading], driver: str | None = "recorded"):
        self.readings = list(readings)
        self.driver = driver

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "RecordedSource":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise HpcgpuError(f"{RECORDED_ENV}: cannot read recorded GPU readings from {path}: {exc}") from None
        return cls([GpuReading.from_dict(g) for g in data.get("gpus", [])], data.get("driver", "recorded"))

    def available(self) -> bool:
        return bool(self.readings)

    def driver_version(self) -> str | None:
        return self.driver if self.readings else None

    def read(self, indices: Sequence[int] | None = None, processes: bool = True) -> list[GpuReading]:
        chosen = [r for r in self.readings if indices is None or r.index in indices]
        if not processes:
            chosen = [_without_processes(r) for r in chosen]
        return chosen


def _without_processes(r: GpuReading) -> GpuReading:
    from dataclasses import replace

    return replace(r, processes=())
