"""On the real cluster, `hpcgpu status` tells the truth: a FAILED job names the rank that failed,
its node, exit code and last error line; a requeued job's elapsed and GPU time add up all its runs,
and while it waits again it holds no nodes."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hpcgpu.launch.scheduler import parse_duration

pytestmark = pytest.mark.slurm

# rank 1 prints a traceback and exits 3 a second in; rank 0 would sleep for a minute
CRASH = ("import os, sys, time\n"
         "if os.environ['RANK'] == '1':\n"
         "    time.sleep(1)\n"
         "    print('Traceback (most recent call last):', file=sys.stderr)\n"
         "    print(\"OSError: [Errno 28] No space left on device: '/scratch/ckpt'\", file=sys.stderr)\n"
         "    sys.exit(3)\n"
         "time.sleep(60)\n")


def test_failed_status_names_rank_node_exit_code_and_last_error_line(slurm) -> None:
    spec = slurm.write_spec({"name": "crash", "task": "command", "command": [sys.executable, "-c", CRASH],
                             "resources": {"nodes": 2, "gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"},
                             "slurm": {"requeue": False}})
    job, run_dir, _ = slurm.submit(spec)
    view, _ = slurm.wait_status(job, timeout=90)
    assert view["state"] == "FAILED", view
    hosts = subprocess.run(["scontrol", "show", "hostnames", view["nodes"]], capture_output=True, text=True,
                           check=True).stdout.split()
    message = "OSError: [Errno 28] No space left on device: '/scratch/ckpt'"
    assert view["failure"] == {"rank": 1, "node": hosts[1], "exit_code": 3, "signal": None, "message": message}
    assert view["reason"] == f"rank 1 on {hosts[1]} failed with exit code 3: {message}"
    assert f"reason    rank 1 on {hosts[1]} failed with exit code 3" in slurm.hpcgpu("status", job).stdout


def test_a_step_srun_refuses_to_start_fails_with_srun_s_line(slurm) -> None:
    """A setup line that breaks the allocation's variables: srun never starts a rank, and the reason is
    srun's own error line, not a bare exit code."""
    spec = slurm.write_spec({"name": "nostep", "task": "command", "command": [sys.executable, "-c", "pass"],
                             "resources": {"gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"},
                             "slurm": {"requeue": False, "setup": ["export SLURM_JOB_ID=4242"]}})
    job, _, _ = slurm.submit(spec)
    view, _ = slurm.wait_status(job, timeout=90)
    assert view["state"] == "FAILED", view
    assert view["reason"].startswith("exit code 1: srun: error: ") and "4242" in view["reason"], view


def test_requeued_job_adds_up_its_runs_and_holds_no_nodes_while_waiting(slurm) -> None:
    spec = slurm.write_spec({"name": "twice", "task": "command",
                             "command": [sys.executable, "-c", "import time; time.sleep(8)"],
                             "resources": {"gpus": 2, "cpus_per_gpu": 1, "time": "00:05:00"}})
    job, _, _ = slurm.submit(spec)
    slurm.wait_status(job, timeout=60, states={"RUNNING"})
    time.sleep(4)
    subprocess.run(["scontrol", "requeue", job], check=True)
    waiting: list[dict] = []
    deadline = time.monotonic() + 90
    view = slurm.status(job)
    while view["state"] != "COMPLETED" and time.monotonic() < deadline:
        if view["state"] in ("REQUEUED", "PENDING"):
            waiting.append(view)
        time.sleep(0.5)
        view = slurm.status(job)
    assert view["state"] == "COMPLETED" and view["restarts"] == 1, view
    assert waiting and all(v["nodes"] == "" for v in waiting), waiting
    last_run = parse_duration(slurm.job(job)["RunTime"])  # SLURM's clock: the last run only
    assert last_run is not None and last_run >= 8
    # run 0 (about 4 s, until the requeue) + run 1; the ~12 s spent waiting in between never count
    assert last_run + 4 <= view["elapsed_s"] <= last_run + 8, (view, last_run)
    assert view["gpus"] == 2 and view["gpu_hours"] == round(view["elapsed_s"] * 2 / 3600, 3)
