"""The local executor's jobs: `hpcgpu submit --executor local`, and each job of `hpcgpu queue`.

The local side's counterpart of submission.py (SLURM): check the chosen GPUs (a busy one is a
warning, all of them busy a refusal unless --ignore-busy), choose the run dir (the unfinished run of
the same spec is resumed; `fresh` starts a new one), lock it (runlock.py), register the job, run the
ranks here (local.py) and record how they ended: state, exit code, GPU count and, for a failure,
which rank failed first and why. The CLI only parses flags and prints.

`hpcgpu queue` registers each of its jobs itself (`register`: run dir and registry record, so it
knows the job id and run dir before anything runs), starts `python -m hpcgpu.launch.local_submit
JOB_ID` with the GPUs it gave the job, and reads how the job ended back from the registry.
Host side: no torch.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, Callable, Mapping

from hpcgpu.contract import EXIT_KILLED, EXIT_STOPPED, RunPaths
from hpcgpu.errors import HpcgpuError, UsageError
from hpcgpu.gpu.busy import BusyThresholds, busy_detail, is_busy, select
from hpcgpu.gpu.source import default_source
from hpcgpu.launch import runlock
from hpcgpu.launch.failures import explain_failures, local_failure
from hpcgpu.launch.liveness import executor_alive, process_start
from hpcgpu.launch.local import check_fits_here, local_gpus, run_local
from hpcgpu.launch.progress import stop_summary
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.rundir import (find_finished_run, find_unfinished_run, make_run_dir, resume_text,
                                  shared_folder_note, take_spec)
from hpcgpu.launch.runlock import is_locked
from hpcgpu.launch.scheduler import format_duration
from hpcgpu.launch.state import array_state
from hpcgpu.launch.sweep import SweepTask, write_sweep
from hpcgpu.procs import die_with_parent
from hpcgpu.spec import Spec, load_spec

Say = Callable[[str], None]
Started = Callable[[JobRecord], None]


def _stderr(message: str) -> None:
    print(f"hpcgpu: {message}", file=sys.stderr, flush=True)


def _nothing(record: JobRecord) -> None:
    pass


# --- busy GPUs --------------------------------------------------------------------------------------

def check_busy(spec: Spec, ignore_busy: bool = False, say: Say = _stderr,
               environ: Mapping[str, str] | None = None) -> None:
    """Warn about each GPU the ranks would get that someone else uses (why, its memory, its
    processes); refuse (UsageError, exit 2) when every one of them is busy, unless ignore_busy.
    Busy means above the spec's resources.busy. Nothing to check on the CPU or without NVML."""
    env = os.environ if environ is None else environ
    devices, visible = spec.resources.devices, env.get("CUDA_VISIBLE_DEVICES")
    if not devices and visible is not None and not visible.strip():
        return  # GPUs hidden on purpose: CPU ranks
    source = default_source()
    if not source.available():
        return
    readings = source.read(processes=True)
    chosen, why = select(readings, devices, visible)
    chosen = chosen[:spec.resources.gpus]  # the ranks get the first `gpus` of them
    th = BusyThresholds.from_spec(spec.resources.busy)
    busy = [r for r in chosen if is_busy(r, th)]
    for r in busy:
        say(f"warning: {busy_detail(r, th)}")
    if not busy or len(busy) < len(chosen) or ignore_busy:
        return
    free = [str(r.index) for r in readings if not is_busy(r, th)]
    ids = ",".join(str(r.index) for r in busy)
    raise UsageError(f"every GPU chosen for {spec.name} is busy (GPU {ids}; {why}): choose free ones with "
                     "resources.devices or CUDA_VISIBLE_DEVICES" + (f" (free here: {','.join(free)})" if free else "")
                     + ", or add --ignore-busy to run on them anyway")


# --- records and states ------------------------------------------------------------------------------

def run_dirs_in_use(registry: Registry) -> Callable[[Path], bool]:
    """Run dirs that a live local job writes to: a second executor must not resume into them.
    Locked (any rank of a live job holds <run dir>/.lock, even after its launcher was killed), or
    recorded as run by a live local executor (a job started before run dirs were locked, or one
    `hpcgpu queue` registered whose executor has not taken the lock yet)."""
    def in_use(run_dir: Path) -> bool:
        # an executor process (pid) is the local executor's only: a SLURM job's ranks hold the lock
        return is_locked(run_dir) or any(j.state == "RUNNING" and executor_alive(j)
                                         for j in registry.with_run_dir(str(run_dir)))

    return in_use


def local_gpu_count(spec: Spec, environ: Mapping[str, str] | None = None) -> int:
    """GPUs the ranks get (0 on the CPU), for the GPU-hours `status` shows."""
    return min(len(local_gpus(spec, None if environ is None else dict(environ))), spec.resources.gpus)


def new_record(spec: Spec, spec_ref: str, run_dir: Path, pid: int | None = None,
               environ: Mapping[str, str] | None = None, state: str = "RUNNING") -> JobRecord:
    """A local job's registry row; job_id "" -> the registry assigns local-<n> as it inserts it."""
    # the node it runs on, as its failure records name it (status shows `-` only for a job holding none)
    node = socket.gethostname() if state == "RUNNING" else ""
    record = JobRecord("", spec.name, spec_ref, str(run_dir), "local", state=state, pid=pid,
                       pid_start=process_start(pid) if pid else None, nodes=node)
    record.gpus = local_gpu_count(spec, environ)
    return record


