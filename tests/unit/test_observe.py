"""Every task is observed the same way: a start-up line per rank, the GPU monitor (gpu.jsonl from local
rank 0) and its end-of-job summary, and `hpcgpu report` on the run dir. The GPUs are recorded NVML
readings of a shared 8 x H100 node (tests/unit/fixtures/nvml_h100x8_shared.json), so a user's own
program (`task: command`) runs here as it would there."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import job_env, only_run_dir, submit, write_spec_file

pytestmark = pytest.mark.slow

RECORDED = Path(__file__).parent / "fixtures" / "nvml_h100x8_shared.json"


def test_a_command_task_gets_the_startup_lines_the_gpu_monitor_and_a_report(tmp_path: Path) -> None:
    spec = write_spec_file(tmp_path, {"name": "own", "task": "command",
                                      "resources": {"gpus": 2, "cpus_per_gpu": 1},
                                      "monitor": {"interval_s": 0.1},
                                      "command": [sys.executable, "-c", "import time; time.sleep(1)"]})
    env = job_env(HPCGPU_NVML_RECORDED=str(RECORDED), HPCGPU_REGISTRY=str(tmp_path / "jobs.db"),
                  CUDA_VISIBLE_DEVICES="2,3")
    done = submit(spec, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = only_run_dir(tmp_path / "runs", "own")

    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        line = next(x for x in log.splitlines() if f"rank {rank}/2 (local {rank}) on " in x)
        assert "| CUDA_VISIBLE_DEVICES=2,3 | GPU 2: NVIDIA H100 80GB HBM3, 79.6 GiB; GPU 3: NVIDIA H100" in line
        assert "| torch 2." in line and "| NCCL " in line

    samples = [json.loads(x) for x in (run_dir / "gpu.jsonl").read_text().splitlines()]
    assert {s["gpu"] for s in samples} == {2, 3}  # the job's GPUs, sampled by one rank
    assert len(samples) >= 4 and all(s["mem_total"] > 0 for s in samples)
    rank0 = (run_dir / "logs" / "rank-0.log").read_text()
    assert "gpu monitor: gpu 2: util mean" in rank0 and "gpu monitor: gpu 3: util mean" in rank0

    report = subprocess.run([sys.executable, "-m", "hpcgpu", "report", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    panels = json.loads(report.stdout)["panels"]
    assert panels == ["GPU utilization (%)", "GPU memory used (GiB)", "GPU power (W)"]
    assert (run_dir / "report.png").stat().st_size > 0


def test_status_of_a_running_train_job_shows_its_rate_and_an_eta(tmp_path: Path) -> None:
    import time

    from conftest import submit_cmd, train_spec

    spec = write_spec_file(tmp_path, train_spec("eta", resources={"gpus": 1}, train={"max_steps": 5000}))
    env = job_env(HPCGPU_REGISTRY=str(tmp_path / "jobs.db"))
    job = subprocess.Popen(submit_cmd(spec), env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)

    def status(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hpcgpu", "status", "local-1", *args], env=env,
                              capture_output=True, text=True, timeout=60)
    try:
        deadline, view = time.monotonic() + 120, {}
        while time.monotonic() < deadline:
            done = status("--json")
            view = json.loads(done.stdout) if done.returncode == 0 else {}
            if (view.get("step") or 0) >= 5:
                break
            time.sleep(0.5)
        assert view.get("state") == "RUNNING" and view["max_steps"] == 5000, view
        assert view["tokens_per_s"] > 0 and view["eta_s"] > 0, view
        text = status().stdout
        assert f"/5000  loss " in text and " tok/s  ETA " in text, text
    finally:
        subprocess.run([sys.executable, "-m", "hpcgpu", "cancel", "local-1"], env=env, capture_output=True,
                       timeout=60)
        job.wait(timeout=60)
