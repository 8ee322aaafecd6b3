"""Whether a local job still lives: its executor process (by pid and start time), or a rank holding its run dir."""
from __future__ import annotations

import os
from pathlib import Path

from hpcgpu.launch.registry import JobRecord
from hpcgpu.launch.runlock import is_locked


def process_start(pid: int) -> str | None:
    """The kernel's start time of a process (Linux), so a reused pid is never taken for ours."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the "(comm)" field


def run_dir_held(job: JobRecord) -> bool:
    """A process of the job (a rank) still holds its run dir lock: the job runs on without its
    launcher, so it has not failed (yet)."""
    return any(is_locked(Path(d)) for d in (job.run_dir, *(t.run_dir for t in job.tasks)))


def executor_alive(job: JobRecord) -> bool:
    if not job.pid:
        return False
    try:
        os.kill(job.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    start = process_start(job.pid)
    return start is None or job.pid_start is None or start == job.pid_start
