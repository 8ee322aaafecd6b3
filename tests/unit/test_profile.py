"""train.profile's StepProfiler in-process on the CPU (a window cut short, a window a resume passed),
and its summary's CUDA figures from made-up device events (no GPU here)."""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpcgpu.runtime.profile import DeviceEvent, StepProfiler, device_times, summarize
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


A, B = "device 0 stream 7", "device 0 stream 20"
EVENTS = [  # one 10 ms step: stream 7 computes 0-5 ms (two kernels overlapping) and copies 6-7 ms, NCCL on 20
    DeviceEvent(A, 0.0, 4000.0, "ampere_sgemm_128x64_tn", "kernel"),
    DeviceEvent(A, 3000.0, 2000.0, "triton_poi_fused_add_0", "kernel"),
    DeviceEvent(A, 6000.0, 1000.0, "Memcpy DtoD (Device -> Device)", "gpu_memcpy"),
    DeviceEvent(B, 0.0, 2000.0, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel"),
    DeviceEvent(A, 0.0, 9000.0, "ProfilerStep#5", "gpu_user_annotation"),  # spans the kernels: not work
    DeviceEvent(A, 0.0, 7000.0, "DistributedDataParallel.forward", "gpu_user_annotation"),
]


def test_device_times_count_work_once_and_not_annotations() -> None:
    t = device_times(EVENTS, wall_s=0.010)
    assert (t.total_us, t.nccl_us, t.compute_us) == (9000.0, 2000.0, 7000.0)
    assert t.stream == A and t.busy_us == 6000.0 and t.busy == 0.6 and t.idle_us == 4000.0


def test_gpu_busy_is_at_most_the_wall_time() -> None:
    t = device_times(EVENTS, wall_s=0.004)  # the kernels outlast a (mis)measured wall
    assert t.busy == 1.0 and t.idle_us == 0.0
    assert device_times([], wall_s=0.004).stream is None


def fake_profile(old_torch: bool) -> SimpleNamespace:
    """EVENTS as torch.profiler's FunctionEvents, over 2 steps of 5 ms, plus a CPU op whose CUDA time is its
    kernels'. Old torch: no activity_type, annotations known by is_user_annotation alone."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name=e.name, device_type=cuda, device_index=0, device_resource_id=int(e.stream[16:]),
                              is_user_annotation=e.kind == "gpu_user_annotation",
                              time_range=SimpleNamespace(start=e.start_us, elapsed_us=lambda d=e.dur_us: d),
                              **({} if old_torch else {"activity_type": e.kind})) for e in EVENTS]
    events.append(SimpleNamespace(name="aten::mm", device_type=cpu, device_time_total=6000.0))
    first_average = SimpleNamespace(**({} if old_torch else {"self_device_time_total": 1.0}))
    return SimpleNamespace(events=lambda: events, key_averages=lambda: Averages([first_average]))


@pytest.mark.parametrize("old_torch", [False, True], ids=["activity_type", "no_activity_type"])
def test_the_cuda_summary_splits_nccl_from_compute_and_shows_idle(old_torch: bool) -> None:
    text = summarize(fake_profile(old_torch), steps=2, wall_s=0.010, device_type="cuda")
    assert "window: 2 step(s), 5.0 ms/step wall" in text
    assert "device time per step: all kernels 4.5 ms, NCCL 1.0 ms, compute 3.5 ms (" in text
    assert "busiest stream (device 0 stream 7): GPU busy 3.0 ms/step (60.0% of wall), " \
           "GPU idle 2.0 ms/step (40.0% of wall)" in text
    key = "self_cuda_time_total" if old_torch else "self_device_time_total"
    assert f"<20 ops by {key}>" in text


def test_a_cuda_profile_without_device_events_says_so() -> None:
    prof = SimpleNamespace(events=lambda: [], key_averages=lambda: Averages([]))
    assert "device time per step: no kernels recorded" in summarize(prof, steps=2, wall_s=0.010, device_type="cuda")
