"""`hpcgpu submit SPEC --after JOB` on the real cluster (hpcgpu/launch/chain.py): job 2 is submitted at
once with --dependency=afterok:JOB, runs after job 1 on what job 1 wrote under ${after}, and a failed
job 1 leaves its follower pending for ever, which `hpcgpu status` says (will not run; cancel it).
Command tasks keep it quick: the chain is SLURM's and ours, not the training's."""
from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.slurm

# job 1 writes out.txt in its run dir once the test says go (every follower is queued by then, so the
# order never depends on the machine's speed); job 2 copies ${after}/out.txt into its own
WRITE = ("import os, sys, time\nwhile not os.path.exists(sys.argv[3]): time.sleep(0.1)\n"
         "open(sys.argv[1], 'w').write('from job 1'); sys.exit(int(sys.argv[2]))")
COPY = "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])"


def command(slurm, name: str, args: list[str]):
    doc = {"name": name, "task": "command", "command": [sys.executable, "-c", *args],
           "resources": {"gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"}}
    return slurm.write_spec(doc, f"{name}.yaml")


def test_chain_runs_in_order_on_after_and_a_failed_first_job_leaves_the_next_not_run(slurm):
    go = slurm.tmp / "go"
    good = command(slurm, "first", [WRITE, "${HPCGPU_RUN_DIR}/out.txt", "0", str(go)])
    bad = command(slurm, "broken", [WRITE, "${HPCGPU_RUN_DIR}/out.txt", "3", str(go)])
    follow = command(slurm, "second", [COPY, "${after}/out.txt", "${HPCGPU_RUN_DIR}/copied.txt"])
    job1, run1, _ = slurm.submit(good)
    job3, _, _ = slurm.submit(bad)
    job2, run2, _ = slurm.submit(follow, "--after", job1)
    job4, _, _ = slurm.submit(follow, "--after", job3, "--new")
    assert slurm.job(job2)["Dependency"].startswith(f"afterok:{job1}")
    slurm.wait_for(lambda: slurm.status(job2)["reason"] == f"waiting for job {job1} to complete", timeout=30,
                   what="SLURM's Reason=Dependency")
    assert slurm.status(job2)["after"] == job1
    go.touch()

    view, _ = slurm.wait_status(job2, timeout=120)
    assert view["state"] == "COMPLETED", slurm.job_output(run2, job2)
    assert slurm.status(job1)["state"] == "COMPLETED"
    assert (run2 / "copied.txt").read_text() == "from job 1"  # ${after} was job 1's run dir
    assert f"{run1}/out.txt" in (run2 / "spec.yaml").read_text()

    assert slurm.wait_status(job3, timeout=60)[0]["state"] == "FAILED"
    slurm.wait_for(lambda: "will not run" in slurm.status(job4)["reason"], timeout=30,
                   what="SLURM's DependencyNeverSatisfied")
    text = slurm.hpcgpu("status", job4).stdout
    assert f"will not run: job {job3} did not complete; `hpcgpu cancel {job4}`" in text, text
    slurm.hpcgpu("cancel", job4)
