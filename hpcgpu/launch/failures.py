"""Why a job failed: the rank that failed first, its node, exit code and last error line, in one reason.

Sources, most trusted first: the failure records the ranks (or the local executor) wrote; srun's lines in
the job's stderr (hpcgpu/launch/joblogs.py); the exit code SLURM gives.
"""
from __future__ import annotations

import re
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from hpcgpu.contract import EXIT_STOPPED, Failure, read_failures, signal_hint
from hpcgpu.launch.joblogs import (RANK_LABEL, TaskEnd, first_failed_task, last_line, rank_error_line, rank_log,
                                   slurm_log_files, tail_lines)
from hpcgpu.launch.registry import JobRecord, TaskRecord, units_of


FAILED_STATES = frozenset({"FAILED", "OUT_OF_MEMORY"})
MESSAGE_CHARS = 300


# a job's executor's reader: (job, one run of it) -> (fields, one-line reason)
FailureOf = Callable[[JobRecord, "JobRecord | TaskRecord"], "tuple[dict[str, Any], str]"]


def explain_failures(job: JobRecord, failure_of: FailureOf) -> bool:
    """Give each FAILED unit of the job its reason, once (failure None: not looked at yet), read by
    its executor's `failure_of`. Returns whether anything changed."""
    changed = False
    for unit in units_of(job):
        if unit.state in FAILED_STATES and unit.failure is None:
            unit.failure, reason = failure_of(job, unit)
            unit.reason = reason or unit.reason
            changed = True
    if job.is_array and changed and job.state in FAILED_STATES:
        first = next((t for t in job.tasks if t.state in FAILED_STATES and t.reason), None)
        job.reason = f"task {first.id}: {first.reason}" if first else job.reason
    return changed


def id_of(job: JobRecord, unit: JobRecord | TaskRecord) -> str:
    return unit.id if isinstance(unit, TaskRecord) else job.job_id


def local_failure(job: JobRecord, unit: JobRecord | TaskRecord) -> tuple[dict[str, Any], str]:
    """A local job's: the rank that failed first in its latest attempt, as the ranks (or the local
    executor) recorded it, with its last log line where it said nothing -> (fields, one-line reason)."""
    failure = latest_recorded_failure(Path(unit.run_dir), id_of(job, unit))
    if failure is None:
        return {}, ""  # the executor's own reason ("exit code N") stays
    lines = tail_lines(rank_log(unit, failure.rank))
    return described(replace(failure, message=failure.message or signal_hint(failure.exit_code)
                              or last_line(lines)))


def slurm_failure(job: JobRecord, unit: JobRecord | TaskRecord) -> tuple[dict[str, Any], str]:
    """A SLURM job's: which rank failed first, where, how, and its last error line -> (fields,
    one-line reason). Sources, most trusted first: the failure records the ranks wrote; srun's lines in
    the job's stderr; the exit code SLURM gives. Fields are {} when no rank is known."""
    task = unit if isinstance(unit, TaskRecord) else None
    out_lines, err_lines = (tail_lines(p) for p in slurm_log_files(job, task))
    unit_id = id_of(job, unit)
    attempt = f"{unit_id}.{unit.restarts}"
    recorded = read_failures(Path(unit.run_dir), attempt)  # this run's records, oldest first
    failure = recorded[0] if recorded else None
    srun = first_failed_task(err_lines) or first_failed_task(out_lines)
    if srun is not None and (failure is None or killed_first(srun, recorded)):
        failure = Failure(attempt, srun.rank, srun.node, srun.exit_code, "", time.time())
    if failure is None and unit.exit_code == EXIT_STOPPED:
        return {}, stopped_not_requeued(out_lines + err_lines, unit_id)
    if failure is None:
        # the batch script's own (a setup line that failed) or srun's refusal to start the step
        line = last_line(err_lines, rank=None, srun_errors=True)
        how = "no exit code known" if unit.exit_code is None else f"exit code {unit.exit_code}"
        return {}, how + (f": {line}" if line else "")
    srun_says = srun.how if srun is not None and srun.rank == failure.rank and "exit code" not in srun.how else ""
    if not failure.message and signal_hint(failure.exit_code):
        # a rank killed by a signal said nothing itself: its last line is no reason (a start-up banner)
        message = srun_says or signal_hint(failure.exit_code)
    else:
        message = failure.message or rank_error_line(failure.rank, err_lines, out_lines) or srun_says
    node = failure.node or (srun.node if srun is not None and srun.rank == failure.rank else "")
    return described(replace(failure, message=message, node=node))


def stopped_not_requeued(lines: list[str], unit_id: str) -> str:
    """A run that stopped at a checkpoint (exit 75) and was not requeued (the cap, slurm.requeue false):
    SLURM calls it FAILED; the reason says why it stayed stopped, in rank 0's words, and how to go on."""
    line = next((line for line in reversed(lines) if "not requeuing" in line), "")
    labelled = RANK_LABEL.match(line)
    why = re.sub(r"^\d\d:\d\d:\d\d \[rank \d+\] ", "", (labelled.group(2) if labelled else line).strip())
    return ("stopped at a checkpoint and not requeued" + (f" ({why})" if why else "")
            + f"; `scontrol requeue {unit_id}` goes on from it")


def killed_first(srun: TaskEnd, recorded: list[Failure]) -> bool:
    """srun saw a rank end first killed outright (SIGKILL: the OOM killer, a node problem), so without a
    record of its own among the run's: the recorded failures are peers' errors in a collective after it."""
    return srun.exit_code == 128 + signal.SIGKILL and all(f.rank != srun.rank for f in recorded)


def described(failure: Failure) -> tuple[dict[str, Any], str]:
    message = failure.message.strip()
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS - 3] + "..."
    failure = replace(failure, message=message)
    fields = {"rank": failure.rank, "node": failure.node, "exit_code": failure.exit_code,
              "signal": failure.signal_name, "message": message}
    return fields, failure.describe()


def latest_recorded_failure(run_dir: Path, unit_id: str) -> Failure | None:
    """The first failure the ranks recorded in this local job's latest attempt that recorded one (a
    SLURM run reads its own attempt's: slurm_failure); an older attempt's record never speaks for it."""
    mine = [f for f in read_failures(run_dir) if f.attempt.startswith(f"{unit_id}.")]
    return next((f for f in mine if f.attempt == mine[-1].attempt), None)
