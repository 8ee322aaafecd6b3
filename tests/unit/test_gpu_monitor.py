"""GpuMonitor on recorded readings (the real NVML path is in tests/gpu), and without NVML."""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from hpcgpu.gpu.monitor import GpuMonitor
from hpcgpu.gpu.nvml import NvmlSource
from hpcgpu.gpu.readings import RecordedSource

FIXTURES = Path(__file__).parent / "fixtures"


def recorded() -> RecordedSource:
    return RecordedSource.from_file(FIXTURES / "nvml_h100x8_shared.json")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def sampler() -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == "hpcgpu-gpu-monitor"), None)


class Counting(RecordedSource):
    """Recorded readings that say when the sampler has read `n` times (the selection read is one)."""

    def __init__(self, n: int) -> None:
        super().__init__(recorded().readings)
        self.calls, self.n, self.reached = 0, n, threading.Event()

    def read(self, indices=None, processes=True):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls >= self.n:
            self.reached.set()
        return super().read(indices, processes)


def test_samples_the_visible_gpus_to_gpu_jsonl(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    caplog.set_level(logging.INFO, logger="hpcgpu")
    source = Counting(1 + 3)  # the selection read, then 3 samples: the first at start, then every 50 ms
    with GpuMonitor(tmp_path, local_rank=0, interval_s=0.05, source=source, node_rank=0) as mon:
        assert source.reached.wait(30), "the sampler did not take 3 samples"
    recs = lines(tmp_path / "gpu.jsonl")
    assert {r["gpu"] for r in recs} == {0, 1}
    assert set(recs[0]) == {"time", "node", "gpu", "util", "mem_used", "mem_total", "temp", "power", "sm_clock"}
    assert len(recs) >= 2 * 4  # those 3 samples and one at stop, of 2 GPUs each
    times = sorted({r["time"] for r in recs})
    assert all(b - a >= 0.04 for a, b in zip(times[:-2], times[1:-1]))  # the sampler's own ones: 50 ms apart
    assert recs[0]["util"] == 98.0 and recs[0]["power"] == 641.5 and recs[0]["sm_clock"] == 1980
    s = mon.summaries[0]
    assert s.samples == len(recs) // 2 and s.util_mean == 98.0 and s.power_peak == 641.5
    assert s.mem_peak == recs[0]["mem_used"]
    assert "gpu monitor: gpu 0: util mean 98% peak 98% | memory peak 62.0/79.6 GiB" in caplog.text
    assert not any(t.name == "hpcgpu-gpu-monitor" for t in threading.enumerate())


def test_devices_argument_and_other_nodes_file(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with GpuMonitor(tmp_path, 0, 0.05, devices=[4, 7], source=recorded(), node_rank=2):
        pass  # stop() takes a last sample: there is always one
    assert not (tmp_path / "gpu.jsonl").exists()  # node 2 writes its own file: no two nodes share one
    recs = lines(tmp_path / "gpu-node2.jsonl")
    assert {r["gpu"] for r in recs} == {4, 7} and {r["node"] for r in recs} == {2}


def test_only_local_rank_zero_samples(tmp_path):
    with GpuMonitor(tmp_path, local_rank=1, interval_s=0.05, source=recorded()) as mon:
        assert sampler() is None  # no sampler thread: nothing can write later
    assert not list(tmp_path.iterdir()) and mon.stop() == {}


def test_disabled(tmp_path):
    with GpuMonitor(tmp_path, 0, 0.05, enabled=False, source=recorded()):
        pass
    assert not list(tmp_path.iterdir())


def test_no_nvml_does_nothing_and_says_so_once(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("HPCGPU_NVML_RECORDED", raising=False)
    if NvmlSource().available():
        pytest.skip("this machine has an NVIDIA driver")
    caplog.set_level(logging.INFO, logger="hpcgpu")
    with GpuMonitor(tmp_path, 0, 0.05) as mon:  # the real pynvml path: nvmlInit fails here
        assert sampler() is None  # start() gave up at once: no thread that could write later
    assert mon.stop() == {} and not list(tmp_path.iterdir())
    assert caplog.text.count("no NVIDIA driver (NVML) here") == 1


class Failing(RecordedSource):
    def __init__(self) -> None:
        super().__init__(recorded().readings)
        self.calls = 0

    def read(self, indices=None, processes=True):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls > 3:  # the selection read, two samples, then the driver goes away
            raise RuntimeError("NVML: GPU is lost")
        return super().read(indices, processes)


def test_a_failing_sample_stops_the_sampler_not_the_job(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with GpuMonitor(tmp_path, 0, 0.02, source=Failing()) as mon:
        thread = sampler()
        assert thread is not None
        thread.join(timeout=30)  # the sampler ends by itself on the failing read
        assert not thread.is_alive(), "the sampler did not stop on the failing read"
    assert "sampling stopped: NVML: GPU is lost" in caplog.text
    assert mon.summaries[0].samples == 2


def test_an_unwritable_run_dir_does_not_raise(tmp_path, caplog):
    with GpuMonitor(tmp_path / "missing" / "dir", 0, 0.05, source=recorded()):
        pass
    assert "gpu monitor: not started" in caplog.text
