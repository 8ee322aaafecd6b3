"""`hpcgpu registry`: the job registry itself (hpcgpu/launch/registry.py)."""
from __future__ import annotations

from pathlib import Path

import click

from hpcgpu.launch.rebuild import rebuild_rows
from hpcgpu.launch.registry import Registry


@click.group()
def registry() -> None:
    """The job registry ($HPCGPU_REGISTRY, else ~/.local/state/hpcgpu/jobs.db)."""


@registry.command()
@click.argument("runs_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
def rebuild(runs_dirs: tuple[str, ...]) -> int:
    """Add a row for every run dir under RUNS_DIRS the registry lacks (after a damaged registry was moved
    aside): its job id, COMPLETED, FAILED (with the rank that failed) or PREEMPTED, from the run dir."""
    reg = Registry()
    reg.check()
    added = rebuild_rows([Path(d) for d in runs_dirs], reg)
    for job in added:
        click.echo(f"{job.job_id:<14} {job.state:<10} {job.run_dir}")
    click.echo(f"{len(added)} job(s) added to {reg.path}", err=True)
    return 0
