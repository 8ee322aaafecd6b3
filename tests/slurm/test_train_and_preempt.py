"""Training through generated sbatch files on the real cluster, and preemption that costs nothing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key].equal(wb[key]), f"{key} differs"


def run_local(slurm, spec: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", "--new"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stderr.split("run dir ")[1].split()[0])


def test_train_two_ranks_through_sbatch(slurm):
    spec = slurm.write_spec(slurm.tiny_train(max_steps=20))
    script, run_dir = slurm.render(spec, "--gpus", "2")
    job = slurm.sbatch(script)
    info = slurm.wait(job, timeout=300)
    assert info["JobState"] == "COMPLETED", slurm.job_output(run_dir, job)
    losses = slurm.loss_log(run_dir)
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1] - 0.5
    assert (run_dir / "model" / "model.safetensors").exists()
    assert (run_dir / "FINISHED").exists()
    out = slurm.job_output(run_dir, job)
    assert "x 2 ranks" in out and "ddp" in out


def test_preempt_signal_requeue_resume_equals_uninterrupted(slurm):
    doc = slurm.tiny_train(max_steps=120)
    doc["checkpoint"] = {"every_steps": 50, "keep": 2}
    spec = slurm.write_spec(doc)
    baseline = run_local(slurm, spec)

    script, run_dir = slurm.render(spec)
    job = slurm.sbatch(script)
    slurm.wait_for(lambda: len(slurm.loss_log(run_dir)) >= 15, timeout=180, what="15 logged steps")
    subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True)
    info = slurm.wait(job, timeout=300, states={"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    out = slurm.job_output(run_dir, job)
    assert info["JobState"] == "COMPLETED", out
    assert info["Restarts"] == "1"

    events = [r for r in slurm.metrics(run_dir) if r["kind"] in ("stop", "resume", "end")]
    stop, resume, end = events
    assert stop["kind"] == "stop" and stop["reason"] == "preempted" and stop["restart_count"] == 0
    assert resume["kind"] == "resume" and resume["restart_count"] == 1  # SLURM_RESTART_COUNT=1
    assert resume["step"] == stop["step"] >= 15 and resume["checkpoint"] == f"step-{stop['step']:08d}"
    assert end["step"] == 120
    assert "requeued job" in out

    # the interrupted-and-resumed run is the uninterrupted one, bit for bit (CPU)
    assert slurm.loss_log(run_dir) == slurm.loss_log(baseline)
    assert_same_weights(run_dir, baseline)


def test_requeue_cap_stops_a_job_signalled_over_and_over(slurm):
    doc = slurm.tiny_train(max_steps=5000, log_every=5)
    doc["slurm"] = {"max_requeues": 1}
    spec = slurm.write_spec(doc)
    script, run_dir = slurm.render(spec)
    job = slurm.sbatch(script)

    def restarts_seen() -> int:
        return sum(1 for r in slurm.metrics(run_dir) if r["kind"] == "resume")

    slurm.wait_for(lambda: len(slurm.loss_log(run_dir)) >= 3, timeout=180, what="first steps")
    subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True)
    slurm.wait_for(lambda: restarts_seen() == 1, timeout=180, what="the requeued job to resume")
    slurm.wait_for(lambda: max(slurm.loss_log(run_dir)) > max(
        r["step"] for r in slurm.metrics(run_dir) if r["kind"] == "resume"), timeout=120, what="a step after resume")
    subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True)
    info = slurm.wait(job, timeout=180)
    out = slurm.job_output(run_dir, job)
    assert info["Restarts"] == "1"  # not requeued a second time
    assert info["JobState"] != "COMPLETED"  # it stopped at a checkpoint, it did not finish
    assert "requeue cap reached" in out
    stops = [r for r in slurm.metrics(run_dir) if r["kind"] == "stop"]
    assert len(stops) == 2 and not (run_dir / "FINISHED").exists()
    assert (run_dir / "checkpoints" / f"step-{stops[-1]['step']:08d}" / "COMPLETE").exists()


def test_plain_scancel_is_not_taken_for_a_preemption(slurm):
    """scancel sends SIGTERM, which also means 'checkpoint and stop'; a cancelled job must stay cancelled."""
    spec = slurm.write_spec(slurm.tiny_train(max_steps=5000, log_every=5))
    script, run_dir = slurm.render(spec)
    job = slurm.sbatch(script)
    slurm.wait_for(lambda: len(slurm.loss_log(run_dir)) >= 3, timeout=180, what="first steps")
    subprocess.run(["scancel", job], check=True)
    info = slurm.wait(job, timeout=120)
    assert info["JobState"] == "CANCELLED"
    import time

    time.sleep(15)  # a requeued job would be back by now (cred_expire 10 s + sched_interval 2 s)
    info = slurm.job(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0"
    assert "not requeuing" in slurm.job_output(run_dir, job)
