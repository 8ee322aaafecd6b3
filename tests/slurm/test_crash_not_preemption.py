"""On the real cluster: a crashing rank is a crash (FAILED, never requeued as a preemption), and a
preemption signal that comes while the job is starting is acted on, not fatal."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hpcgpu.contract import first_failure
from test_train_and_preempt import wait_settled

pytestmark = pytest.mark.slurm

# rank 1 fails one second in; rank 0 would run for a minute (srun's teardown SIGTERMs it)
CRASHES = {
    "raises": "raise SystemExit(3)",
    "killed": "os.kill(os.getpid(), signal.SIGKILL)",
}


@pytest.mark.parametrize("how", sorted(CRASHES))
def test_a_crashing_rank_is_a_crash_not_a_preemption(slurm, how: str) -> None:
    program = ("import os, signal, time\n"
               "if os.environ['RANK'] == '1':\n"
               f"    time.sleep(1); {CRASHES[how]}\n"
               "time.sleep(60)\n")
    spec = slurm.write_spec({"name": f"crash-{how}", "task": "command", "command": [sys.executable, "-c", program],
                             "resources": {"gpus": 2, "cpus_per_gpu": 1, "time": "00:05:00"}})
    script, run_dir = slurm.render(spec)
    job = slurm.sbatch(script)
    info = slurm.wait(job, timeout=120)
    out = slurm.job_output(run_dir, job)
    assert info["JobState"] == "FAILED", out
    info = wait_settled(slurm, job)  # no process of the job left that could requeue it
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", out
    assert "requeued job" not in out and "preempted" not in out, out
    assert "a crash, not a preemption" in out
    failure = first_failure(run_dir)
    assert failure is not None and failure.rank == 1
    assert failure.exit_code == (3 if how == "raises" else 128 + 9)


def test_a_preemption_signal_while_starting_requeues_and_the_run_completes(slurm) -> None:
    """USR2 lands while the ranks import torch and build the model, on the first run and the next."""
    doc = slurm.tiny_train(max_steps=6)
    spec = slurm.write_spec(doc)
    script, run_dir = slurm.render(spec)
    job = slurm.sbatch(script)
    for restart in ("0", "1"):
        slurm.wait_for(lambda: slurm.job(job).get("JobState") == "RUNNING"
                       and slurm.job(job).get("Restarts") == restart, timeout=120, what=f"run {restart}")
        time.sleep(1.5)  # the ranks are importing torch and transformers
        subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True)
        slurm.wait_for(lambda: slurm.job(job).get("Restarts") != restart or slurm.job(job).get("JobState")
                       in ("COMPLETED", "FAILED"), timeout=120, what=f"the requeue of run {restart}")
    info = slurm.wait(job, timeout=240)
    out = slurm.job_output(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", out
    stops = [r for r in slurm.metrics(run_dir) if r["kind"] == "stop"]
    assert [s["restart_count"] for s in stops] == [0, 1], out
    assert max(slurm.loss_log(run_dir)) == 6


def test_scontrol_requeue_is_reported_as_a_requeue(slurm) -> None:
    spec = slurm.write_spec({"name": "outside", "task": "command", "command": [sys.executable, "-c",
                             "import time; print('PROGRAM-UP', flush=True); time.sleep(120)"],
                             "resources": {"gpus": 2, "cpus_per_gpu": 1}})
    script, run_dir = slurm.render(spec)
    job = slurm.sbatch(script)
    try:
        slurm.wait_for(lambda: "slurm" in "".join(p.name for p in run_dir.glob("slurm-*.out"))
                       and slurm.job(job).get("JobState") == "RUNNING", timeout=60, what="the job to run")
        # both ranks run the program: their wrappers are past start-up, watching for a requeue
        slurm.wait_for(lambda: slurm.job_output(run_dir, job).count("PROGRAM-UP") == 2, timeout=60,
                       what="the program on both ranks")
        subprocess.run(["scontrol", "requeue", job], check=True)
        slurm.wait_for(lambda: "requeued from outside" in slurm.job_output(run_dir, job), timeout=60,
                       what="rank 0 to report the requeue")
        out = slurm.job_output(run_dir, job)
        assert "not requeuing again" in out and "cancelled" not in out and "preempted" not in out, out
        assert slurm.job(job)["Restarts"] == "1"
    finally:
        subprocess.run(["scancel", job])


def test_a_program_that_does_not_stop_after_the_signal_is_ended_and_the_job_requeued(slurm) -> None:
    """A program that catches the stop signal and never ends (Lightning's handler stuck in its barrier
    is one) is ended by hpcgpu before SLURM's kill (slurm.signal's lead less a margin): the job requeues
    instead of running into its time limit, and the next run goes on."""
    program = ("import os, signal, time\n"
               "if os.environ.get('SLURM_RESTART_COUNT', '0') == '0':\n"
               "    signal.signal(signal.SIGUSR2, lambda *_: print('caught the signal, and stuck', flush=True))\n"
               "    print('handler set', flush=True)\n"
               "    time.sleep(300)\n"
               "print('the next run ends', flush=True)\n")
    spec = slurm.write_spec({"name": "stuck", "task": "command", "command": [sys.executable, "-c", program],
                             "resources": {"gpus": 2, "cpus_per_gpu": 1, "time": "00:10:00"},
                             "slurm": {"signal": "USR2@16"}})  # 12 s for the program after the signal
    script, run_dir = slurm.render(spec)
    job = slurm.sbatch(script)
    # under load a rank may take seconds to start: signal once both programs hold their handler
    slurm.wait_for(lambda: slurm.job_output(run_dir, job).count("handler set") == 2, timeout=90,
                   what="both programs to set their handler")
    signalled = time.monotonic()
    subprocess.run(["scancel", "--signal=USR2", "--batch", job], check=True)
    info = slurm.wait(job, timeout=120)
    out = slurm.job_output(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    assert time.monotonic() - signalled < 100, out
    assert out.count("caught the signal, and stuck") == 2 and out.count("the next run ends") == 2, out
    # the first wrapper to end its program requeues, and SLURM's teardown of the step may end the
    # other rank's program before its own wrapper's allowance is up
    assert "rank 0: the program is still running 12s after the stop signal (SIGUSR2)" in out \
        or "rank 1: the program is still running 12s after the stop signal (SIGUSR2)" in out, out
    assert "requeued job" in out and "a crash" not in out, out
