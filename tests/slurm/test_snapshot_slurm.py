"""A queued SLURM job runs the code of submit time: its script edited in the working tree while the job
is held (`slurm.extra: {hold: true}`, sbatch --hold) changes nothing once it is released."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = "import os\nprint('version', {v}, 'file', os.path.abspath(__file__), flush=True)\n"


def test_a_held_job_runs_the_script_as_submitted(slurm):
    script = slurm.tmp / "train.py"  # no repository here: the spec's folder is the snapshot
    script.write_text(SCRIPT.format(v=1))
    spec = slurm.write_spec({
        "name": "snap", "task": "command", "command": [sys.executable, str(script)],
        "resources": {"gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"},
        "slurm": {"extra": {"hold": True}},
    })
    job_id, run_dir, _ = slurm.submit(spec)
    try:
        assert slurm.job(job_id).get("JobState") == "PENDING"
        script.write_text(SCRIPT.format(v=2))  # edited while the job waits
    finally:
        subprocess.run(["scontrol", "release", job_id], check=True, timeout=30)
    info = slurm.wait(job_id, timeout=180)
    out = slurm.job_output(run_dir, job_id)
    assert info["JobState"] == "COMPLETED", out
    assert f"version 1 file {run_dir / 'code' / 'train.py'}" in out, out
    assert "version 2" not in out
