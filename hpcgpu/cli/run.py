"""`hpcgpu run SPEC`: the in-job entrypoint, one process per GPU, the same under every launcher."""
from __future__ import annotations

import os
from pathlib import Path

import click

from hpcgpu.cli.options import set_option
from hpcgpu.spec import load_spec


@click.command()
@click.argument("spec_file", metavar="SPEC", type=click.Path(dir_okay=False))
@set_option
def run(spec_file: str, overrides: tuple[str, ...]) -> int:
    """Run SPEC's task as one rank. Launchers (srun, the local executor, torchrun) start one per GPU."""
    spec = load_spec(spec_file, overrides)
    spec_path = Path(spec_file).resolve()
    # the run dir is the spec's folder unless the launcher said otherwise; user code reads these too
    os.environ.setdefault("HPCGPU_RUN_DIR", str(spec_path.parent))
    os.environ["HPCGPU_SPEC"] = str(spec_path)
    from hpcgpu.runtime.tasks import run_task  # torch loads only here, inside the job

    return run_task(spec, spec_path)
