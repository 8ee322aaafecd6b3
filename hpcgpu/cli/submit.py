"""`hpcgpu submit SPEC`: to SLURM, or here with the local executor."""
from __future__ import annotations

import sys

import click

from hpcgpu.cli.options import read_spec, spec_options
from hpcgpu.errors import HpcgpuError, JobFailed
from hpcgpu.launch.exitcodes import EXIT_STOPPED
from hpcgpu.launch.rundir import find_unfinished_run, make_run_dir, missing_inputs


@click.command()
@spec_options
@click.option("--executor", type=click.Choice(["slurm", "local"]), default="slurm", show_default=True,
              help="Where the job runs.")
@click.option("--dry-run", is_flag=True, help="Print the resolved spec and what would run; submit nothing.")
@click.option("--new", "fresh", is_flag=True,
              help="Local executor: start a fresh run dir instead of resuming an unfinished run of the same spec.")
def submit(spec_file: str, overrides: tuple[str, ...], gpus: int | None, nodes: int | None, executor: str,
           dry_run: bool, fresh: bool) -> int:
    """Submit SPEC. With --executor local it runs here, one process per GPU (or CPU rank)."""
    spec = read_spec(spec_file, overrides, gpus, nodes)
    if executor == "slurm":
        raise HpcgpuError("--executor slurm is not in this version yet: use `hpcgpu sbatch SPEC -o job.sbatch` "
                          "and `sbatch job.sbatch`, or --executor local")
    if dry_run:
        from hpcgpu.spec import dump_spec

        click.echo(dump_spec(spec), nl=False)
        click.echo(f"# would run {spec.resources.gpus} local rank(s): python -m hpcgpu run <run dir>/spec.yaml")
        return 0
    from hpcgpu.launch.local import run_local

    missing = missing_inputs(spec)
    if missing:
        raise HpcgpuError(f"file not found: {missing[0]}")

    run_dir = None if fresh else find_unfinished_run(spec)
    if run_dir is not None:
        click.echo(f"resuming the unfinished run {run_dir} (same spec; --new starts afresh)", err=True)
    else:
        run_dir = make_run_dir(spec)
    job_id = str(abs(hash(run_dir.name)) % 10**8)
    click.echo(f"job {job_id} (local), run dir {run_dir}", err=True)
    code = run_local(spec, run_dir / "spec.yaml", run_dir, job_id, echo=sys.stdout)
    if code == EXIT_STOPPED:
        click.echo(f"job {job_id} stopped at a checkpoint; run the same command again to resume", err=True)
        return code
    if code:
        raise JobFailed(f"job {job_id} failed with exit code {code}; logs in {run_dir / 'logs'}", code)
    click.echo(f"job {job_id} completed; run dir {run_dir}", err=True)
    return 0
