"""GPU sampling inside a job: one daemon thread per node (local rank 0) appends to gpu.jsonl.

    with GpuMonitor(ctx.run_dir, ctx.local_rank, spec.monitor.interval_s):
        train_loop(...)

Each sample is one JSON line per GPU: {time, node, gpu, util, mem_used, mem_total, temp, power, sm_clock}.
A sample is a handful of NVML queries (tens of microseconds each; ctypes drops the GIL while the
driver answers), every few seconds, off the training thread: far below 1% of step time
(benchmarks/monitor_overhead.py measures it). Without NVML it does nothing and says so once; a
failing sample or a full disk stops the sampler, never the job.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Sequence

from hpcgpu.contract import ENV_NODE_GPUS
from hpcgpu.gpu.busy import select
from hpcgpu.gpu.estimate import GiB
from hpcgpu.gpu.readings import GpuReading, GpuSource
from hpcgpu.gpu.source import default_source

log = logging.getLogger("hpcgpu")


@dataclass
class GpuSummary:
    gpu: int
    samples: int = 0
    util_sum: float = 0.0
    util_peak: float = 0.0
    mem_peak: int = 0
    mem_total: int = 0
    power_sum: float = 0.0
    power_peak: float = 0.0
    temp_peak: float = 0.0

    def add(self, r: GpuReading) -> None:
        self.samples += 1
        self.util_sum += r.utilization or 0.0
        self.util_peak = max(self.util_peak, r.utilization or 0.0)
        self.mem_peak, self.mem_total = max(self.mem_peak, r.memory_used), r.memory_total
        self.power_sum += r.power_draw or 0.0
        self.power_peak = max(self.power_peak, r.power_draw or 0.0)
        self.temp_peak = max(self.temp_peak, r.temperature or 0.0)

    @property
    def util_mean(self) -> float:
        return self.util_sum / self.samples if self.samples else 0.0

    @property
    def power_mean(self) -> float:
        return self.power_sum / self.samples if self.samples else 0.0

    def line(self) -> str:
        return (f"gpu {self.gpu}: util mean {self.util_mean:.0f}% peak {self.util_peak:.0f}% | memory peak "
                f"{self.mem_peak / GiB:.1f}/{self.mem_total / GiB:.1f} GiB | power mean {self.power_mean:.0f} W "
                f"peak {self.power_peak:.0f} W | temp peak {self.temp_peak:.0f} C | {self.samples} samples")


def record(r: GpuReading, node: int, now: float) -> dict:
    return {"time": round(now, 3), "node": node, "gpu": r.index, "util": r.utilization, "mem_used": r.memory_used,
            "mem_total": r.memory_total, "temp": r.temperature, "power": r.power_draw, "sm_clock": r.sm_clock}


def gpu_file(run_dir: Path, node: int) -> Path:
    """Node 0 writes gpu.jsonl, node N gpu-node{N}.jsonl: no two nodes append to one file on NFS."""
    return Path(run_dir) / ("gpu.jsonl" if node == 0 else f"gpu-node{node}.jsonl")


class GpuMonitor:
    def __init__(self, run_dir: str | os.PathLike, local_rank: int = 0, interval_s: float = 5.0,
                 devices: Sequence[int | str] | str | None = None, *, enabled: bool = True,
                 node_rank: int | None = None, source: GpuSource | None = None,
                 on_sample: Callable[[list[dict[str, Any]]], None] | None = None):
        self.run_dir, self.interval_s = Path(run_dir), max(0.05, float(interval_s))
        self.active = enabled and local_rank == 0
        self.devices: str | None = devices if devices is None or isinstance(devices, str) \
            else ",".join(map(str, devices))
        self.node = int(os.environ.get("SLURM_NODEID", "0") or 0) if node_rank is None else node_rank
        self._source = source
        # each sample's records (as in gpu.jsonl), called from the sampler thread (rank 0's trackers)
        self.on_sample = on_sample
        self._indices: list[int] = []
        self._fh: IO[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.summaries: dict[int, GpuSummary] = {}

    def __enter__(self) -> "GpuMonitor":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if not self.active:
            return
        try:
            source = self._source or default_source()
            if not source.available():
                log.info("gpu monitor: no NVIDIA driver (NVML) here; gpu.jsonl is not written")
                return
            # a task bound to its group of GPUs still watches the node's (HPCGPU_NODE_GPUS)
            visible = os.environ.get(ENV_NODE_GPUS, os.environ.get("CUDA_VISIBLE_DEVICES"))
            chosen, _ = select(source.read(processes=False), self.devices, visible)
            self._indices = [r.index for r in chosen]
            if not self._indices:
                log.info("gpu monitor: no GPU visible to this job; gpu.jsonl is not written")
                return
            self._source = source
            self._fh = open(gpu_file(self.run_dir, self.node), "a", buffering=1)
        except Exception as exc:  # monitoring must never break the job
            log.warning(f"gpu monitor: not started: {exc}")
            return
        self._thread = threading.Thread(target=self._run, name="hpcgpu-gpu-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._sample() and not self._stop.wait(self.interval_s):
            pass

    def _sample(self) -> bool:
        """One line per GPU; False stops the sampler (the reason is logged once)."""
        try:
            now = time.time()
            records = []
            for r in self._source.read(self._indices, processes=False):  # type: ignore[union-attr]
                self.summaries.setdefault(r.index, GpuSummary(r.index)).add(r)
                records.append(record(r, self.node, now))
            if self._fh is not None and records:
                self._fh.write("\n".join(map(json.dumps, records)) + "\n")
        except Exception as exc:
            log.warning(f"gpu monitor: sampling stopped: {exc}")
            return False
        self._notify(records)
        return True

    def _notify(self, records: list[dict[str, Any]]) -> None:
        """Hand a sample to on_sample; one that fails is not called again (gpu.jsonl goes on)."""
        if self.on_sample is None or not records:
            return
        try:
            self.on_sample(records)
        except Exception as exc:
            log.warning(f"gpu monitor: on_sample failed ({exc}); samples go to gpu.jsonl only")
            self.on_sample = None

    def stop(self) -> dict[int, GpuSummary]:
        """Stop sampling, take a last sample, log and return the per-GPU summary (mean and peak)."""
        if self._thread is None:
            return self.summaries
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 10)
        self._thread = None
        self._sample()  # the end state too: a run shorter than one interval still has two samples
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for s in self.summaries.values():
            log.info(f"gpu monitor: {s.line()}")
        return self.summaries
