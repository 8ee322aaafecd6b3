"""Wait for jobs to end (`submit --wait`, the doctor job) and the exit status they leave."""
from __future__ import annotations

import time
from typing import Callable

from hpcgpu.launch.executors import refresh
from hpcgpu.launch.failures import FAILED_STATES
from hpcgpu.launch.registry import JobRecord, Registry, units_of
from hpcgpu.launch.state import REVIVABLE, is_final


def describe(job: JobRecord) -> str:
    if job.is_array:
        counts: dict[str, int] = {}
        for t in job.tasks:
            counts[t.state] = counts.get(t.state, 0) + 1
        return f"{job.state} ({', '.join(f'{n} {s}' for s, n in counts.items())})"
    says_why = job.state in ("PENDING", "REQUEUED") or job.state in FAILED_STATES
    detail = job.reason if says_why and job.reason else job.nodes
    return f"{job.state} ({detail})" if detail else job.state


def wait_for(registry: Registry, jobs: list[JobRecord], say: Callable[[str], None],
             first_poll_s: float = 1.0, max_poll_s: float = 10.0, revive_wait_s: float = 60.0) -> list[JobRecord]:
    """Refresh until every job is final, saying each change of state; one squeue call per round."""
    poll = first_poll_s
    last: dict[str, str] = {}
    settled_since: dict[str, float] = {}
    while True:
        refresh(registry, jobs)
        now = time.monotonic()
        for job in jobs:
            text = describe(job)
            if last.get(job.job_id) != text:
                say(f"job {job.job_id}: {text}")
                last[job.job_id] = text
                settled_since.pop(job.job_id, None)
            if is_final(job.state):
                settled_since.setdefault(job.job_id, now)
        # a revivable end (PREEMPTED, NODE_FAIL) counts once no requeue followed for a while
        if all(j.job_id in settled_since and (not any(u.state in REVIVABLE for u in units_of(j))
                                              or now - settled_since[j.job_id] >= revive_wait_s)
               for j in jobs):
            return jobs
        time.sleep(poll)
        poll = min(max_poll_s, poll * 1.5)


def exit_status(jobs: list[JobRecord]) -> int:
    """0 when every job (every array task) completed; else the first failure's exit code, or 1. The
    code of the rank that failed first where status knows it (as the local executor returns it), not
    the batch step's: that is often 143, a rank srun ended after another failed."""
    for job in jobs:
        for unit in units_of(job):
            if unit.state != "COMPLETED":
                failed = (unit.failure or {}).get("exit_code")
                return failed if isinstance(failed, int) and failed else unit.exit_code or 1
    return 0
