"""train.profile's StepProfiler in-process on the CPU (a window cut short, a window a resume passed),
and its summary's CUDA figures from made-up events (no GPU here)."""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpcgpu.runtime.profile import StepProfiler, summarize
from hpcgpu.spec.schema import Profile


def train_a_little(out: Path, first_step: int, last_step: int) -> None:
    """Steps first_step+1..last_step of a linear layer under a profiler of steps 3-5, then close()."""
    model = torch.nn.Linear(8, 8)
    prof = StepProfiler(Profile(start_step=3, steps=3), out, 0, torch.device("cpu"), first_step=first_step,
                        max_steps=10)
    for step in range(first_step + 1, last_step + 1):
        model(torch.randn(4, 8)).sum().backward()
        prof.after_step(step)
    prof.close()


def test_a_window_cut_short_is_written_as_far_as_it_got(tmp_path: Path) -> None:
    train_a_little(tmp_path / "cut", 0, 4)  # stopped (preempted, early stopping) after step 4 of 3-5
    summary = (tmp_path / "cut" / "rank0.txt").read_text()
    assert summary.startswith("profile of steps 3-4 on rank 0 (cpu") and "window: 2 step(s)" in summary
    assert "aten::" in summary and (tmp_path / "cut" / "rank0.trace.json").stat().st_size > 0


def test_a_window_before_the_resume_step_is_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hpcgpu"):
        train_a_little(tmp_path / "late", 3, 6)
    assert not (tmp_path / "late").exists()
    warned = [r.getMessage() for r in caplog.records if r.name == "hpcgpu"]
    assert warned == ["train.profile: steps 3-5 lie before this start's first step 4 (resumed at step 3); "
                      "nothing is profiled"]


class Averages(list):
    def table(self, sort_by: str, row_limit: int) -> str:
        return f"<{row_limit} ops by {sort_by}>"


def fake_profile(old_torch: bool) -> SimpleNamespace:
    """2 steps: 6 ms of compute kernels, 2 ms of NCCL, and a CPU op that is no device time."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    attr = "cuda_time_total" if old_torch else "device_time_total"
    events = [SimpleNamespace(name=name, device_type=kind, **{attr: us}) for name, kind, us in (
        ("ampere_sgemm_128x64_tn", cuda, 5000.0), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", cuda, 2000.0),
        ("Memcpy DtoD (Device -> Device)", cuda, 1000.0), ("aten::mm", cpu, 9999.0))]
    first_average = SimpleNamespace(**({} if old_torch else {"self_device_time_total": 1.0}))
    return SimpleNamespace(events=lambda: events, key_averages=lambda: Averages([first_average]))


@pytest.mark.parametrize("old_torch", [False, True], ids=["device_time", "cuda_time"])
def test_the_cuda_summary_splits_nccl_from_compute(old_torch: bool) -> None:
    text = summarize(fake_profile(old_torch), steps=2, wall_s=0.010, device_type="cuda")
    assert "window: 2 step(s), 5.0 ms/step wall" in text
    assert "all kernels 4.0 ms, NCCL 1.0 ms, compute 3.0 ms; GPU busy 60.0%" in text
    key = "self_cuda_time_total" if old_torch else "self_device_time_total"
    assert f"<20 ops by {key}>" in text
