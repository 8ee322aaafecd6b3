"""`hpcgpu logs JOB` of a SLURM job: slurm-<id>.out and .err merged line by line in the order they were
written (hpcgpu/launch/joblogs.py interleave), not the whole .err after the whole .out."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hpcgpu.launch.registry import JobRecord, Registry

OUT = ("0: 10:00:01 [rank 0] rank 0/1 on n1\n"
       "0: 10:00:05 [rank 0] step 1\n"
       "Generating: 100%|##########| 3/3\n"  # a program's own line, no time: right after the one before it
       "0: 10:00:09 [rank 0] wrote outputs.jsonl\n")


def at(clock: str) -> float:
    return time.mktime(time.strptime(f"2026-01-01 {clock}", "%Y-%m-%d %H:%M:%S"))


def logs_of(tmp_path: Path, err: str, err_written: str) -> str:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "slurm-10.out").write_text(OUT)
    (run_dir / "slurm-10.err").write_text(err)
    os.utime(run_dir / "slurm-10.out", (at("10:00:09"), at("10:00:09")))
    os.utime(run_dir / "slurm-10.err", (at(err_written), at(err_written)))
    registry = Registry(tmp_path / "jobs.db")
    registry.add(JobRecord("10", "exp", "/s.yaml", str(run_dir), "slurm", state="COMPLETED"))
    registry.close()
    done = subprocess.run([sys.executable, "-m", "hpcgpu", "logs", "10"], capture_output=True, text=True,
                          env={**os.environ, "HPCGPU_REGISTRY": str(tmp_path / "jobs.db")}, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_warning_written_at_start_up_shows_there_and_the_log_ends_on_the_job_s_last_line(tmp_path: Path) -> None:
    warning = "/x/peft.py:12: FutureWarning: is_gradient_checkpointing is deprecated\n  warnings.warn(\n"
    shown = logs_of(tmp_path, warning, err_written="10:00:02")
    lines = shown.splitlines()
    assert lines[-1] == "0: 10:00:09 [rank 0] wrote outputs.jsonl", shown
    assert lines.index("  warnings.warn(") == 2 and lines[1].endswith("is deprecated"), shown
    assert lines[4] == "Generating: 100%|##########| 3/3", shown


def test_an_error_written_last_stays_last(tmp_path: Path) -> None:
    shown = logs_of(tmp_path, "Traceback (most recent call last):\nsrun: error: n1: task 0: Exited with exit code 1\n",
                    err_written="10:00:11")
    assert shown.splitlines()[-2:] == ["Traceback (most recent call last):",
                                       "srun: error: n1: task 0: Exited with exit code 1"], shown
    assert shown.count("\n") == 6
