"""The run plan: decided once from (spec, real world size, device, GPU memory), recorded in plan.json
and in every checkpoint, reused on resume; a batch that does not divide over the real ranks, or a
recorded plan the new allocation cannot honour, is one clear error."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import TINY_GPT2, job_env, only_run_dir, submit, train_spec, write_spec_file
from resumes import assert_resumed
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.estimate import parse_size
from hpcgpu.runtime.plan import RunPlan, check_recorded, plan_train
from hpcgpu.spec import spec_from_raw


def tiny(gpus: int = 2, **train) -> dict:  # type: ignore[no-untyped-def]
    return train_spec("plan", resources={"gpus": gpus, "cpus_per_gpu": 1},
                      train={"micro_batch_size": "auto", "max_steps": 8, **train}, checkpoint={"every_steps": 4})


def cpu_plan(raw: dict, world: int, gpu_memory: int | None = None) -> RunPlan:
    return plan_train(spec_from_raw(raw), world, device_type="cpu", gpu_memory=gpu_memory, bf16_supported=False,
                      count_model=lambda: (None, TINY_GPT2))


# ---------------------------------------------------------------- the plan function

def test_cpu_plan_and_its_json_round_trip() -> None:
    plan = cpu_plan(tiny(), 2)
    t = plan.training
    assert (plan.world_size, plan.precision, plan.gpu_memory) == (2, "fp32", None)
    assert (t.global_batch, t.batch_per_rank, t.micro_batch, t.accum, t.strategy) == (8, 4, 4, 1, "ddp")
    assert (t.zero_stage, t.compile, t.loader_workers, t.tokens_per_step) == (None, False, 0, 8 * 64)
    assert "no GPU memory" in plan.reason
    assert RunPlan.from_json(plan.to_json()) == plan
    assert cpu_plan(tiny(gpus=1), 1).training.strategy == "none"  # one rank: no DDP wrapper


def test_a_global_batch_that_does_not_divide_over_the_real_ranks_is_one_error() -> None:
    with pytest.raises(HpcgpuError) as exc:
        cpu_plan(tiny(), 3)  # the spec asks for 2 ranks (8 / 2 is fine); the job has 3
    msg = str(exc.value)
    assert "\n" not in msg and "train.global_batch_size" in msg and "3 ranks" in msg and "8" in msg


def test_a_recorded_plan_the_job_cannot_honour_names_both() -> None:
    plan, src = cpu_plan(tiny(), 2), Path("run/plan.json")
    check_recorded(plan, src, spec_from_raw(tiny()), 2)  # the same job: fine
    check_recorded(plan, src, spec_from_raw(tiny(gpus=1)), 1)  # DDP goes on at another width (at_width)
    partitioned = replace(plan, train=replace(plan.training, strategy="deepspeed", zero_stage=2))
    with pytest.raises(HpcgpuError, match=r"world size 2 but this job has 1 rank.*DeepSpeed run's partitioned"):
        check_recorded(partitioned, src, spec_from_raw(tiny(gpus=1)), 1)
    with pytest.raises(HpcgpuError, match=r"train.global_batch_size 8 but the spec now says 16"):
        check_recorded(plan, src, spec_from_raw(tiny(global_batch_size=16)), 2)
    ds = tiny()
    ds["distributed"] = {"strategy": "deepspeed"}
    with pytest.raises(HpcgpuError, match=r"strategy ddp but the spec now fixes deepspeed ZeRO-2"):
        check_recorded(plan, src, spec_from_raw(ds), 2)
    fsdp = replace(plan, train=replace(plan.training, strategy="fsdp"))
    check_recorded(fsdp, src, spec_from_raw({**tiny(), "distributed": {"strategy": "fsdp"}}), 1)  # any width
    offload = {**tiny(), "distributed": {"strategy": "fsdp", "fsdp": {"cpu_offload": True}}}
    with pytest.raises(HpcgpuError, match=r"strategy fsdp but the spec now fixes fsdp offload"):
        check_recorded(fsdp, src, spec_from_raw(offload), 2)
    # auto in the spec: whatever was recorded is kept (here a DeepSpeed plan on a ddp-looking job)
    zero3 = replace(plan, train=replace(plan.training, strategy="deepspeed", zero_stage=3, micro_batch=1, accum=4))
    check_recorded(zero3, src, spec_from_raw(tiny()), 2)


# ---------------------------------------------------------------- in the job (CPU ranks)

slow = pytest.mark.slow


def records_of_kind(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@slow
def test_three_torchrun_ranks_with_global_batch_8_fail_with_one_line(tmp_path: Path) -> None:
    path = write_spec_file(tmp_path, tiny())  # 2 ranks asked for: the host-side check passes
    for launch in (1, 2):  # the second launch in the same folder says it again (its own attempt)
        port = str(free_port())
        procs = []
        for rank in range(3):
            env = job_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3", LOCAL_WORLD_SIZE="3",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            procs.append(subprocess.Popen([sys.executable, "-m", "hpcgpu", "run", str(path)], env=env,
                                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=120) for p in procs]
        text = "".join(o + e for o, e in outs)
        assert [p.returncode for p in procs] == [2, 2, 2], text
        assert "Traceback" not in text, text
        errors = [line for line in text.splitlines() if line.startswith("hpcgpu: error:")]
        assert len(errors) == 1, (launch, text)  # the same mistake in every rank: one line per launch
        assert "train.global_batch_size: 8 is not divisible by the 3 ranks" in errors[0]
        assert not (tmp_path / "plan.json").exists()


@slow
def test_a_requeued_run_reuses_its_recorded_plan(tmp_path: Path) -> None:
    """First start: CPU rule (ddp, micro 4). The requeue sees a 1 GB GPU budget, under which a fresh
    plan would be ZeRO-3 with offload at micro 1: it must keep ddp and micro 4, say so, and resume.
    (Going on at another width: tests/unit/test_resume_width.py.)"""
    raw = tiny()
    path = write_spec_file(tmp_path, raw)
    first = submit(path, "--new", env=job_env(HPCGPU_SIGNAL_AT="3"))  # stops after step 4
    assert first.returncode == 75, first.stdout[-2000:] + first.stderr[-2000:]
    run_dir = only_run_dir(tmp_path / "runs", "plan")

    # plan.json holds the chosen values, and the checkpoint a copy
    recorded = json.loads((run_dir / "plan.json").read_text())
    assert recorded["world_size"] == 2 and recorded["precision"] == "fp32"
    assert {k: recorded["train"][k] for k in ("global_batch", "batch_per_rank", "micro_batch", "accum",
                                               "strategy", "compile")} == \
        {"global_batch": 8, "batch_per_rank": 4, "micro_batch": 4, "accum": 1, "strategy": "ddp", "compile": False}
    ckpt_plan = run_dir / "checkpoints" / "step-00000004" / "plan.json"
    assert ckpt_plan.read_text() == (run_dir / "plan.json").read_text()

    # a fresh plan under the new budget would differ: the test means something
    budget = "1G"
    fresh = cpu_plan(raw, 2, gpu_memory=parse_size(budget)).training
    assert (fresh.strategy, fresh.micro_batch) == ("deepspeed", 1)

    again = submit(path, env=job_env(HPCGPU_GPU_MEMORY=budget))
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-3000:]
    assert f"reusing the recorded plan from {ckpt_plan}" in log
    assert "(ddp); global batch 8 = micro 4 x accum 1 x 2 ranks" in log
    assert "run plan:" not in log  # no fresh plan was decided
    assert json.loads((run_dir / "plan.json").read_text()) == recorded
    assert [r["step"] for r in records_of_kind(run_dir, "resume")] == [4]
    assert_resumed(run_dir)
    assert [r["step"] for r in records_of_kind(run_dir, "train")] == list(range(1, 9))
    assert all(r["tokens"] == r["step"] * 8 * 64 for r in records_of_kind(run_dir, "train"))
