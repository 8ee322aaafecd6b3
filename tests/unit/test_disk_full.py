"""A disk that fills up during a run (a small tmpfs as runs_dir; needs root to mount, skipped
elsewhere): the job ends FAILED with "no space left on device writing PATH (N MB free there)" from the
rank, in the registry too, the launcher ends cleanly, and the same command after space is freed
resumes from the last complete checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import job_env, only_run_dir, submit_cmd, write_spec_file
from resumes import assert_resumed
from hpcgpu.contract import first_failure

FILLS = '''
import os

import torch


def main(ctx):
    model = torch.nn.Linear(256, 256)
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ctx.resume()
    if step == 0:
        ctx.save(1)
        with open(os.environ["FILLER"], "wb") as fh:  # another job fills the disk
            for chunk in (1 << 20, 1 << 12):
                try:
                    while True:
                        fh.write(b"\\0" * chunk)
                        fh.flush()
                except OSError:
                    pass
        ctx.save(2)
    print(f"resumed at step {step}", flush=True)
    return 0
'''


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount not allowed here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_is_the_reason_and_the_run_resumes_after_space_is_freed(tmp_path: Path, small_disk: Path) -> None:
    (tmp_path / "fills.py").write_text(FILLS)
    spec = write_spec_file(tmp_path, {"name": "full", "task": "callable", "entry": "fills:main",
                                      "runs_dir": str(small_disk / "runs"),
                                      "resources": {"gpus": 1, "cpus_per_gpu": 1}})
    filler = small_disk / "filler"
    env = job_env(HPCGPU_REGISTRY=str(tmp_path / "jobs.db"), FILLER=str(filler), PYTHONPATH=str(tmp_path))
    out = subprocess.run(submit_cmd(spec), capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr.split("hpcgpu: job")[-1]  # the launcher ended cleanly
    run_dir = only_run_dir(small_disk / "runs", "full")
    failure = first_failure(run_dir)
    assert failure is not None and failure.rank == 0, (failure, out.stderr[-2000:])
    assert failure.message.startswith("no space left on device writing ") and "MB free there" in failure.message
    listed = json.loads(subprocess.run([sys.executable, "-m", "hpcgpu", "list", "--json"], capture_output=True,
                                       text=True, timeout=60, env=env, check=True).stdout)
    job = next(j for j in listed if j["name"] == "full")
    assert job["state"] == "FAILED" and "no space left on device" in job["failure"]["message"], job
    filler.unlink()  # space again: the same command goes on from step 1, the last complete checkpoint
    again = subprocess.run(submit_cmd(spec), capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resuming the unfinished run {run_dir}" in again.stderr
    assert "resumed at step 1" in again.stdout + again.stderr
    assert_resumed(run_dir, at=[1])  # a failure, not a stop: no stop record names the step
