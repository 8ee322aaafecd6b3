"""train.profile: torch.profiler over a window of optimizer steps, one trace and one summary per rank.

Steps before the window cost nothing: the profiler is made only after the step before its warm-up.
The warm-up step (the one before the window, where the run reaches it) absorbs the profiler's own
start-up (CUPTI), so the window's times are the steps'. benchmarks/loop_minimal.py uses the same
class through StepProfiler.for_dir, so a plain loop and hpcgpu are profiled alike.
"""
from __future__ import annotations

import logging
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hpcgpu.spec.schema import Profile

log = logging.getLogger("hpcgpu")

TOP_OPS = 20


class StepProfiler:
    """after_step(step) after every optimizer step (the counter, 1-based), close() when the loop ends.

    first_step: the counter when the loop starts (the resume step, 0 for a fresh run); max_steps: the
    run's last step, where known. A config of None does nothing."""

    def __init__(self, config: Profile | None, out_dir: Path, rank: int, device: torch.device, *,
                 first_step: int = 0, max_steps: int | None = None, label: str = "train.profile") -> None:
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self.first = config.start_step if config else 0
        last = self.first + config.steps - 1 if config else 0
        self.last = min(last, max_steps) if max_steps is not None else last
        self.pending = config is not None and self._window_reachable(label, last, first_step, max_steps)
        self.prof: Any = None
        self.t0: float | None = None  # the window's start; None while the warm-up step runs
        self.recorded = 0
        self._maybe_start(first_step)

    @classmethod
    def for_dir(cls, out_dir: Path, start_step: int, steps: int, rank: int, device: torch.device, *,
                max_steps: int | None = None) -> StepProfiler:
        """For a plain script: steps counted from 1, files written to out_dir."""
        if start_step < 1 or steps < 1:
            raise ValueError(f"profile start step {start_step} and steps {steps} must be >= 1")
        return cls(Profile(start_step, steps), out_dir, rank, device, max_steps=max_steps, label="profile")

    def _window_reachable(self, label: str, last: int, first_step: int, max_steps: int | None) -> bool:
        why = None
        if max_steps is not None and self.first > max_steps:
            why = f"lie beyond this run's {max_steps} steps"
        elif self.first <= first_step:
            why = f"lie before this start's first step {first_step + 1} (resumed at step {first_step})"
        if why and self.rank == 0:
            log.warning(f"{label}: steps {self.first}-{last} {why}; nothing is profiled")
        return why is None

    def _maybe_start(self, step: int) -> None:
        """Start after step first-2 (one warm-up step), or after first-1 where the run starts there."""
        if not self.pending or step not in (self.first - 2, self.first - 1):
            return
        import torch.profiler as tp

        warmup = 1 if step == self.first - 2 else 0
        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.pending = False
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")  # no step before the window
            schedule = tp.schedule(wait=0, warmup=warmup, active=self.last - self.first + 1, repeat=1)
        self._sync()
        self.prof = tp.profile(activities=activities, schedule=schedule, record_shapes=False, with_stack=False)
        self.prof.start()
        if not warmup:
            self.t0 = time.perf_counter()

    def after_step(self, step: int) -> None:
        if self.prof is None:
            self._maybe_start(step)
        elif self.t0 is None:  # the warm-up step is done: the window starts
            self._sync()
            self.prof.step()
            self.t0 = time.perf_counter()
        else:
            self.recorded += 1
            if step >= self.last:
                self._finish()
            else:
                self.prof.step()

    def close(self) -> None:
        """The loop ended: a window cut short is written as far as it got. Never raises: it runs in the
        loop's `finally`, where an error would hide the one that ended the loop."""
        if self.prof is None:
            return
        try:
            if self.recorded:
                self._finish()
            else:
                self.prof.stop()
        except Exception as exc:  # a profile never stops the job
            log.warning(f"rank {self.rank}: the profile could not be written: {exc}")
        self.prof = None

    def _finish(self) -> None:
        self._sync()
        wall_s = time.perf_counter() - (self.t0 or 0.0)
        prof, self.prof = self.prof, None
        prof.stop()
        window = f"{self.first}-{self.first + self.recorded - 1}"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}.trace.json"))
        header = f"profile of steps {window} on rank {self.rank} ({self.device}, torch {torch.__version__})\n"
        text = self.out_dir / f"rank{self.rank}.txt"
        t = device_times(device_events(prof), wall_s) if self.device.type == "cuda" else None
        text.write_text(header + summarize(prof, self.recorded, wall_s, self.device.type, t))
        if self.rank == 0:
            log.info(f"profile of steps {window}: {text}, {wall_s * 1000 / self.recorded:.1f} ms/step"
                     + (f", GPU busy {t.busy:.0%}" if t is not None else ""))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})  # the trace's categories that are device work


