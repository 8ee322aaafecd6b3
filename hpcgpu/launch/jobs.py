"""A job's life after submission: refresh states from the scheduler, read progress, cancel.

A refresh asks SLURM once for all the jobs it is given that are not final yet (one squeue call),
and the local executor's jobs by their process; final states are never asked again.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, fields as dataclass_fields, replace
from typing import Any, Callable, Sequence
from pathlib import Path

from hpcgpu.errors import HpcgpuError
from hpcgpu.contract import EXIT_STOPPED, Failure, is_finished, read_failures
from hpcgpu.hostlist import scontrol_fields
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.scheduler import (FINAL_STATES, JobInfo, cancel_jobs, format_duration, knows_job, parse_duration,
                                     query_jobs, run_scheduler)

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


def units_of(job: JobRecord) -> Sequence[JobRecord | TaskRecord]:
    """What has a state of its own: the array tasks, or the job itself."""
    return job.tasks or [job]


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
            or not (run_dir / "spec.yaml").is_file() or not (run_dir / "job.sbatch").is_file():
        return None
    return JobRecord(job_id, fields.get("JobName", ""), str(run_dir / "spec.yaml"), str(run_dir), "slurm",
                     state=fields.get("JobState", "PENDING"))


def refresh(registry: Registry, jobs: list[JobRecord]) -> list[JobRecord]:
    """Bring the jobs' states up to date (one scheduler call for all SLURM jobs) and save them."""
    slurm = [j for j in jobs if j.executor == "slurm" and needs_query(j)]
    infos = query_jobs([j.job_id for j in slurm]) if slurm else {}
    asked = {id(j) for j in slurm}
    for job in jobs:
        changed = False
        if id(job) in asked:
            changed = _refresh_slurm(job, infos)
        elif job.executor == "local" and not is_final(job.state) and not executor_alive(job) \
                and not run_dir_held(job):
            changed = _refresh_ended_local(registry, job)
        if explain_failures(job) or changed:
            registry.save(job)
    return jobs


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


# --- why a job failed ------------------------------------------------------------------------------

FAILED_STATES = frozenset({"FAILED", "OUT_OF_MEMORY"})
LOG_TAIL_BYTES = 64 * 1024  # failures are at the end of a log: never read a whole (multi-GB) one
MESSAGE_CHARS = 300
# srun's report of a task that ended badly: "srun: error: n2: task 1: Exited with exit code 3",
# "srun: error: n1: tasks 0-1,3: Killed", "srun: error: n1: task 0: Segmentation fault (core dumped)"
SRUN_TASK_LINE = re.compile(r"^srun: error: (?P<node>[^\s:]+): tasks? (?P<tasks>\d[\d,\-]*): (?P<how>.+?)\s*$")
RANK_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")  # srun --label pads the rank to the widest one
SCHEDULER_LINE = re.compile(r"^(srun|slurmstepd(-[^\s:]+)?|slurmd)(\[\d+\])?: ")
# the GPU monitor's end-of-job summary comes after a program's last error: it is never the reason
MONITOR_LINE = re.compile(r"^(\d\d:\d\d:\d\d )?(\[rank \d+\] )?gpu monitor: ")
SIGNAL_TEXTS = {text.lower(): int(sig) for sig in signal.Signals if (text := signal.strsignal(sig))}


@dataclass(frozen=True)
class TaskEnd:
    """One rank that srun reported as failed."""

    rank: int
    node: str
    exit_code: int | None
    how: str  # srun's words: "Exited with exit code 3", "Killed", "Out Of Memory"


def explain_failures(job: JobRecord) -> bool:
    """Give each FAILED unit of the job its reason, once (failure None: not looked at yet).
    Returns whether anything changed."""
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


