"""Preemption of framework scripts run as `task: command` on the real cluster (issue 34): a Hugging
Face Trainer script (no signal handler of its own: the spec's USR2 ends it, hpcgpu requeues, it
resumes from its last `save_steps` checkpoint) and a torchrun-style script stopping through
`hpcgpu.init().should_stop()` / `ctx.stop()` (a checkpoint at the step it stopped, resumed with
`ctx.resume()`). Each: 1 node x 2 ranks, `scancel --signal=USR2 --full` a few steps in, one requeue,
the second run resumes from the first one's checkpoint and completes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from resumes import assert_resumed

pytestmark = pytest.mark.slurm

FRAMEWORKS = Path(__file__).resolve().parents[1] / "unit" / "fixtures" / "frameworks"
PREEMPTED = "preempted (SLURM's preemption signal or `scancel --signal`)"  # runtime/requeue.py STOP_WORDS


def command_spec(name: str, folder: str, out: Path, **env: str) -> dict:
    return {"name": name, "task": "command", "command": [sys.executable, str(FRAMEWORKS / folder / "train.py")],
            "resources": {"gpus": 2, "cpus_per_gpu": 1, "time": "00:10:00"},
            "env": {"OUT": str(out), **env}}


def sbatch_in(folder: Path, script: Path) -> str:
    """The job runs in `folder` (a script may write into its working directory; not the repository)."""
    proc = subprocess.run(["sbatch", "--parsable", f"--chdir={folder}", str(script)], capture_output=True,
                          text=True, timeout=30, check=True)
    return proc.stdout.strip().split(";")[0]


def records(out: Path, run: int) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"rank*-run{run}.json"))]


def preempt_and_finish(slurm, job: str, run_dir: Path) -> str:
    """USR2 to the batch script and every rank now (as a preemption sends it); -> the job's output once
    the requeued job has ended, after asserting it COMPLETED with one requeue."""
    subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True)
    info = slurm.wait(job, timeout=180, states={"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    out = slurm.job_output(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    assert PREEMPTED in out, out
    assert out.count("requeued job") == 1, out  # rank 0 requeued once; nothing requeued it twice
    assert "a crash, not a preemption" not in out, out
    view = slurm.status(job)
    assert view["state"] == "COMPLETED", view
    return out


def test_a_preempted_hf_trainer_script_resumes_from_its_last_save(slurm) -> None:
    """The Trainer has no handler for USR2: it dies of it (exit 140), hpcgpu counts that as the
    preemption it was, requeues, and the script's own get_last_checkpoint() resumes it."""
    doc = command_spec("hfpre", "hf_trainer", slurm.tmp, MAX_STEPS="30", SAVE_STEPS="5", STEP_S="0.2")
    script, run_dir = slurm.render(slurm.write_spec(doc))
    job = sbatch_in(slurm.tmp, script)
    first = run_dir / "out" / "checkpoint-5"
    # signal just after the first save is complete (trainer_state.json is written last, by rank 0), well
    # before the next one: the Trainer writes its checkpoints in place, and one cut short is not resumable
    slurm.wait_for(lambda: (first / "trainer_state.json").exists() and (first / "rng_state_1.pth").exists(),
                   timeout=120, what="the Trainer's first checkpoint")
    out = preempt_and_finish(slurm, job, run_dir)
    stopped = records(slurm.tmp, 0)
    assert [r["world_size"] for r in stopped] == [2, 2], out
    assert all(r["start_step"] == 0 and r["resumed_from"] is None for r in stopped), stopped
    assert all(r["end_step"] is None for r in stopped), f"the first run was to be stopped: {stopped}"
    again = records(slurm.tmp, 1)
    assert [r["world_size"] for r in again] == [2, 2], out
    saved = sorted(int(p.name.split("-")[1]) for p in (run_dir / "out").glob("checkpoint-*"))
    for r in again:
        assert r["resumed_from"] and Path(r["resumed_from"]).parent == run_dir / "out", again
        resumed = int(Path(r["resumed_from"]).name.split("-")[1])
        assert resumed >= 5 and r["start_step"] == resumed, again  # from its checkpoint, not from step 0
        assert r["end_step"] == 30, again
    assert saved[-1] == 30, saved


def test_a_preempted_torchrun_script_stops_through_the_context_and_resumes(slurm) -> None:
    """The script's `ctx.should_stop()` sees the signal; every rank stops at one step through
    `ctx.stop()` (checkpoint, exit 75); the requeued run's `ctx.resume()` starts at that step."""
    doc = command_spec("ctxpre", "torchrun_ctx", slurm.tmp, MAX_STEPS="40", SAVE_EVERY="10", STEP_S="0.2")
    script, run_dir = slurm.render(slurm.write_spec(doc))
    job = sbatch_in(slurm.tmp, script)
    slurm.wait_for(lambda: any(r["kind"] == "train" and r["step"] >= 3 for r in slurm.metrics(run_dir)),
                   timeout=120, what="a few steps")
    out = preempt_and_finish(slurm, job, run_dir)
    stopped = records(slurm.tmp, 0)
    assert [r["world_size"] for r in stopped] == [2, 2], out
    assert all(r["start_step"] == 0 and r["end_step"] is None for r in stopped), stopped
    at = stopped[0]["stopped_at"]
    assert at is not None and 3 <= at < 40 and stopped[1]["stopped_at"] == at, stopped  # one step, every rank
    assert [r["exit_code"] for r in stopped] == [75, 75], stopped  # ctx.stop's code, the program's exit
    assert f"checkpoint step-{at:08d} saved" in out, out  # by ctx.stop (checkpoint.keep prunes it later)
    assert f"resuming at step {at} from step-{at:08d}" in out, out
    again = records(slurm.tmp, 1)
    assert [r["world_size"] for r in again] == [2, 2], out
    assert all(r["start_step"] == at and r["end_step"] == 40 for r in again), again  # resumed at the stop
    assert all(r["checkpoint_dir"] == str(run_dir / "checkpoints") for r in again), again
    metrics = slurm.metrics(run_dir)
    assert [(r["step"], r["restart_count"]) for r in metrics if r["kind"] == "stop"] == [(at, 0)], metrics
    assert [(r["step"], r["restart_count"]) for r in metrics if r["kind"] == "resume"] == [(at, 1)], metrics
    assert_resumed(run_dir)
    assert max(slurm.loss_log(run_dir)) == 40
