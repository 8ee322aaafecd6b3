"""`hpcgpu submit SPEC`: to SLURM (through submitit), or here with the local executor."""
from __future__ import annotations

from pathlib import Path

import click

from hpcgpu.cli.options import ignore_busy_option, spec_options
from hpcgpu.contract import EXIT_STOPPED
from hpcgpu.errors import JobFailed, SchedulerError
from hpcgpu.launch import local_submit, submission
from hpcgpu.launch.cancel import exit_status, wait_for
from hpcgpu.launch.joblogs import log_files
from hpcgpu.launch.progress import stop_summary
from hpcgpu.launch.registry import JobRecord, Registry
from hpcgpu.launch.resolve import Resolved, read_resolved, submit_use
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
@click.option("--wait", is_flag=True,
              help="SLURM: wait for the job and exit with its status (the code of the rank that failed first).")
@click.option("--new", "fresh", is_flag=True,
              help="Start a fresh run dir instead of resuming the unfinished run of the same spec (one job; "
                   "a sweep always starts fresh).")
@ignore_busy_option
def submit(spec_file: str, overrides: tuple[str, ...], gpus: int | None, nodes: int | None, executor: str,
           sweeps: tuple[str, ...], dry_run: bool, wait: bool, fresh: bool, ignore_busy: bool) -> int:
    """Submit SPEC to SLURM and return at once (job id, run dir, logs); --executor local runs it here."""
    # what the job would fail on after its wait in the queue, found here (one line, exit 2)
    resolved = read_resolved(spec_file, overrides, gpus, nodes, sweeps, submit_use(executor, dry_run), say)
    spec_ref = str(Path(spec_file).resolve())
    if executor == "local":
        return run_here(resolved, spec_ref, dry_run, fresh, ignore_busy)
    return submit_slurm(resolved, spec_ref, dry_run, wait, fresh)


# --- SLURM ----------------------------------------------------------------------------------------

def submit_slurm(resolved: Resolved, spec_ref: str, dry_run: bool, wait: bool, fresh: bool = False) -> int:
    if dry_run:
        return print_dry_run(resolved)
    registry = Registry()
    records = submission.submit_to_slurm(resolved.spec, resolved.tasks, spec_ref, registry, fresh, say)
    for record in records:
        print_submitted(record, resolved.spec)
    if not wait:
        return 0
    wait_for(registry, records, say)
    code = exit_status(records)
    if code:
        ids = ", ".join(r.job_id for r in records)
        raise JobFailed(f"job {ids} ended {', '.join(r.state for r in records)}; `hpcgpu logs` shows why", code)
    return 0


def print_dry_run(resolved: Resolved) -> int:
    spec, tasks = resolved.spec, resolved.tasks
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

def run_here(resolved: Resolved, spec_ref: str, dry_run: bool, fresh: bool, ignore_busy: bool) -> int:
    """The local executor (hpcgpu/launch/local_submit.py) runs the job here; this prints."""
    spec, tasks = resolved.spec, resolved.tasks
    if dry_run:
        click.echo(dump_spec(spec), nl=False)
        for task in tasks:
            click.echo(f"# sweep task {task.index}: {task.label()}")
        click.echo(f"# would run {spec.world_size} local rank(s): python -m hpcgpu run <run dir>/spec.yaml"
                   + (f", for each of {len(tasks)} sweep tasks in turn" if tasks else ""))
        return 0
    Registry().check()  # a damaged or unwritable registry stops here, before any run dir or rank exists
    if tasks:
        return run_sweep_here(resolved, spec_ref, ignore_busy)
    return run_one_here(spec, spec_ref, fresh, ignore_busy)


def run_sweep_here(resolved: Resolved, spec_ref: str, ignore_busy: bool) -> int:
    """A sweep's tasks one after another here; exit with the worst task's code."""
    count = len(resolved.tasks)

    def started(record: JobRecord) -> None:
        click.echo(f"job {record.job_id} (local sweep of {count} tasks), run dir {record.run_dir}", err=True)

    record = local_submit.submit_local_sweep(resolved.spec, resolved.tasks, spec_ref, Registry(),
                                             ignore_busy=ignore_busy, say=say, started=started)
    worst = local_submit.exit_code(record)
    if record.state == "CANCELLED":
        click.echo(f"job {record.job_id} cancelled; `hpcgpu status {record.job_id}` shows its tasks", err=True)
        return worst
    if worst:
        raise JobFailed(f"job {record.job_id}: a sweep task ended with exit code {worst}; `hpcgpu status "
                        f"{record.job_id}` shows which", worst)
    click.echo(f"job {record.job_id} completed; run dir {record.run_dir}", err=True)
    return 0


def run_one_here(spec: Spec, spec_ref: str, fresh: bool, ignore_busy: bool) -> int:
    """One job here (resuming an unfinished run of the same spec unless --new); its end, on one line."""
    def started(record: JobRecord) -> None:
        click.echo(f"job {record.job_id} (local), run dir {record.run_dir}", err=True)

    record = local_submit.submit_local(spec, spec_ref, Registry(), fresh=fresh, ignore_busy=ignore_busy, say=say,
                                       started=started)
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