class DeviceEvent(NamedTuple):
    """One device-side event of the trace, as plain data."""

    stream: str  # "device D stream S"
    start_us: float
    dur_us: float
    name: str
    kind: str  # the trace's category: kernel, gpu_memcpy, gpu_memset, gpu_user_annotation, ...


@dataclass(frozen=True)
class DeviceTimes:
    """Microseconds over the window: device work (kernels, copies, memsets; not annotations), NCCL's part,
    and the time the busiest stream (the one with the most work) had work, overlaps counted once, at
    most the wall time."""

    total_us: float
    nccl_us: float
    busy_us: float
    stream: str | None
    wall_us: float

    @property
    def compute_us(self) -> float:
        return self.total_us - self.nccl_us

    @property
    def busy(self) -> float:
        """The busiest stream's share of the wall time."""
        return self.busy_us / self.wall_us if self.wall_us > 0 else 0.0

    @property
    def idle_us(self) -> float:
        """Wall time the busiest stream had nothing to run: the host (or a wait) held the step up."""
        return max(0.0, self.wall_us - self.busy_us)


def device_times(events: Iterable[DeviceEvent], wall_s: float) -> DeviceTimes:
    total = nccl = 0.0
    streams: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.kind not in DEVICE_WORK:
            continue
        total += e.dur_us
        if "nccl" in e.name.lower():
            nccl += e.dur_us
        streams[e.stream].append((e.start_us, e.start_us + e.dur_us))
    stream = max(streams, key=lambda s: sum(end - start for start, end in streams[s]), default=None)
    wall_us = wall_s * 1e6
    return DeviceTimes(total, nccl, min(wall_us, _union_us(streams.get(stream, []))), stream, wall_us)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy


def device_events(prof: Any) -> list[DeviceEvent]:
    """The profile's device-side events. Torch before 2.6 or so has no activity_type: there, device
    events that are not user annotations are work."""
    out = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) in (None, torch.autograd.DeviceType.CPU):
            continue
        kind = getattr(evt, "activity_type", None) or (
            "gpu_user_annotation" if getattr(evt, "is_user_annotation", False) else "kernel")
        stream = f"device {evt.device_index} stream {getattr(evt, 'device_resource_id', 0)}"
        out.append(DeviceEvent(stream, evt.time_range.start, evt.time_range.elapsed_us(), evt.name, kind))
    return out


def summarize(prof: Any, steps: int, wall_s: float, device_type: str, times: DeviceTimes | None = None) -> str:
    """The window's wall time per step, on CUDA its device time per step (all, NCCL, compute), the
    busiest stream's busy and idle time, and the top ops by self device (CUDA) or CPU time. `times`:
    the window's device times where the caller has them already."""
    ms = wall_s * 1000 / max(1, steps)
    lines = [f"window: {steps} step(s), {ms:.1f} ms/step wall"]
    averages = prof.key_averages()
    sort_by = "self_cpu_time_total"
    if device_type == "cuda":
        t = times if times is not None else device_times(device_events(prof), wall_s)
        per = 1000 * max(1, steps)
        if t.stream is None:
            lines.append("device time per step: no kernels recorded")
        else:
            lines.append(f"device time per step: all kernels {t.total_us / per:.1f} ms, NCCL {t.nccl_us / per:.1f} ms, "
                         f"compute {t.compute_us / per:.1f} ms (kernels, copies, memsets; annotations excluded)")
            lines.append(f"busiest stream ({t.stream}): GPU busy {t.busy_us / per:.1f} ms/step ({t.busy:.1%} of wall), "
                         f"GPU idle {t.idle_us / per:.1f} ms/step ({1 - t.busy:.1%} of wall)")
        sort_by = _device_sort_key(averages)
    lines.append(f"top {TOP_OPS} ops by {sort_by}:")
    lines.append(averages.table(sort_by=sort_by, row_limit=TOP_OPS))
    return "\n".join(lines) + "\n"


def _device_sort_key(averages: Any) -> str:
    """self_device_time_total where the events have it; torch before 2.4 calls it self_cuda_time_total."""
    return "self_device_time_total" if averages and hasattr(averages[0], "self_device_time_total") \
        else "self_cuda_time_total"
