"""Cancel a job: scancel a SLURM job or array task, or stop a local job's executor (each executor's
`cancel` in hpcgpu/launch/executors.py calls its own). A cancel stops a running job at its next
checkpoint first (train and infer save one; a command's program gets the stop signal); `now` skips it."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import yaml

from hpcgpu.contract import RunPaths
from hpcgpu.errors import HpcgpuError
from hpcgpu.launch.failures import FailureOf
from hpcgpu.launch.liveness import executor_alive
from hpcgpu.launch.local import KILL_NOW_SIGNAL
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.scheduler import cancel_jobs
from hpcgpu.launch.state import is_final, refresh_local_jobs

WAITING_STATES = frozenset({"PENDING", "REQUEUED"})


def ended_text(ref: str, state: str) -> str:
    """One wording, every executor: the job had ended before the cancel."""
    return f"{ref} already ended ({state})"


def stop_text(ref: str, run_dir: str) -> str:
    """What the cancel asks of a running job: a checkpoint first, where its task takes one."""
    try:
        task = (yaml.safe_load(RunPaths(Path(run_dir)).spec.read_text()) or {}).get("task")
    except (OSError, yaml.YAMLError, AttributeError):
        task = None
    how = "its program gets the stop signal" if task in ("command", "callable") else \
        "it stops at its next checkpoint"
    return f"asked {ref} to stop: {how}; `hpcgpu cancel --now {ref}` stops it without one"


def scancel(job: JobRecord, task: TaskRecord | None, ref: str, now: bool = False) -> str:
    """Cancel a SLURM job or array task (scancel) unless it ended already."""
    unit = task or job
    if is_final(unit.state):
        return ended_text(ref, unit.state)
    cancel_jobs([ref], now=now)
    if unit.state in WAITING_STATES:
        return f"cancelled {ref} (it had not started: nothing to save)"
    return f"cancelled {ref} now, without a checkpoint" if now else stop_text(ref, unit.run_dir)


def stop_local(registry: Registry, job: JobRecord, ref: str, failure_of: FailureOf, now: bool = False) -> str:
    """Stop a local job: its executor stops the ranks at a checkpoint; a second cancel, or `now`, has it
    kill them at once. One that ended already is refreshed (a FAILED one given its reason by `failure_of`)."""
    if is_final(job.state) or not executor_alive(job):
        refresh_local_jobs(registry, [job], failure_of)
        return ended_text(ref, job.state)
    kill = now or job.cancel_requested
    registry.update(job, cancel_requested=True)
    assert job.pid is not None
    # The executor treats SIGTERM like Ctrl-C: every rank (each in its own session, so not in the
    # executor's process group) gets the stop signal, checkpoints and exits; after a grace period
    # the executor kills what is left. KILL_NOW_SIGNAL has it kill them at once (a plain second SIGTERM
    # within a moment of the first would be taken for a copy of it). Only its pid is signalled: its
    # process group may hold the user's pipeline (`| tee log`), which must keep reading until the ranks are down.
    try:
        os.kill(job.pid, KILL_NOW_SIGNAL if kill else signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        raise HpcgpuError(f"{ref}: the local executor (pid {job.pid}) belongs to another user") from None
    if kill:
        return f"killing {ref}'s ranks now, without a checkpoint (the local executor, pid {job.pid})"
    return stop_text(ref, job.run_dir)
