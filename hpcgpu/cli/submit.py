"""`hpcgpu submit SPEC`: to SLURM (through submitit), or here with the local executor."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, NoReturn

import click

from hpcgpu.cli.options import ignore_busy_option, spec_options
from hpcgpu.contract import EXIT_STOPPED
from hpcgpu.errors import JobFailed
from hpcgpu.launch import local_submit
from hpcgpu.launch.chain import Upstream, find_upstream, record_not_run, record_waiting, wait_upstream
from hpcgpu.launch.executors import EXECUTORS, Submit, executor_for, executor_named, refresh
from hpcgpu.launch.progress import stop_summary
from hpcgpu.launch.registry import JobRecord, Registry
from hpcgpu.launch.resolve import Resolved, read_resolved
from hpcgpu.launch.wait import exit_status, wait_for
from hpcgpu.spec import Spec


def say(message: str) -> None:
    click.echo(f"hpcgpu: {message}", err=True)


@click.command()
@spec_options
@click.option("--executor", "executor_name", type=click.Choice(list(EXECUTORS)), default="slurm", show_default=True,
              help="Where the job runs.")
@click.option("--sweep", "sweeps", multiple=True, metavar="KEY=V1,V2",
              help="Sweep a spec key over values (grid with the spec's sweep:); one job array. Repeatable.")
@click.option("--dry-run", is_flag=True, help="Print the resolved spec and the script that would be submitted; "
                                              "submit nothing.")
@click.option("--wait", is_flag=True,
              help="SLURM: wait for the job and exit with its status (the code of the rank that failed first).")
@click.option("--new", "fresh", is_flag=True,
              help="Start a fresh run dir instead of resuming the unfinished run of the same spec (one job; "
                   "a sweep always starts fresh).")
@click.option("--after", "after_ref", metavar="JOB", default=None,
              help="Run once JOB (a job, an array or one array task) has completed successfully; ${after} in "
                   "the spec's values is JOB's run dir. SLURM: --dependency=afterok:JOB; local: waits here.")
@ignore_busy_option
def submit(spec_file: str, overrides: tuple[str, ...], gpus: int | None, nodes: int | None, executor_name: str,
           sweeps: tuple[str, ...], dry_run: bool, wait: bool, fresh: bool, after_ref: str | None,
           ignore_busy: bool) -> int:
    """Submit SPEC to SLURM and return at once (job id, run dir, logs); --executor local runs it here."""
    executor = executor_named(executor_name)
    registry = Registry()
    upstream = find_upstream(registry, after_ref, refresh) if after_ref else None

    def resolve_now() -> Resolved:
        # what the job would fail on after its wait in the queue, found here (one line, exit 2)
        return read_resolved(spec_file, overrides, gpus, nodes, sweeps, executor.use(dry_run), say, upstream)

    resolved = resolve_now()
    if dry_run:
        click.echo(executor.dry_run(resolved, say), nl=False)
        return 0
    spec_ref = str(Path(spec_file).resolve())
    waiting = None
    if upstream is not None and executor.runs_here and not upstream.ended:
        waiting = record_waiting(registry, resolved.spec, spec_ref, upstream, executor.name)
        upstream = wait_upstream(registry, upstream, refresh, say)
        if not upstream.completed:
            not_run(registry, waiting, upstream)
        resolved = resolve_now()  # checked again, now that the outputs it refers to are there
    how = Submit(fresh=fresh, ignore_busy=ignore_busy, say=say, started=chained(registry, upstream), waiting=waiting)
    records = executor.submit(resolved, spec_ref, registry, how)
    if executor.runs_here:
        return ended_here(records[0], fresh)
    for record in records if upstream is not None else []:
        registry.update(record, after=upstream.ref)
    return submitted(records, resolved.spec, wait)


# --- submit --after JOB -------------------------------------------------------------------------------

def chained(registry: Registry, upstream: Upstream | None) -> Callable[[JobRecord], None]:
    """A local job, registered: record the job it ran after, then say it started."""
    def started(record: JobRecord) -> None:
        if upstream is not None:
            registry.update(record, after=upstream.ref)
        say_started(record)

    return started


def not_run(registry: Registry, waiting: JobRecord, upstream: Upstream) -> NoReturn:
    """The local job waited for a job that did not complete: recorded as not run, exit 1."""
    record = record_not_run(registry, waiting, upstream)
    raise JobFailed(f"job {record.job_id} not run: job {upstream.ref} ended {upstream.state}; "
                    f"`hpcgpu status {record.job_id}` shows it", 1)


# --- SLURM: submitted, waiting in its queue -------------------------------------------------------

def submitted(records: list[JobRecord], spec: Spec, wait: bool) -> int:
    for record in records:
        print_submitted(record, spec)
    if not wait:
        return 0
    registry = Registry()
    wait_for(registry, records, say)
    code = exit_status(records)
    if code:
        ids = ", ".join(r.job_id for r in records)
        raise JobFailed(f"job {ids} ended {', '.join(r.state for r in records)}; `hpcgpu logs` shows why", code)
    return 0


def print_submitted(record: JobRecord, spec: Spec) -> None:
    run_dir = Path(record.run_dir)
    if not record.is_array:
        click.echo(f"job      {record.job_id}")
        click.echo(f"run dir  {run_dir}")
        out, err = executor_for(record).log_files(record, None)
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


# --- the local executor: the job ran here and has ended -------------------------------------------

def say_started(record: JobRecord) -> None:
    what = f"local sweep of {len(record.tasks)} tasks" if record.tasks else "local"
    click.echo(f"job {record.job_id} ({what}), run dir {record.run_dir}", err=True)


def ended_here(record: JobRecord, fresh: bool) -> int:
    """How a job run here ended, on one line; exit with its code (a sweep: the worst task's)."""
    if record.tasks:
        return sweep_ended(record)
    return one_ended(record, fresh)


def sweep_ended(record: JobRecord) -> int:
    worst = local_submit.exit_code(record)
    if record.state == "CANCELLED":
        click.echo(f"job {record.job_id} cancelled; `hpcgpu status {record.job_id}` shows its tasks", err=True)
        return worst
    if worst:
        raise JobFailed(f"job {record.job_id}: a sweep task ended with exit code {worst}; `hpcgpu status "
                        f"{record.job_id}` shows which", worst)
    click.echo(f"job {record.job_id} completed; run dir {record.run_dir}", err=True)
    return 0


def one_ended(record: JobRecord, fresh: bool) -> int:
    """One job run here (resuming an unfinished run of the same spec unless --new)."""
    code, job_id, run_dir = local_submit.exit_code(record), record.job_id, Path(record.run_dir)
    if code == EXIT_STOPPED:
        # --new again would start afresh in another run dir: the command that resumes is without it
        again = "the same command without --new" if fresh else "the same command again"
        click.echo(f"job {job_id} {stop_summary(run_dir)}; run {again} to go on", err=True)
        return code
    if record.state == "CANCELLED":  # hpcgpu cancel, or a second Ctrl-C: the user's doing, not a failure
        click.echo(f"job {job_id} cancelled ({record.reason}); run dir {run_dir}", err=True)
        return code
    if code:
        f = record.failure or {}
        # the error line itself is on the console already (rank 0 echoes; one line per job)
        who = f"rank {f['rank']} on {f['node']} first, " if f.get("rank") is not None else ""
        raise JobFailed(f"job {job_id} failed ({who}exit code {code}); logs in {run_dir / 'logs'}", code)
    click.echo(f"job {job_id} completed; run dir {run_dir}", err=True)
    return 0
