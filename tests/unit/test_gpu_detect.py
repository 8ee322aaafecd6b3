"""Readings and busy detection against recorded NVML readings (tests/unit/fixtures/nvml_*.json)."""
from __future__ import annotations

from pathlib import Path

import pytest

from hpcgpu.gpu.busy import BusyThresholds, busy_reasons, busy_warnings, free_gpus, is_busy, select
from hpcgpu.gpu.nvml import NvmlSource
from hpcgpu.gpu.readings import GpuReading, RecordedSource
from hpcgpu.gpu.source import default_source
from hpcgpu.spec.schema import Busy

FIXTURES = Path(__file__).parent / "fixtures"
H100 = FIXTURES / "nvml_h100x8_shared.json"
A100 = FIXTURES / "nvml_a100x4.json"
REAL = FIXTURES / "nvml_h100_real.json"


@pytest.fixture
def h100() -> list[GpuReading]:
    return RecordedSource.from_file(H100).read()


def test_recorded_readings_round_trip(h100):
    assert len(h100) == 8 and h100[0].name == "NVIDIA H100 80GB HBM3"
    assert h100[0].compute_capability == (9, 0) and h100[0].power_limit == 700.0
    assert h100[0].processes[0].pid == 412233 and h100[0].processes[0].used_bytes == 61.5 * 2**30
    for r in h100:
        assert GpuReading.from_dict(r.to_dict()) == r
        assert r.memory_used + r.memory_free == r.memory_total


def test_real_h100_recording_reads_as_idle():
    (gpu,) = RecordedSource.from_file(REAL).read()
    assert gpu.name == "NVIDIA H100 80GB HBM3" and gpu.memory_total == 85520809984
    assert not is_busy(gpu)  # the driver's 0.5 GiB reserve on an idle GPU is not "busy"


def test_recorded_source_subsets_and_skips_processes(h100):
    src = RecordedSource.from_file(H100)
    got = src.read([1, 4], processes=False)
    assert [r.index for r in got] == [1, 4] and all(r.processes == () for r in got)


def test_default_thresholds_on_a_shared_node(h100):
    assert [r.index for r in h100 if is_busy(r)] == [0, 1, 4, 7]
    assert free_gpus(h100) == [2, 3, 5, 6]
    assert busy_reasons(h100[0]) == ["memory 78% used", "utilization 98%", "1 compute process(es)"]
    assert busy_reasons(h100[4]) == ["1 compute process(es)"]  # a notebook's context, idle SMs
    assert busy_reasons(h100[7]) == ["utilization 37%"]  # another container's job: no pid visible


def test_user_thresholds(h100):
    lenient = BusyThresholds(memory_pct=90, util_pct=50, processes=False)
    assert [r.index for r in h100 if is_busy(r, lenient)] == [0, 1]  # only util 98% counts now
    strict = BusyThresholds(memory_pct=0.5, util_pct=0, processes=True)
    assert free_gpus(h100, strict) == []  # even the driver's reserve (0.6%) is too much


def test_thresholds_from_spec_section():
    th = BusyThresholds.from_spec(Busy(memory_pct=25, util_pct=5, processes=False))
    assert th == BusyThresholds(25.0, 5.0, False)


def test_a100_node():
    a100 = RecordedSource.from_file(A100).read()
    assert free_gpus(a100) == [0, 1, 3]
    assert a100[2].memory_used_pct > 95


def test_select_devices_wins_over_cuda_visible(h100):
    chosen, why = select(h100, devices="0,1,4,7", cuda_visible="2,3")
    assert [r.index for r in chosen] == [0, 1, 4, 7] and why == "resources.devices=0,1,4,7"
    assert busy_warnings(chosen)[0].startswith("GPU 0 (NVIDIA H100 80GB HBM3) is busy: memory 78% used")
    assert len(busy_warnings(chosen)) == 4


def test_select_cuda_visible_order_uuid_and_end(h100):
    chosen, _ = select(h100, cuda_visible="3,2")
    assert [r.index for r in chosen] == [3, 2]  # the job's cuda:0 is GPU 3
    chosen, _ = select(h100, cuda_visible="GPU-8a3d5c21,5")  # a unique UUID prefix, as CUDA accepts
    assert [r.index for r in chosen] == [2, 5]
    chosen, why = select(h100, cuda_visible="5,9,6")  # as CUDA does, an unknown entry ends the list
    assert [r.index for r in chosen] == [5] and "no GPU '9' here" in why
    assert select(h100, cuda_visible="")[0] == []  # CUDA_VISIBLE_DEVICES="" hides every GPU
    assert len(select(h100)[0]) == 8


def test_no_driver_here_is_not_an_error(monkeypatch):
    monkeypatch.delenv("HPCGPU_NVML_RECORDED", raising=False)
    src = NvmlSource()
    if src.available():
        pytest.skip("this machine has an NVIDIA driver")
    assert src.read() == [] and src.driver_version() is None
    assert isinstance(default_source(), NvmlSource)


def test_env_selects_recorded_source(monkeypatch):
    monkeypatch.setenv("HPCGPU_NVML_RECORDED", str(A100))
    src = default_source()
    assert src.available() and src.driver_version() == "535.183.06" and len(src.read()) == 4
