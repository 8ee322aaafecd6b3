"""A job's state after submission: refreshed from the scheduler, or, for the local executor, from its process.

Each executor (hpcgpu/launch/executors.py, whose `refresh` takes any mix of jobs) refreshes its own:
SLURM's once for all the jobs it is given that are not final yet (one squeue call), the local
executor's by their process; final states are never asked again. A FAILED job is given its reason
once (hpcgpu/launch/failures.py).
"""
from __future__ import annotations

import time
from dataclasses import fields as dataclass_fields
from pathlib import Path

from hpcgpu.contract import RunPaths, is_finished
from hpcgpu.errors import HpcgpuError
from hpcgpu.hostlist import scontrol_fields
from hpcgpu.launch.failures import FailureOf, explain_failures
from hpcgpu.launch.liveness import executor_alive, run_dir_held
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord, units_of
from hpcgpu.launch.scheduler import (FINAL_STATES, JobInfo, format_duration, knows_job, parse_duration, query_jobs,
                                     run_scheduler)


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


def waiting_reason(job: JobRecord, reason: str) -> str:
    """SLURM's reason for a chained job's wait (submit --after), in words naming the job it waits for."""
    if not job.after:
        return reason
    if reason == "DependencyNeverSatisfied":
        return f"will not run: job {job.after} did not complete; `hpcgpu cancel {job.job_id}` removes this one"
    if reason == "Dependency":
        return f"waiting for job {job.after} to complete"
    return reason


def _apply(target: JobRecord | TaskRecord, info: JobInfo) -> None:
    if info.state == "COMPLETING" and info.restarts > target.restarts:
        # SLURM is still tearing down the run it requeues; its times (SubmitTime = the requeue)
        # settle in a moment, and the run is counted then
        target.state, target.nodes = "REQUEUED", ""
        return
    target.state = shown_state(info)
    target.reason = info.reason if info.state in ("PENDING", "REQUEUED") or target.state == "REQUEUED" else ""
    _count_runs(target, info)
    # a job waiting again holds no node; a finished one keeps where it ran
    target.nodes = "" if target.state in ("PENDING", "REQUEUED") else (info.nodes or target.nodes)
    target.restarts = info.restarts
    target.exit_code = info.exit_code
    if info.gpus is not None:
        target.gpus = info.gpus


def _count_runs(target: JobRecord | TaskRecord, info: JobInfo) -> None:
    """Elapsed over all runs: squeue's TimeUsed restarts at every requeue, so the registry keeps the
    earlier runs' seconds; sacct, where accounting works, lists every run and wins."""
    current = parse_duration(info.elapsed) or 0
    if info.restarts > target.restarts:
        target.earlier_runs_s += _ended_run_s(target, info)
        target.run_start = None
    if info.state in ("RUNNING", "SUSPENDED") and info.start:
        target.run_start = info.start
    if info.total_s is not None:
        target.earlier_runs_s = max(0, info.total_s - current)
    if info.elapsed or target.earlier_runs_s:
        target.elapsed = format_duration(target.earlier_runs_s + current)


def _ended_run_s(target: JobRecord | TaskRecord, info: JobInfo) -> int:
    """The run that a requeue ended: its start (seen while it ran) to the requeue, which SLURM
    writes into SubmitTime; else as long as it had run when last looked at."""
    seen = max(0, (parse_duration(target.elapsed) or 0) - target.earlier_runs_s)
    one_requeue = info.restarts == target.restarts + 1
    if one_requeue and target.run_start and info.submit and info.submit >= target.run_start:
        return max(seen, int(info.submit - target.run_start))
    return seen


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


def needs_query(job: JobRecord) -> bool:
    units = units_of(job)
    return any(not is_final(u.state) or (u.state in REVIVABLE and time.time() - job.updated < REVIVE_WINDOW_S)
               for u in units)


