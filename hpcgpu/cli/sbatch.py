"""`hpcgpu sbatch SPEC -o FILE`: a readable sbatch script, with the resolved spec in the run dir."""
from __future__ import annotations

import shutil
from pathlib import Path

import click

from hpcgpu.cli.options import spec_options
from hpcgpu.contract import RunPaths
from hpcgpu.errors import UsageError
from hpcgpu.launch.chain import AFTER, references
from hpcgpu.launch.resolve import SBATCH, resolve
from hpcgpu.launch.rundir import make_run_dir, run_dir_path, runs_dir_error, write_atomic
from hpcgpu.launch.sbatch import render_sbatch
from hpcgpu.spec import load_spec


@click.command()
@spec_options
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Also write the script here (it is always written to the run dir as job.sbatch).")
def sbatch(spec_file: str, overrides: tuple[str, ...], gpus: int | None, nodes: int | None,
           output: str | None) -> None:
    """Write an sbatch script for SPEC; submit it with `sbatch FILE`."""
    spec = load_spec(spec_file, overrides, gpus=gpus, nodes=nodes, defaults=True)
    if spec.sweep:
        # one script is one job: rendering only the first point would silently drop the others
        raise UsageError(f"the spec sweeps {', '.join(spec.sweep)}: `hpcgpu submit` runs a sweep as one job "
                         "array; for a single script, pick values with --set and --set sweep={}")
    if references(spec):  # before the host checks, which would look for a file named ${after}/...
        raise UsageError(f"the spec uses {AFTER} (the run dir of the job it follows), which only `hpcgpu submit "
                         "--after JOB` fills in; for a script, give those values with --set (e.g. --set "
                         "model.name_or_path=DIR)")
    if output and Path(output).parent and not Path(output).parent.exists():
        raise UsageError(f"-o {output}: the folder {Path(output).parent} does not exist")
    # env_passthrough only warns: the script takes the values from the shell that runs `sbatch` later
    spec = resolve(spec, SBATCH, say=lambda message: click.echo(f"hpcgpu: {message}", err=True)).spec
    run_dir = run_dir_path(spec)
    spec_path = RunPaths(run_dir).spec
    text = render_sbatch(spec, run_dir, spec_path, script_hint=output or str(run_dir / "job.sbatch"))
    make_run_dir(spec, run_id=run_dir.name, spec_file=spec_file)  # only once the script renders: no run dir for a refused one
    try:
        write_atomic(run_dir / "job.sbatch", text, mode=0o755)
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise runs_dir_error(spec.runs_dir, exc, run_dir / "job.sbatch") from None
    if output:
        try:
            write_atomic(Path(output), text, mode=0o755)
        except OSError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)  # no run dir for a script that was not written
            raise UsageError(f"-o {output}: cannot write it: {exc.strerror or exc}") from None
    click.echo(f"script   {output or run_dir / 'job.sbatch'}")
    click.echo(f"spec     {spec_path}")
    click.echo(f"run dir  {run_dir}")
    click.echo(f"submit:  sbatch {output or run_dir / 'job.sbatch'}")
