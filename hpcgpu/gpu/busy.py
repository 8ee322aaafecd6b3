"""Which GPUs this job may use, and which of them someone else is using already."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from hpcgpu.gpu.readings import GpuReading
from hpcgpu.gpu.source import default_source


@dataclass(frozen=True)
class BusyThresholds:
    """Defaults: a shared node's idle GPU shows <1% memory (the driver's reserve) and 0% utilization."""

    memory_pct: float = 10.0
    util_pct: float = 10.0
    processes: bool = True  # any compute process counts, even one holding little memory yet

    @classmethod
    def from_spec(cls, busy: Any) -> "BusyThresholds":
        """From a spec's resources.busy section."""
        return cls(float(busy.memory_pct), float(busy.util_pct), bool(busy.processes))


def busy_reasons(r: GpuReading, th: BusyThresholds = BusyThresholds()) -> list[str]:
    """Why a GPU counts as busy; empty when it is free."""
    reasons = []
    if r.memory_used_pct > th.memory_pct:
        reasons.append(f"memory {r.memory_used_pct:.0f}% used")
    if r.utilization is not None and r.utilization > th.util_pct:
        reasons.append(f"utilization {r.utilization:.0f}%")
    if th.processes and r.processes:
        reasons.append(f"{len(r.processes)} compute process(es)")
    return reasons


def is_busy(r: GpuReading, th: BusyThresholds = BusyThresholds()) -> bool:
    return bool(busy_reasons(r, th))


def free_gpus(readings: Sequence[GpuReading], th: BusyThresholds = BusyThresholds()) -> list[int]:
    return [r.index for r in readings if not is_busy(r, th)]


def _match(entry: str, readings: Sequence[GpuReading]) -> GpuReading | None:
    entry = entry.strip()
    if entry.isdigit():
        return next((r for r in readings if r.index == int(entry)), None)
    if entry.startswith("GPU-"):  # CUDA accepts any unique prefix of the UUID
        hits = [r for r in readings if r.uuid.startswith(entry)]
        return hits[0] if len(hits) == 1 else None
    return None  # MIG-... instances are not GPUs NVML indexes this way


def select(readings: Sequence[GpuReading], devices: str | None = None, cuda_visible: str | None = None
           ) -> tuple[list[GpuReading], str]:
    """The GPUs a job here would use, in its order, and a word on why.

    Same precedence as the local executor: resources.devices, else CUDA_VISIBLE_DEVICES, else all.
    As CUDA does, an entry that names no GPU ends the list.
    """
    if devices:
        source, entries = f"resources.devices={devices}", devices.split(",")
    elif cuda_visible is not None:
        source, entries = f"CUDA_VISIBLE_DEVICES={cuda_visible!r}", [e for e in cuda_visible.split(",") if e.strip()]
    else:
        return list(readings), "all GPUs"
    chosen: list[GpuReading] = []
    for entry in entries:
        r = _match(entry, readings)
        if r is None:
            source += f" (no GPU {entry.strip()!r} here: the list ends before it)"
            break
        if r not in chosen:
            chosen.append(r)
    return chosen, source


def busy_warnings(chosen: Sequence[GpuReading], th: BusyThresholds = BusyThresholds()) -> list[str]:
    """One line per chosen GPU that someone else is using."""
    return [f"GPU {r.index} ({r.name}) is busy: {', '.join(busy_reasons(r, th))}" for r in chosen if is_busy(r, th)]


GiB = 1 << 30


def usage_text(r: GpuReading) -> str:
    """What is on a GPU: '62.0 of 79.6 GiB used; processes: pid 412233 python (61.5 GiB)'."""
    text = f"{r.memory_used / GiB:.1f} of {r.memory_total / GiB:.1f} GiB used"
    if not r.processes:
        return text + "; no compute process listed"
    procs = ", ".join(f"pid {p.pid} {p.name or '?'}" + (f" ({p.used_bytes / GiB:.1f} GiB)" if p.used_bytes else "")
                      for p in r.processes)
    return f"{text}; processes: {procs}"


def busy_detail(r: GpuReading, th: BusyThresholds = BusyThresholds()) -> str:
    """One line about a busy GPU: why it counts as busy, its memory and its processes."""
    return f"GPU {r.index} ({r.name}) is busy: {', '.join(busy_reasons(r, th))}; {usage_text(r)}"


def strictest(thresholds: Sequence[BusyThresholds]) -> BusyThresholds:
    """The thresholds under which a GPU that any of them calls busy is busy (defaults for none)."""
    if not thresholds:
        return BusyThresholds()
    return BusyThresholds(min(t.memory_pct for t in thresholds), min(t.util_pct for t in thresholds),
                          any(t.processes for t in thresholds))


def smallest_gpu(devices: str | None, cuda_visible: str | None, count: int | None = None) -> tuple[int | None, str]:
    """The smallest total memory among the GPUs a job here would use (the first `count` of them), and
    what that GPU is; (None, why) without one."""
    source = default_source()
    if not source.available():
        return None, "no GPU detected here"
    chosen, _ = select(source.read(processes=False), devices, cuda_visible)
    chosen = chosen[:count] if count is not None else chosen
    if not chosen:
        return None, "no GPU visible here"
    smallest = min(chosen, key=lambda r: r.memory_total)
    return smallest.memory_total, f"{smallest.name}, detected"
