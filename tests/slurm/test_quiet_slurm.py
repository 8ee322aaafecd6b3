"""Under SLURM too a library's warnings stay out of the job's .out/.err: each rank's logs/rank-N.log
holds each distinct one once (tests/unit/test_quiet.py shows the rest under the local executor)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm
NOISY_LIB = Path(__file__).resolve().parents[1] / "noisy_lib.py"  # a library that warns at every call


def test_a_library_warning_is_in_each_ranks_log_once_not_in_the_jobs_err(slurm) -> None:
    (slurm.tmp / "noisy_lib.py").write_text(NOISY_LIB.read_text())
    spec = slurm.write_spec({"name": "noisy", "task": "callable", "entry": "noisy_lib:main",
                             "resources": {"nodes": 2, "gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"},
                             "env": {"PYTHONPATH": str(slurm.tmp)}})
    job, run_dir, _ = slurm.submit(spec)
    view, _ = slurm.wait_status(job, timeout=180)
    output = slurm.job_output(run_dir, job)
    assert view["state"] == "COMPLETED", output
    assert "Warning" not in output, output
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        lines = [line for line in log.splitlines() if "noisy_call is deprecated" in line]
        assert len(lines) == 1 and lines[0].endswith("noisy_lib.py:8: FutureWarning: noisy_call is deprecated"), log
