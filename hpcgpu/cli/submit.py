"""`hpcgpu submit SPEC`: to SLURM (through submitit), or here with the local executor."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import click

from hpcgpu.cli.options import read_spec, spec_options
from hpcgpu.errors import JobFailed
from hpcgpu.contract import EXIT_STOPPED
from hpcgpu.launch.jobs import log_files
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.checks import check_host
from hpcgpu.launch.rundir import find_unfinished_run, make_run_dir
from hpcgpu.launch.sweep import SweepTask, sweep_tasks, with_sweep, write_sweep
from hpcgpu.spec import Spec, dump_spec


def say(message: str) -> None:
    click.echo(f"hpcgpu: {message}", err=True)


@click.command()
@spec_options
@click.option("--executor", type=click.Choice(["slurm", "local"]), default="slurm", show_default=True,
              help="Where the job runs.")
@click.option("--sweep", "sweeps", multiple=True, metavar="KEY=V1,V2",
              help="Sweep a spec key over values (grid with the spec's sweep:); one job array. Repeatable.")
@click.option("--dry-run", is_flag=True, help="Print the resolved spec and the script that would be submitted; "
                                              "submit nothing.")
@click.option("--wait", is_flag=True, help="SLURM: wait for the job and exit with its status.")
@click.option("--new", "fresh", is_flag=True,
              help="Local executor: start a fresh run dir instead of resuming an unfinished run of the same spec.")
def submit(spec_file: str, overrides: tuple[str, ...], gpus: int | None, nodes: int | None, executor: str,
           sweeps: tuple[str, ...], dry_run: bool, wait: bool, fresh: bool) -> int:
    """Submit SPEC to SLURM and return at once (job id, run dir, logs); --executor local runs it here."""
    spec = with_sweep(read_spec(spec_file, overrides, gpus, nodes), sweeps)
    # what the job would fail on after its wait in the queue, found here (one line, exit 2)
    check_host(spec, passthrough="warn" if dry_run else "error", slurm=executor == "slurm", warn=say)
    spec_ref = str(Path(spec_file).resolve())
    if executor == "local":
        return submit_local(spec, spec_ref, dry_run, fresh)
    return submit_slurm(spec, spec_ref, dry_run, wait)


# --- SLURM ----------------------------------------------------------------------------------------

def submit_slurm(spec: Spec, spec_ref: str, dry_run: bool, wait: bool) -> int:
    from hpcgpu.launch import submission

    if dry_run:
        return print_dry_run(spec)
    registry = Registry()
    records = submission.submit_to_slurm(spec, spec_ref, registry)
    for record in records:
        print_submitted(record, spec)
    if not wait:
        return 0
    from hpcgpu.launch.jobs import exit_status, wait_for

    wait_for(registry, records, say)
    code = exit_status(records)
    if code:
        ids = ", ".join(r.job_id for r in records)
        raise JobFailed(f"job {ids} ended {', '.join(r.state for r in records)}; `hpcgpu logs` shows why", code)
    return 0


def print_dry_run(spec: Spec) -> int:
    from hpcgpu.launch import submission
    from hpcgpu.errors import SchedulerError

    tasks = sweep_tasks(spec)
    try:
        submission.check_cluster(tasks[0].spec if tasks else spec)
    except SchedulerError as exc:  # no SLURM here: the script can still be shown
        say(f"warning: the request was not checked against the cluster: {exc}")
    click.echo("# --- resolved spec ---")
    click.echo(dump_spec(spec), nl=False)
    for task in tasks:
        click.echo(f"# sweep task {task.index}: {task.label()}")
    click.echo("# --- batch script (submitted by submitit; nothing was submitted) ---")
    click.echo(submission.dry_run_script(spec, tasks), nl=False)
    return 0


def print_submitted(record: JobRecord, spec: Spec) -> None:
    run_dir = Path(record.run_dir)
    if not record.is_array:
        click.echo(f"job      {record.job_id}")
        click.echo(f"run dir  {run_dir}")
        out, err = log_files(record, None)
        click.echo(f"stdout   {out}")
        click.echo(f"stderr   {err}")
        return
    limit = spec.slurm.array_parallelism
    at_once = f", at most {limit} at once" if limit else ""
    click.echo(f"job      {record.job_id} (array of {len(record.tasks)} tasks{at_once})")
    click.echo(f"run dir  {run_dir}")
    for task in record.tasks:
        values = " ".join(f"{k}={v}" for k, v in task.values.items())
        click.echo(f"task     {task.id}  {task.run_dir}  {values}")
    click.echo(f"logs     <task run dir>/slurm-{record.job_id}_<task>.out|.err")


# --- local executor -------------------------------------------------------------------------------

def submit_local(spec: Spec, spec_ref: str, dry_run: bool, fresh: bool) -> int:
    from hpcgpu.procs import die_with_parent

    die_with_parent()  # started by `hpcgpu queue`: this job ends with the queue (a no-op otherwise)
    tasks = sweep_tasks(spec)
    if dry_run:
        click.echo(dump_spec(spec), nl=False)
        for task in tasks:
            click.echo(f"# sweep task {task.index}: {task.label()}")
        click.echo(f"# would run {spec.resources.gpus} local rank(s): python -m hpcgpu run <run dir>/spec.yaml"
                   + (f", for each of {len(tasks)} sweep tasks in turn" if tasks else ""))
        return 0
    if tasks:
        return run_local_sweep(spec, spec_ref, tasks)
    import contextlib

    from hpcgpu.launch import runlock

    registry = Registry()
    run_dir = None if fresh else find_unfinished_run(spec)
    if run_dir is not None and run_dirs_in_use(registry)(run_dir):
        # the same command while the job (or ranks it left) still runs: never a second writer
        raise runlock.RunDirLocked(run_dir)
    with contextlib.ExitStack() as held:
        if run_dir is not None:
            held.enter_context(runlock.hold(run_dir))  # RunDirLocked if one took it just now
            say(f"resuming the unfinished run {run_dir} (same spec; --new starts afresh)")
        else:
            for attempt in range(3):
                run_dir = make_run_dir(spec)
                try:  # locked from here until the ranks have ended (the executor holds it too)
                    held.enter_context(runlock.hold(run_dir))
                    break
                except runlock.RunDirLocked:  # a concurrent same-spec submit took our new dir
                    if attempt == 2:
                        raise
        record = registry.add(local_record(spec, spec_ref, run_dir))
        job_id = record.job_id
        click.echo(f"job {job_id} (local), run dir {run_dir}", err=True)
        code = run_recorded(registry, record, spec, run_dir)
    if code == EXIT_STOPPED:
        click.echo(f"job {job_id} stopped at a checkpoint; run the same command again to resume", err=True)
        return code
    if code:
        f = record.failure or {}
        # the error line itself is on the console already (rank 0 echoes; one line per job)
        who = f"rank {f['rank']} on {f['node']} first, " if f.get("rank") is not None else ""
        raise JobFailed(f"job {job_id} failed ({who}exit code {code}); logs in {run_dir / 'logs'}", code)
    click.echo(f"job {job_id} completed; run dir {run_dir}", err=True)
    return 0


def run_dirs_in_use(registry: Registry) -> Callable[[Path], bool]:
    """Run dirs that a live local job writes to: a second executor must not resume into them.
    Locked (any rank of a live job holds <run dir>/.lock, even after its launcher was killed), or
    recorded as run by a live local executor (a job started before run dirs were locked)."""
    from hpcgpu.launch.jobs import executor_alive
    from hpcgpu.launch.runlock import is_locked

    def in_use(run_dir: Path) -> bool:
        return is_locked(run_dir) or any(j.executor == "local" and j.state == "RUNNING" and executor_alive(j)
                                         for j in registry.with_run_dir(str(run_dir)))

    return in_use


def local_record(spec: Spec, spec_ref: str, run_dir: Path) -> JobRecord:
    from hpcgpu.launch.jobs import process_start

    pid = os.getpid()
    # job_id "" -> the registry assigns local-<n> in the same transaction as the insert
    record = JobRecord("", spec.name, spec_ref, str(run_dir), "local", state="RUNNING", pid=pid,
                       pid_start=process_start(pid))
    record.gpus = local_gpu_count(spec)  # for the GPU-hours `status` shows (0 on CPU)
    return record


def local_gpu_count(spec: Spec) -> int:
    from hpcgpu.launch.local import local_gpus

    return min(len(local_gpus(spec)), spec.resources.gpus)


def local_state(registry: Registry, record: JobRecord, code: int) -> tuple[str, str]:
    cancelled = registry.find(record.job_id)[0].cancel_requested
    if code == 0:
        return "COMPLETED", ""
    if cancelled:
        return "CANCELLED", "hpcgpu cancel"
    if code == EXIT_STOPPED:
        return "PREEMPTED", "stopped at a checkpoint; the same command resumes it"
    return "FAILED", f"exit code {code}"


def run_recorded(registry: Registry, record: JobRecord, spec: Spec, run_dir: Path,
                 task: TaskRecord | None = None) -> int:
    """Run the ranks here and record how they ended (the job's, or one sweep task's, state)."""
    import time

    from hpcgpu.launch.jobs import explain_failures
    from hpcgpu.launch.local import run_local

    try:
        code = run_local(spec, run_dir / "spec.yaml", run_dir, task.id if task else record.job_id, echo=sys.stdout)
    except BaseException:
        registry.update(record, state="FAILED", reason="the local executor failed", ended=time.time())
        raise
    state, reason = local_state(registry, record, code)
    target = task or record
    target.state, target.reason, target.exit_code = state, reason, code
    if task is None or task is record.tasks[-1] or state == "CANCELLED":
        record.state = state if task is None else _sweep_state(record)
        record.ended = time.time()
    explain_failures(record)  # which rank failed first, and its last error line, for status and the CLI
    registry.save(record)
    return code


def _sweep_state(record: JobRecord) -> str:
    from hpcgpu.launch.jobs import array_state

    return array_state([t for t in record.tasks if t.state != "PENDING"] or record.tasks)


def run_local_sweep(spec: Spec, spec_ref: str, tasks: list[SweepTask]) -> int:
    """A sweep with the local executor: the tasks one after another, as one registered job."""
    sweep = write_sweep(spec, tasks)
    registry = Registry()
    record = registry.add(local_record(spec, spec_ref, sweep.root))
    record.tasks = [TaskRecord(f"{record.job_id}_{t.index}", str(d), t.values, gpus=record.gpus)
                    for t, d in zip(tasks, sweep.run_dirs)]
    registry.save(record)
    click.echo(f"job {record.job_id} (local sweep of {len(tasks)} tasks), run dir {sweep.root}", err=True)
    worst = 0
    for task, run_dir, entry in zip(tasks, sweep.run_dirs, record.tasks):
        say(f"task {entry.id}: {task.label()}")
        code = run_recorded(registry, record, task.spec, run_dir, entry)
        worst = worst or code
        if entry.state == "CANCELLED":
            break
    if worst:
        raise JobFailed(f"job {record.job_id}: a sweep task ended with exit code {worst}; `hpcgpu status "
                        f"{record.job_id}` shows which", worst)
    click.echo(f"job {record.job_id} completed; run dir {sweep.root}", err=True)
    return 0
