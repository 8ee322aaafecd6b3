"""`hpcgpu run SPEC`: the in-job entrypoint, one process per GPU, the same under every launcher."""
from __future__ import annotations

import os
from pathlib import Path

import click

from hpcgpu.cli.options import set_option
from hpcgpu.contract import ENV_RUN_DIR, ENV_SPEC, RunPaths
from hpcgpu.spec import load_spec


@click.command()
@click.argument("spec_file", metavar="SPEC", type=click.Path(dir_okay=False))
@set_option
def run(spec_file: str, overrides: tuple[str, ...]) -> int:
    """Run SPEC's task as one rank. Launchers (srun, the local executor, torchrun) start one per GPU."""
    spec = load_spec(spec_file, overrides)
    spec_path = Path(spec_file).resolve()
    # the run dir is the spec's folder unless the launcher said otherwise: decided once, here, and
    # exported because the user's code (hpcgpu.init(), a command's program) reads it too
    paths = RunPaths.in_job(spec_path)
    os.environ[ENV_RUN_DIR] = str(paths.run_dir)
    os.environ[ENV_SPEC] = str(spec_path)
    from hpcgpu.runtime.tasks import run_task  # torch loads only here, inside the job

    return run_task(spec, spec_path, paths)