def failure_of(job: JobRecord, unit: JobRecord | TaskRecord) -> tuple[dict[str, Any], str]:
    """Which rank failed first, where, how, and its last error line -> (fields, one-line reason).

    Sources, most trusted first: the failure records the ranks (or the local executor) wrote;
    srun's lines in the job's stderr; the exit code SLURM gives. Fields are {} when no rank is known.
    """
    task = unit if isinstance(unit, TaskRecord) else None
    unit_id = task.id if task else job.job_id
    if job.executor == "local":
        failure = latest_recorded_failure(Path(unit.run_dir), unit_id)
        if failure is None:
            return {}, ""  # the executor's own reason ("exit code N") stays
        lines = tail_lines(log_files(job, task, failure.rank)[0])
        return _described(replace(failure, message=failure.message or last_line(lines)))
    out_lines, err_lines = (tail_lines(p) for p in log_files(job, task))
    attempt = f"{unit_id}.{unit.restarts}"
    recorded = read_failures(Path(unit.run_dir), attempt)  # this run's records, oldest first
    failure = recorded[0] if recorded else None
    srun = first_failed_task(err_lines) or first_failed_task(out_lines)
    if srun is not None and (failure is None or killed_first(srun, recorded)):
        failure = Failure(attempt, srun.rank, srun.node, srun.exit_code, "", time.time())
    if failure is None and unit.exit_code == EXIT_STOPPED:
        return {}, stopped_not_requeued(out_lines + err_lines, unit_id)
    if failure is None:
        line = last_line(err_lines, rank=None)  # the batch script's own: a setup line that failed
        how = "no exit code known" if unit.exit_code is None else f"exit code {unit.exit_code}"
        return {}, how + (f": {line}" if line else "")
    message = failure.message or rank_error_line(failure.rank, err_lines, out_lines)
    if not message and srun is not None and srun.rank == failure.rank and "exit code" not in srun.how:
        message = srun.how  # "Out Of Memory", "Killed": better than nothing
    node = failure.node or (srun.node if srun is not None and srun.rank == failure.rank else "")
    return _described(replace(failure, message=message, node=node))


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


def _described(failure: Failure) -> tuple[dict[str, Any], str]:
    message = failure.message.strip()
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS - 3] + "..."
    failure = replace(failure, message=message)
    fields = {"rank": failure.rank, "node": failure.node, "exit_code": failure.exit_code,
              "signal": failure.signal_name, "message": message}
    return fields, failure.describe()


def latest_recorded_failure(run_dir: Path, unit_id: str) -> Failure | None:
    """The first failure the ranks recorded in this local job's latest attempt that recorded one (a
    SLURM run reads its own attempt's: failure_of); an older attempt's record never speaks for it."""
    mine = [f for f in read_failures(run_dir) if f.attempt.startswith(f"{unit_id}.")]
    return next((f for f in mine if f.attempt == mine[-1].attempt), None)


def tail_lines(path: Path, max_bytes: int = LOG_TAIL_BYTES) -> list[str]:
    """The last lines of a file, reading at most max_bytes ([] if it is not there)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - max_bytes))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return lines[1:] if size > max_bytes else lines  # the first one is cut by the seek


def first_failed_task(lines: list[str]) -> TaskEnd | None:
    """The first task srun reported as failed in the last run of the log.

    A requeued job appends every run to the same log, so the failed run's block of srun lines is
    read backwards and ends at a task named twice (an earlier run) or at a run stopped at a
    checkpoint (exit 75) before it."""
    block: list[TaskEnd] = []
    seen: set[int] = set()
    for line in reversed(lines):
        m = SRUN_TASK_LINE.match(line)
        if not m:
            continue
        ranks, code = task_ids(m["tasks"]), srun_exit_code(m["how"])
        if code == EXIT_STOPPED or seen.intersection(ranks):
            if block:
                break
            continue
        seen.update(ranks)
        block.append(TaskEnd(ranks[0], m["node"], code, m["how"]))
    return block[-1] if block else None


def task_ids(text: str) -> list[int]:
    """srun's task list `0-1,3` -> [0, 1, 3]."""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            out.extend(range(int(low), int(high if high.isdigit() else low) + 1))
    return out


def srun_exit_code(how: str) -> int | None:
    """srun's words for how a task ended -> the shell's exit code (a signal N -> 128+N)."""
    m = re.match(r"Exited with exit code (\d+)", how)
    if m:
        return int(m.group(1))
    text = how.replace("(core dumped)", "").strip().lower()
    if text == "out of memory":
        return 128 + signal.SIGKILL  # the kernel's OOM killer
    sig = SIGNAL_TEXTS.get(text)
    return 128 + sig if sig else None


def rank_error_line(rank: int, *logs: list[str]) -> str:
    """The last line a rank wrote (srun --label: `N: text`), stderr first, not srun's own."""
    for lines in logs:
        line = last_line(lines, rank)
        if line:
            return line
    return ""


