"""Training through generated sbatch files on the real cluster, and preemption that costs nothing."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from resumes import assert_resumed
from wandb_files import wandb_history

pytestmark = pytest.mark.slurm


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key].equal(wb[key]), f"{key} differs"


# States in which a process of the job may still run (scontrol shows COMPLETING, not CANCELLED, while
# any step or the batch script of a cancelled job is still ending)
NOT_SETTLED = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "RESIZING", "STAGE_OUT"}


def wait_settled(slurm, job: str, timeout: float = 120) -> dict[str, str]:
    """The controller's view of a job once no process of it is left.

    This is the event that proves "not requeued", instead of sleeping for as long as a requeue might
    take: only a process of the job requeues it (rank 0 runs `scontrol requeue`, which returns once the
    controller has done it, and logs its decision), and scancel marks a job CANCELLED *and* COMPLETING
    at once; the COMPLETING flag, which scontrol shows as the state, clears only when slurmd reports the
    batch script and every step ended. So once the state is neither running nor completing, a requeue
    either already happened (Restarts > 0, the job PENDING again) or can no longer happen.
    """
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = slurm.job(job)
        if info.get("JobState") and info["JobState"] not in NOT_SETTLED:
            return info
        time.sleep(0.2)
    raise AssertionError(f"job {job} still had processes after {timeout}s: {info}")


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
    # W&B offline too: the stop closes it before the requeue's SIGTERM reaches its helper process
    doc["track"] = {"wandb": {"project": "hpcgpu-tests"}, "every_steps": 5}
    doc["env"] = {f"WANDB_{name}_DIR": str(slurm.tmp / f"wandb-{name.lower()}") for name in ("CONFIG", "CACHE", "DATA")}
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
    assert_resumed(run_dir)
    assert "requeued job" in out

    # the interrupted-and-resumed run is the uninterrupted one, bit for bit (CPU)
    assert slurm.loss_log(run_dir) == slurm.loss_log(baseline)
    assert_same_weights(run_dir, baseline)

    # W&B has every tracked step once: the interrupted job's up to its stop, the resumed job's after it
    first, second = (wandb_history(f) for f in sorted(run_dir.glob("wandb/offline-run-*/*.wandb")))
    tracked = [1, *range(5, 121, 5)]
    assert [row["_step"] for row in first] == [s for s in tracked if s <= stop["step"]], out
    assert [row["_step"] for row in first + second] == tracked
    assert "Traceback" not in out


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
    info = wait_settled(slurm, job, timeout=180)  # no process of the job left to requeue it
    out = slurm.job_output(run_dir, job)
    assert info["Restarts"] == "1", info  # not requeued a second time
    assert info["JobState"] != "COMPLETED"  # it stopped at a checkpoint, it did not finish
    assert "requeue cap reached" in out
    stops = [r for r in slurm.metrics(run_dir) if r["kind"] == "stop"]
    assert len(stops) == 2 and not (run_dir / "FINISHED").exists()
    # what `hpcgpu status` advises for such a job: requeued by hand, it goes on from its last checkpoint
    subprocess.run(["scontrol", "requeue", job], check=True)
    slurm.wait_for(lambda: restarts_seen() == 2, timeout=180, what="the job requeued by hand to resume")
    resumes = assert_resumed(run_dir, restarts=2)
    assert [r["restart_count"] for r in resumes] == [1, 2] and resumes[-1]["step"] == stops[-1]["step"]
    subprocess.run(["scancel", job], check=True)
    wait_settled(slurm, job, timeout=180)
    assert (run_dir / "checkpoints" / f"step-{stops[-1]['step']:08d}" / "COMPLETE").exists()


def test_plain_scancel_is_not_taken_for_a_preemption(slurm):
    """scancel sends SIGTERM, which also means 'checkpoint and stop'; a cancelled job must stay cancelled."""
    spec = slurm.write_spec(slurm.tiny_train(max_steps=5000, log_every=5))
    script, run_dir = slurm.render(spec)
    job = slurm.sbatch(script)
    slurm.wait_for(lambda: len(slurm.loss_log(run_dir)) >= 3, timeout=180, what="first steps")
    subprocess.run(["scancel", job], check=True)
    info = wait_settled(slurm, job)  # no process of the job left: a requeue would show by now
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), info
    assert "the job is being cancelled; not requeuing" in slurm.job_output(run_dir, job)  # rank 0's decision


def test_an_fsdp_run_preempted_on_slurm_goes_on_from_its_shards_bit_for_bit(slurm):
    """distributed.strategy: fsdp under srun: the stop signal's checkpoint is sharded (each rank writes
    its part), the requeued job loads it, and the run equals the uninterrupted one (CPU ranks, fp32)."""
    doc = slurm.tiny_train(max_steps=60)
    doc["model"]["config"]["n_layer"] = 2
    doc["distributed"] = {"strategy": "fsdp"}
    spec = slurm.write_spec(doc)
    baseline = run_local(slurm, spec)

    script, run_dir = slurm.render(spec)
    job = slurm.sbatch(script)
    slurm.wait_for(lambda: len(slurm.loss_log(run_dir)) >= 10, timeout=180, what="10 logged steps")
    subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True)
    info = slurm.wait(job, timeout=300, states={"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    out = slurm.job_output(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    stop, resume = (r for r in slurm.metrics(run_dir) if r["kind"] in ("stop", "resume"))
    assert resume["step"] == stop["step"] >= 10 and "fsdp: 2 block(s) and the root sharded over 2 rank(s)" in out
    assert_resumed(run_dir)
    assert slurm.loss_log(run_dir) == slurm.loss_log(baseline)
    assert_same_weights(run_dir, baseline)
