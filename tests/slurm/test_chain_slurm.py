"""`hpcgpu submit SPEC --after JOB` on the real cluster (hpcgpu/launch/chain.py): job 2 is submitted at
once with --dependency=afterok:JOB, runs after job 1 on what job 1 wrote under ${after}, and a failed
job 1 leaves its follower pending for ever, which `hpcgpu status` says (will not run; cancel it).
Command tasks keep it quick: the chain is SLURM's and ours, not the training's. One three-job chain
(a 2-step train -> infer on ${after}/model -> a command counting ${after}/outputs.jsonl) shows the
everyday workflow of issue #44 queued at once, in about 30 s."""
from __future__ import annotations

import json
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


# job 3 of the three-job chain: counts the rows of job 2's outputs.jsonl into its own run dir
COUNT = "import sys; open(sys.argv[2], 'w').write(str(sum(1 for _ in open(sys.argv[1]))))"


def test_three_job_chain_train_then_infer_on_its_model_then_count_its_rows(slurm):
    train = slurm.write_spec({**slurm.tiny_train(max_steps=2), "name": "train",
                              "resources": {"gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"}}, "train.yaml")
    prompts = slurm.tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"def f{i}("}) + "\n" for i in range(3)))
    infer = slurm.write_spec({
        "name": "infer", "task": "infer", "resources": {"gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"},
        "model": {"name_or_path": "${after}/model"},
        "infer": {"input": str(prompts), "max_new_tokens": 4, "batch_size": 4}}, "infer.yaml")
    count = command(slurm, "count", [COUNT, "${after}/outputs.jsonl", "${HPCGPU_RUN_DIR}/rows.txt"])
    job1, run1, _ = slurm.submit(train)  # all three queued at once; no run dir typed by hand
    job2, run2, _ = slurm.submit(infer, "--after", job1)
    job3, run3, _ = slurm.submit(count, "--after", job2)

    view, _ = slurm.wait_status(job3, timeout=240)
    assert view["state"] == "COMPLETED", slurm.job_output(run3, job3)
    for job, run in ((job1, run1), (job2, run2)):
        assert slurm.status(job)["state"] == "COMPLETED", slurm.job_output(run, job)
    # the cluster keeps no accounting (sacct is off); scontrol keeps finished jobs for MinJobAge (300 s)
    times = [(slurm.job(job)["StartTime"], slurm.job(job)["EndTime"]) for job in (job1, job2, job3)]
    assert times[0][1] <= times[1][0] and times[1][1] <= times[2][0], times  # each began after the last ended
    assert f"{run1}/model" in (run2 / "spec.yaml").read_text()  # ${after} resolved at submit
    assert f"model {run1}/model:" in slurm.job_output(run2, job2)  # job 2 loaded the model job 1 trained
    assert len((run2 / "outputs.jsonl").read_text().splitlines()) == 3
    assert (run3 / "rows.txt").read_text() == "3"  # job 3 read job 2's rows