def last_line(lines: list[str], rank: int | None = -1) -> str:
    """The last non-empty line: of one rank (`N: ` labels), of no rank (None: the batch script's
    own lines), or any (-1: an unlabelled log); scheduler lines are skipped."""
    for line in reversed(lines):
        m = RANK_LABEL.match(line)
        if rank == -1:
            text = line
        elif rank is None:
            text = "" if m else line
        else:
            text = m.group(2) if m and int(m.group(1)) == rank else ""
        text = text.strip()
        if text and not SCHEDULER_LINE.match(text) and not MONITOR_LINE.match(text):
            return text
    return ""


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
    rows: int | None = None  # task: infer: rows written, of rows_total
    rows_total: int | None = None
    max_steps: int | None = None
    tokens_per_s: float | None = None  # train: the last logged interval's
    rate: float | None = None  # steps/s (train) or rows/s (infer) over this start of the job so far

    def text(self) -> str:
        """'step 120/1000 (loss 2.7021)', 'rows 45/45', or '-'."""
        if self.rows is not None:
            return f"rows {self.rows}/{self.rows_total if self.rows_total is not None else '?'}"
        if self.step is None:
            return "-"
        of = f"/{self.max_steps}" if self.max_steps else ""
        return f"step {self.step}{of}" + (f" (loss {self.loss:.4f})" if isinstance(self.loss, (int, float)) else "")

    def eta_s(self) -> float | None:
        """Seconds left at the rate so far: (max_steps - step) or (rows_total - rows) over it."""
        if not self.rate:
            return None
        if self.rows is not None and self.rows_total is not None:
            return max(0, self.rows_total - self.rows) / self.rate
        if self.step is not None and self.max_steps:
            return max(0, self.max_steps - self.step) / self.rate
        return None


def tail_records(run_dir: str | Path, tail_bytes: int = 65536) -> list[dict]:
    """The records at the end of metrics.jsonl (only its last `tail_bytes` are read)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - tail_bytes))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the seek, or still being written
        if isinstance(record, dict):
            out.append(record)
    return out


def stop_summary(run_dir: str | Path) -> str:
    """How a run that exited 75 stopped, from its last stop record: a train run stopped before its
    first step saved nothing (rerunning starts it, not resumes it)."""
    stop = next((r for r in reversed(tail_records(run_dir)) if r.get("kind") == "stop"), {})
    if stop.get("saved") is False:
        return "stopped before its first step, nothing saved"
    if isinstance(stop.get("step"), int):
        return f"stopped at step {stop['step']}, at its checkpoint"
    if isinstance(stop.get("rows"), int):
        return f"stopped after {stop['rows']} rows, all written"
    return "stopped at a checkpoint"


def steps_per_s(records: list[dict]) -> float | None:
    """Steps per second over the train records since the job last (re)started, eval and checkpoint
    time included: what the remaining steps will take."""
    since: list[dict] = []
    for r in records:
        if r.get("kind") in ("resume", "start"):
            since = []
        elif r.get("kind") == "train" and isinstance(r.get("time"), (int, float)):
            since.append(r)
    if len(since) >= 2 and since[-1]["time"] > since[0]["time"]:
        return (since[-1]["step"] - since[0]["step"]) / (since[-1]["time"] - since[0]["time"])
    ms = since[-1].get("ms_per_step") if since else None
    return 1000.0 / ms if isinstance(ms, (int, float)) and ms > 0 else None


WRITTEN_ROWS_MAX_BYTES = 64 << 20  # counted while status stays quick; a larger output keeps its record's count


def written_rows(run_dir: str | Path) -> int | None:
    """task: infer: the complete rows its replicas have written (the lines of outputs/replica-*.jsonl;
    a row cut by a kill has no newline yet), or None where they are too large to count here."""
    files = sorted((Path(run_dir) / "outputs").glob("replica-*.jsonl"))
    try:
        if not files or sum(f.stat().st_size for f in files) > WRITTEN_ROWS_MAX_BYTES:
            return None
        return sum(f.read_bytes().count(b"\n") for f in files)
    except OSError:
        return None


def last_progress(run_dir: str | Path, tail_bytes: int = 65536) -> Progress:
    """The last progress record of metrics.jsonl ({"kind": "train"}; task: infer, "infer" or its
    "end"), reading only the end of the file."""
    records = tail_records(run_dir, tail_bytes)
    for record in reversed(records):
        kind = record.get("kind")
        if kind == "train":
            return Progress(record.get("step"), record.get("loss"), max_steps=record.get("max_steps"),
                            tokens_per_s=record.get("tokens_per_s"), rate=steps_per_s(records))
        if kind == "infer":
            rows, on_disk = record.get("rows"), written_rows(run_dir)
            if isinstance(rows, int) and on_disk is not None:
                rows = max(rows, on_disk)  # the record is up to a progress interval old, or a kill's last
            return Progress(rows=rows, rows_total=record.get("rows_total"), rate=record.get("rows_per_s"))
        if kind == "end" and "rows" in record:
            return Progress(rows=record["rows"], rows_total=record["rows"])
    return Progress()


# --- local executor processes ---------------------------------------------------------------------

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
    from hpcgpu.launch.runlock import is_locked

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


# --- waiting --------------------------------------------------------------------------------------

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