def find_job(registry: Registry, ref: str) -> tuple[JobRecord, TaskRecord | None]:
    """A job by the id the user typed; a SLURM job the registry lacks because it was started with plain
    `sbatch` from a script `hpcgpu sbatch` wrote is added (adopted) while SLURM still lists it: its
    output file lies in an hpcgpu run dir (spec.yaml and job.sbatch beside it)."""
    try:
        return registry.find(ref)
    except HpcgpuError as missing:
        record = adopt_sbatch_job(ref.strip())
        if record is None:
            raise missing from None
        registry.add(record)
        return registry.find(ref)


def adopt_sbatch_job(job_id: str) -> JobRecord | None:
    """The registry record of a plain-`sbatch` job of an hpcgpu run dir, from `scontrol show job`; None
    when SLURM does not know the job, or it is not one of ours (arrays are left to `hpcgpu submit`)."""
    if not job_id.isdigit():
        return None
    try:
        done = run_scheduler(["scontrol", "show", "job", "-o", job_id])
    except HpcgpuError:
        return None
    fields = scontrol_fields(done.stdout) if done.returncode == 0 else {}
    run_dir = Path(fields.get("StdOut", "")).parent
    if fields.get("JobId") != job_id or fields.get("ArrayJobId") or not fields.get("StdOut") \
            or not RunPaths(run_dir).spec.is_file() or not (run_dir / "job.sbatch").is_file():
        return None
    return JobRecord(job_id, fields.get("JobName", ""), str(RunPaths(run_dir).spec), str(run_dir), "slurm",
                     state=fields.get("JobState", "PENDING"))


def refresh_slurm_jobs(registry: Registry, jobs: list[JobRecord], failure_of: FailureOf) -> None:
    """SLURM's jobs up to date, saved: one scheduler call for all those not final (or revivable); a
    FAILED one given its reason by `failure_of`."""
    asked = [j for j in jobs if needs_query(j)]
    infos = query_jobs([j.job_id for j in asked]) if asked else {}
    asked_ids = {id(j) for j in asked}
    for job in jobs:
        changed = id(job) in asked_ids and _refresh_slurm(job, infos)
        if explain_failures(job, failure_of) or changed:
            registry.save(job)


def refresh_local_jobs(registry: Registry, jobs: list[JobRecord], failure_of: FailureOf) -> None:
    """The local executor's jobs up to date, saved: one whose executor process is gone and whose run
    dir no rank holds has ended; a FAILED one given its reason by `failure_of`."""
    for job in jobs:
        ended = not is_final(job.state) and not executor_alive(job) and not run_dir_held(job)
        changed = ended and _refresh_ended_local(registry, job)
        if explain_failures(job, failure_of) or changed:
            registry.save(job)


def _refresh_ended_local(registry: Registry, job: JobRecord) -> bool:
    """A local job whose executor is gone: its own final word, or, without one, killed. This copy may
    be older than that word (`logs -f` holds one from before the job ended): the registry's row is
    read again first, so a COMPLETED job is never overwritten as FAILED."""
    stored = registry.reread(job)
    if stored is not None and is_final(stored.state):
        for f in dataclass_fields(JobRecord):
            setattr(job, f.name, getattr(stored, f.name))
        return False
    job.state = "CANCELLED" if job.cancel_requested else "FAILED"
    job.reason = "the local executor process ended without recording a result"
    job.ended = job.ended or time.time()
    return True


def _refresh_slurm(job: JobRecord, infos: dict[str, JobInfo]) -> bool:
    before = job.to_json()  # a deep copy: comparing it after tells whether anything changed
    if job.is_array:
        for task in job.tasks:
            info = infos.get(task.id)
            if info is not None:
                _apply(task, info)
                task.reason = waiting_reason(job, task.reason)
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
            job.reason = waiting_reason(job, job.reason)
        elif not is_final(job.state):
            job.state, job.reason = unknown_state(Path(job.run_dir))
    return job.to_json() != before


def unknown_state(run_dir: Path) -> tuple[str, str]:
    """A job SLURM forgot (past MinJobAge) and no accounting to ask: what its run dir tells."""
    if is_finished(run_dir):
        return "COMPLETED", "from the run dir (SLURM no longer knows the job)"
    return "UNKNOWN", "SLURM no longer knows the job and has no accounting (sacct) to ask"
