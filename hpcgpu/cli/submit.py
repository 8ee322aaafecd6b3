"""`hpcgpu submit SPEC`: to SLURM, or here with the local executor."""
from __future__ import annotations

import sys

import click

from hpcgpu.cli.options import read_spec, spec_options
from hpcgpu.errors import HpcgpuError, JobFailed
from hpcgpu.launch.rundir import make_run_dir


@click.command()
@spec_options
@click.option("--executor", type=click.Choice(["slurm", "local"]), default="slurm", show_default=True,
              help="Where the job runs.")
@click.option("--dry-run", is_flag=True, help="Print the resolved spec and what would run; submit nothing.")
def submit(spec_file: str, overrides: tuple[str, ...], gpus: int | None, nodes: int | None, executor: str,
           dry_run: bool) -> int:
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

    run_dir = make_run_dir(spec)
    job_id = str(abs(hash(run_dir.name)) % 10**8)
    click.echo(f"job {job_id} (local), run dir {run_dir}", err=True)
    code = run_local(spec, run_dir / "spec.yaml", run_dir, job_id, echo=sys.stdout)
    if code:
        raise JobFailed(f"job {job_id} failed with exit code {code}; logs in {run_dir / 'logs'}", code)
    click.echo(f"job {job_id} completed; run dir {run_dir}", err=True)
    return 0
