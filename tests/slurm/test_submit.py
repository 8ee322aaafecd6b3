"""`hpcgpu submit` through submitit on the real local cluster: training, the same request as
`hpcgpu sbatch`, preemption, cancel, sweeps as arrays, checks before submission, the registry."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from joblog import program_lines
from resumes import assert_resumed
from test_train_and_preempt import assert_same_weights, run_local, wait_settled

pytestmark = pytest.mark.slurm


def command_spec(cluster, command: list[str], name: str = "cmd", **more) -> Path:
    doc = {"name": name, "task": "command", "command": command,
           "resources": {"gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"}}
    doc.update(more)
    return cluster.write_spec(doc, f"{name}.yaml")


def test_submit_trains_on_two_gpus(slurm):
    spec = slurm.write_spec(slurm.tiny_train(max_steps=20))
    job, run_dir, seconds = slurm.submit(spec, "--gpus", "2")
    print(f"\nhpcgpu submit returned job {job} in {seconds:.2f} s (measured in benchmarks/submit_latency.py)")
    view, seen = slurm.wait_status(job, timeout=300)
    assert view["state"] == "COMPLETED", slurm.job_output(run_dir, job)
    assert seen[-1] == "COMPLETED" and set(seen) <= {"PENDING", "RUNNING", "COMPLETING", "COMPLETED"}
    assert view["nodes"] == "n1" and view["restarts"] == 0 and view["exit_code"] == 0
    assert view["step"] == 20 and view["loss"] == slurm.loss_log(run_dir)[20]
    assert sorted(slurm.loss_log(run_dir)) == list(range(1, 21))
    assert (run_dir / "model" / "model.safetensors").exists() and (run_dir / "FINISHED").exists()
    logs = slurm.hpcgpu("logs", job).stdout
    assert "x 2 ranks" in logs and "ddp" in logs  # rank 0's own lines
    ranks = [slurm.hpcgpu("logs", job, "--rank", str(r)).stdout for r in (0, 1)]
    assert "x 2 ranks" in ranks[0] and "x 2 ranks" not in ranks[1]
    assert ranks[0] and all(line in logs for line in ranks[0].splitlines()[:3])
    listing = slurm.hpcgpu("list").stdout
    assert re.search(rf"^{job}\s+tiny\s+slurm\s+COMPLETED", listing, re.M), listing


SAME_FIELDS = ["JobName", "NumNodes", "NumCPUs", "NumTasks", "CPUs/Task", "TRES", "TresPerNode", "TimeLimit",
               "Partition", "Requeue", "OverSubscribe", "MinMemoryNode", "MinCPUsNode", "Features", "Contiguous",
               "Priority", "Reason", "Dependency", "ReqNodeList", "ExcNodeList", "Account", "QOS", "Network",
               "Licenses", "NtasksPerN:B:S:C", "ReqB:S:C:T", "Socks/Node", "CoreSpec", "Nice", "WorkDir"]


def test_submit_and_sbatch_request_the_same(slurm):
    doc = slurm.tiny_train(max_steps=5)
    doc["resources"].update({"gpus": 2, "nodes": 2, "cpus_per_gpu": 2, "mem_per_gpu": "1G", "time": "00:07:00"})
    doc["slurm"] = {"partition": "gpu", "extra": {"hold": True, "comment": "same request"}}
    spec = slurm.write_spec(doc)
    script, sbatch_dir = slurm.render(spec)
    by_sbatch = slurm.sbatch(script)
    by_submit, submit_dir, _ = slurm.submit(spec)
    try:
        a, b = slurm.job(by_sbatch), slurm.job(by_submit)
        assert a["JobState"] == b["JobState"] == "PENDING" and a["Reason"] == "JobHeldUser"
        for key in SAME_FIELDS:
            assert a.get(key) == b.get(key), f"{key}: sbatch {a.get(key)!r} != submit {b.get(key)!r}"
        assert (a["TresPerNode"], a["NumTasks"], a["TimeLimit"]) == ("gres:gpu:2", "4", "00:07:00")
        assert b["StdOut"] == str(submit_dir / f"slurm-{by_submit}.out")
        assert a["StdOut"] == str(sbatch_dir / f"slurm-{by_sbatch}.out")
        # the same script body: setup, exports, rendezvous and the srun of `hpcgpu run`
        submitted = (submit_dir / f"{by_submit}_submission.sh").read_text()
        body = script.read_text().split("\nset -eo pipefail", 1)[1].replace(str(sbatch_dir), str(submit_dir))
        assert submitted.split("\nset -eo pipefail", 1)[1].rstrip() == body.rstrip()
    finally:
        subprocess.run(["scancel", by_sbatch, by_submit])


def test_preemption_through_submit_resumes_exactly(slurm):
    doc = slurm.tiny_train(max_steps=120)
    doc["checkpoint"] = {"every_steps": 50, "keep": 2}
    spec = slurm.write_spec(doc)
    baseline = run_local(slurm, spec)

    waiting = subprocess.Popen([sys.executable, "-m", "hpcgpu", "submit", str(spec), "--wait"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slurm.env())
    try:
        job = re.match(r"job\s+(\d+)", waiting.stdout.readline()).group(1)  # printed before it waits
        run_dir = Path(waiting.stdout.readline().split()[-1])
        slurm.wait_for(lambda: len(slurm.loss_log(run_dir)) >= 15, timeout=180, what="15 logged steps")
        subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True)
        out, err = waiting.communicate(timeout=300)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == 0, err  # --wait: the job's status, COMPLETED after one requeue
    view = slurm.status(job)
    assert view["state"] == "COMPLETED" and view["restarts"] == 1 and view["step"] == 120

    events = [r for r in slurm.metrics(run_dir) if r["kind"] in ("stop", "resume", "end")]
    stop, resume, end = events
    assert stop["reason"] == "preempted" and resume["restart_count"] == 1 and resume["step"] == stop["step"] >= 15
    assert_resumed(run_dir)
    assert end["step"] == 120
    assert "requeued job" in slurm.hpcgpu("logs", job).stdout
    assert slurm.loss_log(run_dir) == slurm.loss_log(baseline)
    assert_same_weights(run_dir, baseline)


def test_cancel_checkpoints_status_says_how_to_go_on_and_cancel_now_does_not(slurm):
    """`hpcgpu cancel` of a running train job: it says the job stops at its next checkpoint, the job
    ends CANCELLED (not requeued: cancel turned the Requeue flag off) with that checkpoint, and status
    names it and the command that resumes it. That command resumes the run; `cancel --now` of the
    resumed job ends it CANCELLED with no checkpoint of its own."""
    spec = slurm.write_spec(slurm.tiny_train(max_steps=100000, log_every=5), "cancelme.yaml")
    job, run_dir, _ = slurm.submit(spec)
    slurm.wait_for(lambda: len(slurm.loss_log(run_dir)) >= 3, timeout=180, what="first steps")
    done = slurm.hpcgpu("cancel", job)
    assert done.stdout.strip() == (f"asked {job} to stop: it stops at its next checkpoint; "
                                   f"`hpcgpu cancel --now {job}` stops it without one")
    info = wait_settled(slurm, job, timeout=90)  # no process of the job left: a requeue would show by now
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), info
    assert "not requeuing" in slurm.job_output(run_dir, job)  # rank 0 decided, and said so
    (stop,) = [r for r in slurm.metrics(run_dir) if r["kind"] == "stop"]
    saved = run_dir / "checkpoints" / f"step-{stop['step']:08d}"
    text = slurm.hpcgpu("status", job).stdout
    assert f"saved     {saved} (step {stop['step']}, the newest complete checkpoint)" in text, text
    command = f"hpcgpu submit {spec} --executor slurm"
    assert f"go on     {command} (resumes this run dir)" in text, text
    assert slurm.hpcgpu("cancel", job).stdout.strip() == f"{job} already ended (CANCELLED)"

    again, again_dir, _ = slurm.submit(spec, "--executor", "slurm")  # the command status gave
    assert again_dir == run_dir
    slurm.wait_for(lambda: max(slurm.loss_log(run_dir)) >= stop["step"] + 10, timeout=180, what="resumed steps")
    assert f"resumed   from step {stop['step']} (at 2 GPUs)" in slurm.hpcgpu("status", again).stdout
    done = slurm.hpcgpu("cancel", "--now", again)
    assert done.stdout.strip() == f"cancelled {again} now, without a checkpoint"
    info = wait_settled(slurm, again, timeout=90)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), info
    assert [r["kind"] for r in slurm.metrics(run_dir)].count("stop") == 1  # the first job's only
    assert [p.name for p in (run_dir / "checkpoints").glob("step-*")] == [saved.name]
    assert f"saved     {saved}" in slurm.hpcgpu("status", again).stdout


def test_a_requeued_job_shows_requeued_while_it_waits(slurm):
    """`scontrol requeue` of a running job: SLURM ends the run and queues it again (PENDING, Restarts=1,
    held back by BeginTime); `hpcgpu status` says REQUEUED, with no nodes, until it runs again."""
    spec = command_spec(slurm, ["sleep", "300"], name="again")
    job, _, _ = slurm.submit(spec)
    try:
        slurm.wait_status(job, timeout=60, states={"RUNNING"})
        subprocess.run(["scontrol", "requeue", job], check=True)
        # SLURM shows the job PENDING a moment before it sets the reason (Reason=None, then BeginTime)
        slurm.wait_for(lambda: slurm.job(job).get("JobState") == "PENDING" and slurm.job(job).get("Reason") != "None",
                       60, "SLURM to queue the job again and say why it waits")
        info = slurm.job(job)
        view = slurm.status(job)
        assert (view["state"], view["restarts"], view["nodes"]) == ("REQUEUED", 1, ""), (view, info)
        assert info["Restarts"] == "1" and view["reason"] == info["Reason"] != "None", (view, info)
        table = slurm.hpcgpu("status", job).stdout
        assert "REQUEUED" in table, table
    finally:
        slurm.hpcgpu("cancel", job, check=False)


SEED_TO_FILE = ("import os, re; d = os.environ['HPCGPU_RUN_DIR']; "
                "seed = re.search(r'seed: (\\d+)', open(os.path.join(d, 'spec.yaml')).read()).group(1); "
                "open(os.path.join(d, 'seed.txt'), 'w').write(seed); print('task seed', seed)")


def test_sweep_is_one_array_with_a_run_dir_per_task(slurm):
    spec = command_spec(slurm, [sys.executable, "-c", SEED_TO_FILE], name="sweeper",
                        slurm={"array_parallelism": 2})
    out = slurm.hpcgpu("submit", str(spec), "--sweep", "train.seed=11,22,33").stdout
    job = re.search(r"^job\s+(\d+) \(array of 3 tasks, at most 2 at once\)", out, re.M).group(1)
    assert slurm.job(f"{job}_0").get("ArrayTaskThrottle") == "2"
    view, _ = slurm.wait_status(job, timeout=180)
    assert view["state"] == "COMPLETED", view
    assert [t["id"] for t in view["tasks"]] == [f"{job}_{i}" for i in range(3)]
    assert [t["state"] for t in view["tasks"]] == ["COMPLETED"] * 3
    for i, (task, seed) in enumerate(zip(view["tasks"], ("11", "22", "33"))):
        run_dir = Path(task["run_dir"])
        assert run_dir.name == str(i) and task["values"] == {"train.seed": int(seed)}
        assert (run_dir / "seed.txt").read_text() == seed
        assert "sweep: {}" in (run_dir / "spec.yaml").read_text()
        assert program_lines(slurm.hpcgpu("logs", task["id"]).stdout) == [f"0: task seed {seed}"]  # srun --label
        assert program_lines(slurm.hpcgpu("logs", task["id"], "--rank", "0").stdout) == [f"task seed {seed}"]
    table = slurm.hpcgpu("status", job).stdout
    assert len(re.findall(rf"^{job}_\d\s+COMPLETED", table, re.M)) == 3, table


def test_cancel_one_array_task(slurm):
    spec = command_spec(slurm, ["sleep", "300"], name="arr")
    out = slurm.hpcgpu("submit", str(spec), "--sweep", "train.seed=1,2").stdout
    job = re.search(r"^job\s+(\d+)", out, re.M).group(1)
    slurm.wait_for(lambda: all(t["state"] == "RUNNING" for t in slurm.status(job)["tasks"]), 60, "both tasks running")
    slurm.hpcgpu("cancel", f"{job}_1")
    slurm.wait_for(lambda: slurm.status(f"{job}_1")["state"] == "CANCELLED", 60, "task 1 cancelled")
    assert slurm.status(f"{job}_0")["state"] == "RUNNING"
    slurm.hpcgpu("cancel", job)
    view, _ = slurm.wait_status(job, timeout=60)
    assert [t["state"] for t in view["tasks"]] == ["CANCELLED", "CANCELLED"]


@pytest.mark.parametrize("args, words", [
    (["--set", "slurm.partition=nosuch"], "slurm.partition: no partition 'nosuch' on this cluster (partitions: debug, gpu)"),
    (["--gpus", "5"], "no node in partition 'gpu' has 5 GPU(s) (the most is 4"),
    (["--nodes", "3"], "3 nodes asked for, but partition 'gpu' has only 2"),
])
def test_impossible_request_fails_before_submission(slurm, args, words):
    spec = command_spec(slurm, ["true"], name="impossible")
    done = slurm.hpcgpu("submit", str(spec), *args, check=False)
    assert done.returncode == 2, done.stdout
    assert done.stderr.count("\n") == 1 and words in done.stderr and done.stdout == ""
    names = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%j"], capture_output=True, text=True).stdout
    assert "impossible" not in names.split()
    assert not (slurm.tmp / "runs").exists() and not slurm.registry.exists()


def test_a_damaged_registry_submits_nothing(slurm):
    spec = command_spec(slurm, ["true"], name="untracked")
    slurm.registry.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)  # a header, then garbage
    done = slurm.hpcgpu("submit", str(spec), check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and f"job registry {slurm.registry} is damaged" in done.stderr
    names = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%j"], capture_output=True, text=True).stdout
    assert "untracked" not in names.split()  # nothing reached SLURM untracked
    assert not list((slurm.tmp / "runs").glob("untracked/*"))


def test_sbatch_refusal_is_slurms_message_exit_3(slurm):
    spec = command_spec(slurm, ["true"], name="refused", slurm={"extra": {"nodelist": "nosuch"}})
    done = slurm.hpcgpu("submit", str(spec), check=False)
    assert done.returncode == 3, done.stderr
    assert done.stderr == "hpcgpu: error: sbatch: error: Batch job submission failed: Invalid node name specified\n"
    assert not list((slurm.tmp / "runs" / "refused").glob("*"))  # the run dir made for it is gone again


def test_wait_returns_the_jobs_exit_code(slurm):
    spec = command_spec(slurm, [sys.executable, "-c", "raise SystemExit(3)"], name="fails")
    done = slurm.hpcgpu("submit", str(spec), "--wait", check=False)
    assert done.returncode == 3, done.stderr
    assert "FAILED" in done.stderr and done.stderr.strip().splitlines()[-1].startswith("hpcgpu: error: job ")


def test_twenty_parallel_submits_leave_twenty_rows(slurm):
    spec = command_spec(slurm, ["true"], name="many")
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "hpcgpu", "submit", str(spec)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=slurm.env()) for _ in range(20)]
    results = [p.communicate(timeout=180) for p in procs]
    print(f"\n20 parallel submits took {time.perf_counter() - t0:.1f} s on {len(procs)} processes")
    assert [p.returncode for p in procs] == [0] * 20, [err for _, err in results if err]
    ids = [re.search(r"^job\s+(\d+)", out, re.M).group(1) for out, _ in results]
    try:
        from hpcgpu.launch.registry import Registry

        rows = Registry(slurm.registry).all()
        assert len(rows) == 20 and sorted(r.job_id for r in rows) == sorted(ids) and len(set(ids)) == 20
        assert len({r.run_dir for r in rows}) == 20
    finally:
        subprocess.run(["scancel", *ids])


def test_two_nodes_train_like_one(slurm):
    """--nodes 2 --gpus 1: one rank on n1 and one on n2 meet at MASTER_ADDR=n1 and train the same
    curve, bit for bit, as the 2-rank local run of the same spec."""
    spec = slurm.write_spec(slurm.tiny_train(max_steps=12))
    baseline = run_local(slurm, spec)
    job, run_dir, _ = slurm.submit(spec, "--nodes", "2", "--gpus", "1")
    view, _ = slurm.wait_status(job, timeout=300)
    assert view["state"] == "COMPLETED", slurm.job_output(run_dir, job)
    assert view["nodes"] == "n[1-2]"
    assert slurm.loss_log(run_dir) == slurm.loss_log(baseline)
    assert_same_weights(run_dir, baseline)


FAILS_ONCE = '''
import torch


def main(ctx):
    model = torch.nn.Linear(2, 2)
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ctx.resume()
    if step == 0:
        ctx.save(1)
        raise SystemExit(3)  # the first job fails after its checkpoint
    print(f"resumed at step {step}", flush=True)
    return 0
'''


def test_submitting_an_unfinished_run_again_resumes_it_and_new_starts_afresh(slurm):
    """The same spec submitted again after its job failed goes on in that run dir from its last complete
    checkpoint, and says so, as the local executor does; --new makes a new run dir."""
    (slurm.tmp / "fails_once.py").write_text(FAILS_ONCE)
    spec = slurm.write_spec({"name": "again", "task": "callable", "entry": "fails_once:main",
                             "resources": {"gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"},
                             "env": {"PYTHONPATH": str(slurm.tmp)}}, "again.yaml")
    first = slurm.hpcgpu("submit", str(spec), "--wait", check=False)
    assert first.returncode == 3, first.stdout + first.stderr
    run_dir = re.search(r"run dir\s+(\S+)", first.stdout + first.stderr).group(1)
    second = slurm.hpcgpu("submit", str(spec), "--wait", check=False)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resuming the unfinished run {run_dir}" in second.stderr, second.stderr
    job_id = re.search(r"^job\s+(\d+)", second.stdout, re.M).group(1)
    assert "resumed at step 1" in slurm.job_output(Path(run_dir), job_id)
    fresh = slurm.hpcgpu("submit", str(spec), "--new", check=False)
    assert fresh.returncode == 0 and "resuming" not in fresh.stderr
    other = re.search(r"run dir\s+(\S+)", fresh.stdout + fresh.stderr).group(1)
    assert other != run_dir
    subprocess.run(["scancel", re.search(r"^job\s+(\d+)", fresh.stdout, re.M).group(1)])