KILLED_REASON = "killed at a second interrupt; the same command goes on from its last complete checkpoint"


def local_state(registry: Registry, record: JobRecord, code: int, run_dir: Path) -> tuple[str, str]:
    cancelled = registry.find(record.job_id)[0].cancel_requested
    if code == 0:
        return "COMPLETED", ""
    if cancelled:
        how = stop_summary(run_dir) if code == EXIT_STOPPED else \
            "killed without a checkpoint" if code == EXIT_KILLED else f"exit code {code}"
        return "CANCELLED", f"hpcgpu cancel: {how}"
    if code == EXIT_STOPPED:
        return "PREEMPTED", f"{stop_summary(run_dir)}; the same command goes on from it"
    if code == EXIT_KILLED:
        return "CANCELLED", KILLED_REASON
    return "FAILED", f"exit code {code}"


def exit_code(record: JobRecord) -> int:
    """The job's code: 0 finished, 75 stopped at a checkpoint, else the (first failed task's) code."""
    if record.tasks:
        return next((t.exit_code for t in record.tasks if t.exit_code), 0)
    return record.exit_code or 0


def run_recorded(registry: Registry, record: JobRecord, spec: Spec, run_dir: Path,
                 task: TaskRecord | None = None, echo: IO[str] | None = None, say: Say = _stderr) -> int:
    """Run the ranks here and record how they ended (the job's, or one sweep task's, state)."""
    try:
        code = run_local(spec, RunPaths(run_dir).spec, run_dir, task.id if task else record.job_id,
                         echo=sys.stdout if echo is None else echo, say=say)
    except BaseException:
        registry.update(record, state="FAILED", reason="the local executor failed", ended=time.time())
        raise
    state, reason = local_state(registry, record, code, run_dir)
    target = task or record
    target.state, target.reason, target.exit_code = state, reason, code
    if task is None or task is record.tasks[-1] or state == "CANCELLED":
        record.state = state if task is None else _sweep_state(record)
        record.ended = time.time()
    explain_failures(record, local_failure)  # which rank failed first, and its last error line, for status and the CLI
    registry.save(record)
    return code


def _sweep_state(record: JobRecord) -> str:
    return array_state([t for t in record.tasks if t.state != "PENDING"] or record.tasks)


def register_local(registry: Registry, record: JobRecord, waiting: JobRecord | None) -> JobRecord:
    """Register a local job; one that waited for --after's job takes over that waiting record (its id)."""
    if waiting is None:
        return registry.add(record)
    record.key, record.job_id, record.after = waiting.key, waiting.job_id, waiting.after
    registry.save(record)
    return record


# --- one job, here ----------------------------------------------------------------------------------

def unfinished_run(spec: Spec, registry: Registry, fresh: bool = False) -> Path | None:
    """The run dir to resume: the newest unfinished run of the identical spec (None: a new one);
    RunDirLocked, one line, when a live job still writes it."""
    run_dir = None if fresh else find_unfinished_run(spec)
    if run_dir is not None and run_dirs_in_use(registry)(run_dir):
        # the same command while the job (or ranks it left) still runs: never a second writer
        raise runlock.RunDirLocked(run_dir)
    if run_dir is not None:
        take_spec(run_dir, spec)
    return run_dir


def submit_local(spec: Spec, spec_ref: str, registry: Registry, *, fresh: bool = False, ignore_busy: bool = False,
                 echo: IO[str] | None = None, say: Say = _stderr, started: Started = _nothing,
                 waiting: JobRecord | None = None) -> JobRecord:
    """Run `spec` here as one registered local job and return its record once the ranks have ended
    (state, exit_code, failure). Resumes the unfinished run dir of the identical spec unless
    `fresh`; RunDirLocked (one line) when a live job writes that dir; then the busy-GPU check
    (check_busy), before anything is written. `started(record)` is called once the job is
    registered, before the ranks start. `waiting`: the record registered while it waited for
    --after's job; the job takes its id and runs in its new run dir."""
    check_fits_here(spec)
    # first: a live run of this job uses our GPUs itself
    run_dir = unfinished_run(spec, registry, fresh) if waiting is None else None
    check_busy(spec, ignore_busy, say)
    with contextlib.ExitStack() as held:
        if waiting is not None:
            run_dir = Path(waiting.run_dir)
            take_spec(run_dir, spec)  # the spec as checked again after the wait
            held.enter_context(runlock.hold(run_dir))
        elif run_dir is not None:
            held.enter_context(runlock.hold(run_dir))  # RunDirLocked if one took it just now
            say(resume_text(run_dir, spec))
        else:
            finished = None if fresh else find_finished_run(spec)
            if finished is not None:  # the queue skips such a line; submit runs again, and says so
                say(f"the same spec finished in {finished}; starting a new run")
            for attempt in range(3):
                run_dir = make_run_dir(spec, spec_file=spec_ref)
                try:  # locked from here until the ranks have ended (the executor holds it too)
                    held.enter_context(runlock.hold(run_dir))
                    break
                except runlock.RunDirLocked:  # a concurrent same-spec submit took our new dir
                    if attempt == 2:
                        raise
        assert run_dir is not None
        note = shared_folder_note(spec, run_dir)
        if note:
            say(note)
        record = register_local(registry, new_record(spec, spec_ref, run_dir, pid=os.getpid()), waiting)
        started(record)
        run_recorded(registry, record, spec, run_dir, echo=echo, say=say)
    return record


