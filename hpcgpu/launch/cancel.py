"""Cancel a job: scancel a SLURM job or array task, or stop a local job's executor (each executor's
`cancel` in hpcgpu/launch/executors.py calls its own)."""
from __future__ import annotations

import os
import signal

from hpcgpu.errors import HpcgpuError
from hpcgpu.launch.failures import FailureOf
from hpcgpu.launch.liveness import executor_alive
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.scheduler import cancel_jobs
from hpcgpu.launch.state import is_final, refresh_local_jobs


def scancel(job: JobRecord, task: TaskRecord | None, ref: str) -> str:
    """Cancel a SLURM job or array task (scancel) unless it ended already."""
    if is_final(task.state if task else job.state):
        return f"{ref} already ended ({task.state if task else job.state})"
    cancel_jobs([ref])
    return f"cancelled {ref}"


def stop_local(registry: Registry, job: JobRecord, ref: str, failure_of: FailureOf) -> str:
    """Stop a local job: its executor stops the ranks (a second cancel kills them); one that ended
    already is refreshed (a FAILED one given its reason by `failure_of`)."""
    if is_final(job.state) or not executor_alive(job):
        refresh_local_jobs(registry, [job], failure_of)
        return f"{ref} is not running ({job.state})"
    again = job.cancel_requested
    registry.update(job, cancel_requested=True)
    assert job.pid is not None
    # The executor treats SIGTERM like Ctrl-C: every rank (each in its own session, so not in the
    # executor's process group) gets the stop signal, checkpoints and exits; after a grace period
    # the executor kills what is left. Only its pid is signalled: its process group may hold the
    # user's pipeline (`| tee log`), which must keep reading until the ranks are down.
    try:
        os.kill(job.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        raise HpcgpuError(f"{ref}: the local executor (pid {job.pid}) belongs to another user") from None
    if again:  # the executor takes a second signal as a second Ctrl-C
        return f"cancelling {ref} again: the local executor (pid {job.pid}) kills its ranks now"
    return f"cancelling {ref}: the local executor (pid {job.pid}) is stopping its ranks (cancel again to kill)"
