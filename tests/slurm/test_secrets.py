"""A secret named in env_passthrough reaches the SLURM job (through `hpcgpu submit`, and through
`hpcgpu sbatch` + plain sbatch) while no file the submission writes holds its value: not the run
dir (spec.yaml, job.sbatch, submitit's batch file, SLURM's output), not the registry."""
from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

SHOW = "import os; print('secret-len', len(os.environ['HF_TOKEN']))"


def test_a_passthrough_secret_reaches_the_job_and_no_file(slurm):
    token = "hf_" + secrets.token_hex(16)
    spec = slurm.write_spec({"name": "secret", "task": "command", "command": [sys.executable, "-c", SHOW],
                             "resources": {"gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"},
                             "env_passthrough": ["HF_TOKEN"]}, "secret.yaml")
    # submit refuses without the variable (nothing is queued), then submits with it
    refused = slurm.hpcgpu("submit", str(spec), check=False)
    assert refused.returncode == 2 and "env_passthrough: HF_TOKEN is not set" in refused.stderr
    out = slurm.hpcgpu("submit", str(spec), env={"HF_TOKEN": token}).stdout
    submitted = re.search(r"^job\s+(\d+)", out, re.M).group(1)  # type: ignore[union-attr]
    submit_dir = Path(re.search(r"^run dir\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    # the readable script: written without the token, run by sbatch from a shell that has it
    script, sbatch_dir = slurm.render(spec)
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "HF_TOKEN": token})
    assert proc.returncode == 0, proc.stderr
    by_hand = proc.stdout.strip().split(";")[0]
    for job, run_dir in ((submitted, submit_dir), (by_hand, sbatch_dir)):
        info = slurm.wait(job, timeout=180)
        output = slurm.job_output(run_dir, job)
        assert info["JobState"] == "COMPLETED", output
        assert f"secret-len {len(token)}" in output  # the job saw the value
    written = [p for p in slurm.tmp.rglob("*") if p.is_file()]
    assert slurm.registry in written and any(p.name == f"{submitted}_submission.sh" for p in written)
    assert any(p.name == f"slurm-{by_hand}.out" for p in written)
    assert [p for p in written if token.encode() in p.read_bytes()] == []