def submit_local_sweep(spec: Spec, tasks: list[SweepTask], spec_ref: str, registry: Registry, *,
                       ignore_busy: bool = False, echo: IO[str] | None = None, say: Say = _stderr,
                       started: Started = _nothing, waiting: JobRecord | None = None) -> JobRecord:
    """A sweep with the local executor: the tasks one after another, as one registered job with a
    task per point; stops after a cancelled task. Returns the record once the last task ended."""
    for task in tasks:
        check_fits_here(task.spec)
    check_busy(spec, ignore_busy, say)
    sweep = write_sweep(spec, tasks, spec_ref)
    record = register_local(registry, new_record(spec, spec_ref, sweep.root, pid=os.getpid()), waiting)
    record.tasks = [TaskRecord(f"{record.job_id}_{t.index}", str(d), t.values, gpus=record.gpus)
                    for t, d in zip(tasks, sweep.run_dirs)]
    registry.save(record)
    started(record)
    for task, run_dir, entry in zip(tasks, sweep.run_dirs, record.tasks):
        say(f"task {entry.id}: {task.label()}")
        # each task's own state, node and time, as a SLURM array's: not the sweep's
        entry.state, entry.run_start, entry.nodes = "RUNNING", time.time(), socket.gethostname()
        registry.save(record)
        try:
            run_recorded(registry, record, task.spec, run_dir, entry, echo=echo, say=say)
        finally:
            entry.elapsed = format_duration(time.time() - entry.run_start)
            registry.save(record)
        if entry.state == "CANCELLED":
            break
    return record


# --- the jobs of `hpcgpu queue`: registered by the queue, run by a child -----------------------------

def register(spec: Spec, spec_ref: str, registry: Registry, *, fresh: bool = False,
             environ: Mapping[str, str] | None = None) -> tuple[JobRecord, bool]:
    """Choose the run dir as submit_local does (resume, or new; RunDirLocked when a live job writes
    the one to resume) and register the job (PENDING) for an executor started with `environ`;
    returns (record, resumed). The caller starts the executor (`python -m hpcgpu.launch.local_submit
    JOB_ID`) and records it with `executor_started` at once, so that no other submission takes the
    run dir before the executor locks it."""
    run_dir = unfinished_run(spec, registry, fresh)
    resumed = run_dir is not None
    if run_dir is None:
        run_dir = make_run_dir(spec, spec_file=spec_ref)
    return registry.add(new_record(spec, spec_ref, run_dir, environ=environ, state="PENDING")), resumed


def executor_started(registry: Registry, record: JobRecord, pid: int) -> None:
    """The executor of a registered job runs as `pid`: `hpcgpu cancel` signals it, and the run dir
    counts as in use from now on."""
    registry.update(record, pid=pid, pid_start=process_start(pid), state="RUNNING", nodes=socket.gethostname())


def run_registered(registry: Registry, job_id: str, say: Say = _stderr) -> int:
    """In the executor of a registered job: lock its run dir, run the ranks, record the end.
    A job that cannot start (its run dir locked by another live job, a spec.yaml gone) is
    recorded FAILED with that line as its reason, and the error raised."""
    record, _ = registry.find(job_id)
    run_dir = Path(record.run_dir)
    try:
        with runlock.hold(run_dir, record.job_id):
            executor_started(registry, record, os.getpid())  # as the queue wrote it: this process
            spec = load_spec(str(RunPaths(run_dir).spec))  # the resolved spec the ranks run, too
            return run_recorded(registry, record, spec, run_dir, say=say)
    except HpcgpuError as exc:
        if record.state not in ("FAILED", "COMPLETED", "CANCELLED", "PREEMPTED"):
            registry.update(record, state="FAILED", reason=str(exc), exit_code=exc.exit_code, ended=time.time())
        raise


def main(argv: list[str] | None = None) -> None:
    """`python -m hpcgpu.launch.local_submit JOB_ID`: run a job `hpcgpu queue` registered. Dies
    with the queue (HPCGPU_PARENT_PID); exits with the job's code (2 when it could not start)."""
    die_with_parent()  # first: a queue killed with SIGKILL takes this job and its ranks along
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        _stderr("error: usage: python -m hpcgpu.launch.local_submit JOB_ID (a job `hpcgpu queue` registered)")
        sys.exit(2)
    try:
        code = run_registered(Registry(), args[0])
    except HpcgpuError as exc:
        _stderr(f"error: {exc}")
        sys.exit(exc.exit_code)
    sys.exit(code)


if __name__ == "__main__":
    main()
