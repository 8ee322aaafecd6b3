"""`hpcgpu doctor` here, on a machine without GPUs: it says so and checks the rest (the runs_dir's
space and write speed, a port); a runs_dir it cannot use fails the check and the command (exit 1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcgpu", "doctor", "--quick", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_without_gpus_it_says_so_and_checks_the_rest(tmp_path: Path) -> None:
    done = doctor("--runs-dir", str(tmp_path / "runs"), "--json")
    assert done.returncode == 0, done.stderr
    rows = {r["check"]: r for r in json.loads(done.stdout)}
    if "GPU" not in rows:  # a machine with no NVIDIA driver (CI): one row says so, nothing fails for it
        assert rows["GPUs"]["status"] == "skip" and "no NVIDIA driver" in rows["GPUs"]["result"]
    assert rows["runs_dir free space"]["result"].endswith("GiB") and rows["runs_dir free space"]["status"] != "FAIL"
    assert "MB/s" in rows["runs_dir write speed"]["result"]
    assert rows["TCP port to listen on"]["status"] == "ok"
    assert not list((tmp_path / "runs").iterdir())  # the write probe is gone again


def test_a_runs_dir_it_cannot_use_fails_and_says_which(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done = doctor("--runs-dir", str(blocker / "runs"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout and "runs_dir" in done.stdout
    assert done.stderr.strip() == f"hpcgpu: 1 check(s) failed: runs_dir on {os.uname().nodename} {blocker / 'runs'}"


def test_sizing_a_job_without_submit_is_a_usage_error() -> None:
    done = doctor("--gpus", "2")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--submit" in done.stderr



def test_the_doctor_job_goes_through_the_resolve_steps_host_checks(tmp_path: Path) -> None:
    """--submit makes its job's spec through launch/resolve.py: what the host checks refuse (here an
    env_passthrough variable this shell lacks) is refused as `hpcgpu submit` refuses it, one line, exit 2,
    before anything reaches SLURM or the registry."""
    spec = tmp_path / "exp.yaml"
    spec.write_text(f"name: d\ntask: command\ncommand: [echo]\nruns_dir: {tmp_path / 'runs'}\n"
                    "env_passthrough: [HPCGPU_TEST_NEVER_SET]\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HPCGPU_REGISTRY": str(tmp_path / "jobs.db")}
    env.pop("HPCGPU_TEST_NEVER_SET", None)
    done, submitted = (subprocess.run([sys.executable, "-m", "hpcgpu", *args, str(spec)], capture_output=True,
                                      text=True, timeout=120, env=env)
                       for args in (["doctor", "--quick", "--submit"], ["submit"]))
    assert (done.returncode, submitted.returncode) == (2, 2), done.stdout + done.stderr
    assert done.stderr == submitted.stderr and done.stderr.count("\n") == 1
    assert done.stderr.startswith("hpcgpu: error: env_passthrough: HPCGPU_TEST_NEVER_SET is not set")
    assert not (tmp_path / "jobs.db").exists() and not (tmp_path / "runs").exists()
