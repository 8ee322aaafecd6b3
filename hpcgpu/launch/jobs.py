"""A job's life after submission: refresh states from the scheduler, read progress, cancel.

A refresh asks SLURM once for all the jobs it is given that are not final yet (one squeue call),
and the local executor's jobs by their process; final states are never asked again.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Sequence
from pathlib import Path

from hpcgpu.errors import HpcgpuError
from hpcgpu.launch.exitcodes import is_finished
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.scheduler import FINAL_STATES, JobInfo, cancel_jobs, knows_job, parse_duration, query_jobs

ACTIVE_ORDER = ("RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "PENDING", "SUSPENDED")
# Final in SLURM's words, yet SLURM (PreemptMode=REQUEUE, a node coming back) or our own rank 0 may
# requeue the job right after: asked again while the controller still knows the job.
REVIVABLE = frozenset({"PREEMPTED", "NODE_FAIL"})
REVIVE_WINDOW_S = 3600


def is_final(state: str) -> bool:
    return state in FINAL_STATES


def shown_state(info: JobInfo) -> str:
    """SLURM's state, except that a job waiting again after a requeue says so."""
    if info.state.startswith("REQUEUE") or (info.state == "PENDING" and info.restarts > 0):
        return "REQUEUED"
    return info.state


def _apply(target: JobRecord | TaskRecord, info: JobInfo) -> None:
    target.state = shown_state(info)
    target.reason = info.reason if info.state in ("PENDING", "REQUEUED") or target.state == "REQUEUED" else ""
    target.elapsed = info.elapsed
    target.nodes = info.nodes or target.nodes
    target.restarts = info.restarts
    target.exit_code = info.exit_code


def array_state(tasks: list[TaskRecord]) -> str:
    """One state for an array: the most active one while any task runs or waits, else COMPLETED when
    every task completed, else the first way a task ended badly."""
    states = [t.state for t in tasks]
    for state in ACTIVE_ORDER:
        if state in states:
            return state
    if all(s == "COMPLETED" for s in states):
        return "COMPLETED"
    return next((s for s in states if s != "COMPLETED" and is_final(s)), states[0] if states else "UNKNOWN")


def units_of(job: JobRecord) -> Sequence[JobRecord | TaskRecord]:
    """What has a state of its own: the array tasks, or the job itself."""
    return job.tasks or [job]


def needs_query(job: JobRecord) -> bool:
    units = units_of(job)
    return any(not is_final(u.state) or (u.state in REVIVABLE and time.time() - job.updated < REVIVE_WINDOW_S)
               for u in units)


def refresh(registry: Registry, jobs: list[JobRecord]) -> list[JobRecord]:
    """Bring the jobs' states up to date (one scheduler call for all SLURM jobs) and save them."""
    slurm = [j for j in jobs if j.executor == "slurm" and needs_query(j)]
    infos = query_jobs([j.job_id for j in slurm]) if slurm else {}
    for job in slurm:
        changed = _refresh_slurm(job, infos)
        if changed:
            registry.save(job)
    for job in jobs:
        if job.executor == "local" and not is_final(job.state) and not executor_alive(job):
            # the executor records the final state itself; gone without doing so means it was killed
            registry.update(job, state="CANCELLED" if job.cancel_requested else "FAILED",
                            reason="the local executor process ended without recording a result",
                            ended=job.ended or time.time())
    return jobs


def _refresh_slurm(job: JobRecord, infos: dict[str, JobInfo]) -> bool:
    before = job.to_json()  # a deep copy: comparing it after tells whether anything changed
    if job.is_array:
        for task in job.tasks:
            info = infos.get(task.id)
            if info is not None:
                _apply(task, info)
            elif is_final(task.state) or knows_job(infos, job.job_id):
                pass  # kept: its last word, or not split out of the pending array record yet
            else:
                task.state, task.reason = unknown_state(Path(task.run_dir))
        job.state = array_state(job.tasks)
        job.elapsed = max((t.elapsed for t in job.tasks), key=lambda e: parse_duration(e) or 0, default="")
        job.restarts = sum(t.restarts for t in job.tasks)
        job.nodes = ",".join(dict.fromkeys(t.nodes for t in job.tasks if t.nodes))
    else:
        info = infos.get(job.job_id)
        if info is not None:
            _apply(job, info)
        elif not is_final(job.state):
            job.state, job.reason = unknown_state(Path(job.run_dir))
    return job.to_json() != before


def log_files(job: JobRecord, task: TaskRecord | None, rank: int | None = None) -> list[Path]:
    """A local job's logs/rank-N.log, or a SLURM job's (or array task's) slurm-<id>.out and .err."""
    if job.executor == "local":
        run_dir = Path(task.run_dir if task else job.run_dir)
        return [run_dir / "logs" / f"rank-{rank or 0}.log"]
    if task is not None:
        run_dir, stem = Path(task.run_dir), f"slurm-{task.id}"
    else:
        run_dir, stem = Path(job.run_dir), f"slurm-{job.job_id}"
    return [run_dir / f"{stem}.out", run_dir / f"{stem}.err"]


def unknown_state(run_dir: Path) -> tuple[str, str]:
    """A job SLURM forgot (past MinJobAge) and no accounting to ask: what its run dir tells."""
    if is_finished(run_dir):
        return "COMPLETED", "from the run dir (SLURM no longer knows the job)"
    return "UNKNOWN", "SLURM no longer knows the job and has no accounting (sacct) to ask"


# --- progress from the run dir --------------------------------------------------------------------

@dataclass(frozen=True)
class Progress:
    step: int | None = None
    loss: float | None = None


def last_progress(run_dir: str | Path, tail_bytes: int = 65536) -> Progress:
    """The last {"kind": "train"} record of metrics.jsonl, reading only the end of the file."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - tail_bytes))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return Progress()
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the seek, or still being written
        if isinstance(record, dict) and record.get("kind") == "train":
            return Progress(record.get("step"), record.get("loss"))
    return Progress()


# --- local executor processes ---------------------------------------------------------------------

def process_start(pid: int) -> str | None:
    """The kernel's start time of a process (Linux), so a reused pid is never taken for ours."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the "(comm)" field


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


# --- cancel ---------------------------------------------------------------------------------------

def cancel(registry: Registry, job: JobRecord, task: TaskRecord | None, ref: str) -> str:
    """Cancel a SLURM job or array task (scancel), or a local job (its executor stops the ranks)."""
    if job.executor == "slurm":
        if is_final(task.state if task else job.state):
            return f"{ref} already ended ({task.state if task else job.state})"
        cancel_jobs([ref])
        return f"cancelled {ref}"
    if is_final(job.state) or not executor_alive(job):
        refresh(registry, [job])
        return f"{ref} is not running ({job.state})"
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
    return f"cancelling {ref}: the local executor (pid {job.pid}) is stopping its ranks"


# --- waiting --------------------------------------------------------------------------------------

def describe(job: JobRecord) -> str:
    if job.is_array:
        counts: dict[str, int] = {}
        for t in job.tasks:
            counts[t.state] = counts.get(t.state, 0) + 1
        return f"{job.state} ({', '.join(f'{n} {s}' for s, n in counts.items())})"
    detail = job.reason if job.state in ("PENDING", "REQUEUED") and job.reason else job.nodes
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
    """0 when every job (every array task) completed; else the first failure's exit code, or 1."""
    for job in jobs:
        for unit in units_of(job):
            if unit.state != "COMPLETED":
                return unit.exit_code or 1
    return 0
