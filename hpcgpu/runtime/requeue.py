"""After an agreed stop: tell timeout from preemption, requeue (capped), pick the documented exit code.

Exit codes of `hpcgpu run` (every rank):
    0   finished (or already finished earlier: a finished run never trains or requeues again)
    75  stopped at a checkpoint after a preemption/timeout signal or Ctrl-C; run again (or the
        requeued job) resumes from it
    other  the task failed
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from hpcgpu.hostlist import scontrol_fields
from hpcgpu.contract import ENV_JOB_START, Failure, attempt_id, batch_signals, read_failures, write_finished
from hpcgpu.runtime.env import DistEnv
from hpcgpu.spec import Spec
from hpcgpu.spec.derive import signal_lead_s, signal_name, time_limit_s

log = logging.getLogger("hpcgpu")

TIMEOUT_MARGIN_S = 60


def job_elapsed_s(now: float | None = None) -> float | None:
    start = os.environ.get(ENV_JOB_START)
    if not start or not start.isdigit():
        return None
    return (now or time.time()) - int(start)


def stop_reason(spec: Spec, env: DistEnv) -> str:
    """Why the job stops, as it was: 'timeout' (the time limit is near), 'requeued' (`scontrol
    requeue` or SLURM's own preemption requeue already put it back), 'cancelled' (scancel),
    'preempted' (any other stop signal: SLURM's preemption, `scancel --signal`), 'interrupted' (local).
    Only rank 0 asks the controller; the others say 'preempted' or 'timeout'."""
    if env.launcher.stops_are_interrupts:
        return "interrupted"
    elapsed = job_elapsed_s()
    if elapsed is not None and elapsed >= time_limit_s(spec) - signal_lead_s(spec) - TIMEOUT_MARGIN_S:
        return "timeout"
    if env.launcher.controller and env.is_main and env.requeue_target:
        state, restarts = job_view(env.requeue_target)
        if restarts is not None and restarts > env.restart_count:
            return "requeued"
        if state in ("CANCELLED", "COMPLETING"):
            # scancel sends SIGTERM too: the job shows COMPLETING (then CANCELLED) while it ends,
            # whereas a preemption or time-limit signal comes while it is RUNNING
            return "cancelled"
    return "preempted"


STOP_WORDS = {
    "timeout": "timeout (the time limit is near)",
    "requeued": "requeued from outside (`scontrol requeue` or SLURM's preemption requeue)",
    "cancelled": "cancelled (scancel)",
    "preempted": "preempted (SLURM's preemption signal or `scancel --signal`)",
    "interrupted": "interrupted (Ctrl-C, SIGTERM or hpcgpu cancel)",
}


def describe_stop(reason: str) -> str:
    return STOP_WORDS.get(reason, reason)


class TornDown(Exception):
    """This rank was stopped because another one failed: reported as that crash, never requeued as a
    preemption."""

    def __init__(self, why: str, code: int):
        super().__init__(why)
        self.why, self.code = why, code


TEARDOWN_WAIT_S = 5.0  # how long a SIGTERM'd rank looks for proof that it was a real stop


def peer_failure(env: DistEnv, run_dir: Path) -> Failure | None:
    """The first failure another rank of this attempt recorded (None if none did)."""
    return next((f for f in read_failures(run_dir, attempt_id()) if f.rank != env.rank), None)


def torn_down_by(spec: Spec, env: DistEnv, signum: int | None, run_dir: Path,
                 wait_s: float = TEARDOWN_WAIT_S) -> str | None:
    """Why a SIGTERM that stopped this rank was not a stop but a crash elsewhere; None for a real stop.

    srun --kill-on-bad-exit (and the local executor) SIGTERM the other ranks once one fails; SLURM
    sends the same SIGTERM on a preemption, a time limit or scancel. Told apart by: a failure another
    rank recorded before it exited; and, under hpcgpu's batch script, whether the script got a stop
    signal too (SLURM signals it, srun's teardown does not). The spec's own signal is always a stop.
    """
    if signum != signal.SIGTERM:
        return None
    deadline = time.monotonic() + wait_s
    shell_sees_stops = env.launcher.controller and ENV_JOB_START in os.environ \
        and signal_name(spec) != "TERM"
    while True:
        failure = peer_failure(env, run_dir)
        if failure is not None:
            return failure.describe()
        if not shell_sees_stops or batch_signals(run_dir):
            return None
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    state, restarts = job_view(env.requeue_target or "")
    if state in ("CANCELLED", "COMPLETING") or (restarts or 0) > env.restart_count:
        return None  # scancel or scontrol requeue: reported as such by stop_reason()
    return "another task of the step failed (srun ended the step; no stop signal reached the batch script)"


def requeue(env: DistEnv, spec: Spec, reason: str) -> bool:
    """Rank 0 asks SLURM to requeue this job (array task aware), unless capped. True if requeued."""
    if not env.launcher.controller or not env.is_main:
        return False
    if reason == "requeued":
        log.info(f"{describe_stop(reason)}: it comes back on its own; not requeuing again")
        return False
    if reason == "cancelled":
        log.info(f"{describe_stop(reason)}: the job is being cancelled; not requeuing")
        return False
    if not spec.slurm.requeue:
        log.warning(f"{reason}: slurm.requeue is false; not requeuing")
        return False
    if env.restart_count >= spec.slurm.max_requeues:
        log.warning(f"{reason}: requeue cap reached ({env.restart_count} of slurm.max_requeues="
                    f"{spec.slurm.max_requeues}); not requeuing")
        return False
    target = env.requeue_target
    if not target:
        return False
    proc = subprocess.run(["scontrol", "requeue", target], capture_output=True, text=True)
    if proc.returncode != 0:
        log.warning(f"{reason}: `scontrol requeue {target}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
        return False
    log.info(f"{reason}: requeued job {target} (restart {env.restart_count + 1} of at most "
             f"{spec.slurm.max_requeues})")
    return True


def job_view(target: str) -> tuple[str | None, int | None]:
    """(state, restarts) as the controller sees the job now; None where it cannot be read."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", target], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    fields = scontrol_fields(out)
    restarts = fields.get("Restarts", "")
    return fields.get("JobState"), int(restarts) if restarts.isdigit() else None


def crash_retries_file(run_dir: Path) -> Path:
    return run_dir / "crash-retries"


def requeue_after_crash(env: DistEnv, spec: Spec, run_dir: Path) -> bool:
    """A crash is requeued only when the spec asks (slurm.max_retries), and at most that often."""
    if spec.slurm.max_retries <= 0 or not env.launcher.controller or not env.is_main:
        return False
    path = crash_retries_file(run_dir)
    used = int(path.read_text()) if path.exists() and path.read_text().strip().isdigit() else 0
    if used >= spec.slurm.max_retries:
        log.warning(f"crash: retry cap reached ({used} of slurm.max_retries={spec.slurm.max_retries})")
        return False
    path.write_text(f"{used + 1}\n")
    return requeue(env, spec, f"crash (retry {used + 1} of {spec.slurm.max_retries})")


def mark_finished(run_dir: Path, env: DistEnv) -> None:
    if env.is_main:
        write_finished(run_dir)
