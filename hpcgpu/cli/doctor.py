"""`hpcgpu doctor [SPEC]`: the health of this machine, or (--submit) of every node and GPU of a SLURM
allocation, in one table; exit 1 when a check fails (hpcgpu/doctor.py has the checks)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Optional

import click

from hpcgpu.cli.options import gpus_option, nodes_option, read_spec, set_option
from hpcgpu.cli.table import format_table
from hpcgpu.contract import ENV_RUN_DIR
from hpcgpu.errors import UsageError

JOB_TIME = "00:15:00"
OUT_DIR = "doctor"  # in the doctor job's run dir: rank-<N>.json


@click.command()
@click.argument("spec_file", metavar="[SPEC]", required=False)
@set_option
@gpus_option
@nodes_option
@click.option("--runs-dir", default=None, help="The runs_dir to check (default: SPEC's, else ./runs).")
@click.option("--submit", is_flag=True, help="Run the checks as a SLURM job over --nodes x --gpus (SPEC's partition, "
                                             "account and setup where given) and wait for the table.")
@click.option("--quick", is_flag=True, help="Smaller measurements (seconds, not tens of seconds).")
@click.option("--json", "as_json", is_flag=True, help="The rows as JSON.")
@click.option("--in-job", is_flag=True, hidden=True)
def doctor(spec_file: Optional[str], overrides: tuple[str, ...], gpus: Optional[int], nodes: Optional[int],
           runs_dir: Optional[str], submit: bool, quick: bool, as_json: bool, in_job: bool) -> int:
    """Check GPUs (NVML health, matmul TFLOP/s, host->GPU bandwidth), the all-reduce between them,
    the runs_dir (free space, write speed) and a TCP port, here or on the nodes of a SLURM job."""
    from hpcgpu import doctor as checks

    if in_job:  # one rank of the doctor job
        return checks.check_in_job(Path(os.environ[ENV_RUN_DIR]) / OUT_DIR, quick)
    spec = read_spec(spec_file, overrides, gpus, nodes) if spec_file else None
    where = Path(runs_dir or (spec.runs_dir if spec else "runs")).expanduser().absolute()
    if submit:
        rows, code = run_as_job(spec, where, gpus, nodes, quick, as_json)
    else:
        if spec_file is None and (gpus or nodes):
            raise UsageError("--gpus and --nodes size a doctor job: add --submit")
        rows = checks.check_here(where, quick)
        code = checks.exit_code(rows)
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        click.echo(format_table([("CHECK", "WHERE", "RESULT", "STATUS")]
                                + [(r.check, r.where, r.result, r.status) for r in rows]))
        failed = [r for r in rows if r.status == "FAIL"]
        if failed:
            click.echo(f"hpcgpu: {len(failed)} check(s) failed: " + "; ".join(
                f"{r.check} on {r.where}" for r in failed), err=True)
    return code


def doctor_spec(spec: object, runs_dir: Path, gpus: Optional[int], nodes: Optional[int], quick: bool) -> object:
    """A `task: command` spec running `hpcgpu doctor --in-job` on every GPU of the allocation."""
    from hpcgpu.spec import spec_from_raw

    argv = [sys.executable, "-m", "hpcgpu", "doctor", "--in-job"] + (["--quick"] if quick else [])
    if spec is not None:  # SPEC's slurm settings and resources, our command
        return dataclasses.replace(spec, name=f"{spec.name}-doctor", task="command", command=argv,  # type: ignore
                                   sweep={}, runs_dir=str(runs_dir))
    raw = {"name": "doctor", "task": "command", "command": argv, "runs_dir": str(runs_dir),
           "resources": {"gpus": gpus or 1, "nodes": nodes or 1, "cpus_per_gpu": 1, "time": JOB_TIME}}
    return spec_from_raw(raw, need_data=False)


def run_as_job(spec: object, runs_dir: Path, gpus: Optional[int], nodes: Optional[int], quick: bool,
               quiet: bool) -> tuple[list, int]:
    from hpcgpu import doctor as checks
    from hpcgpu.cli.submit import print_submitted, say
    from hpcgpu.launch.executors import Submit, executor_named
    from hpcgpu.launch.registry import Registry
    from hpcgpu.launch.resolve import resolve
    from hpcgpu.launch.wait import exit_status, wait_for

    slurm = executor_named("slurm")
    # the resolve step's host checks, as for `hpcgpu submit`: what the job would fail on, found here
    # (no warnings: SPEC's track settings are not this job's, whose command is ours)
    job = resolve(doctor_spec(spec, runs_dir, gpus, nodes, quick), slurm.use(dry_run=False))  # type: ignore[arg-type]
    registry = Registry()
    records = slurm.submit(job, "hpcgpu doctor", registry, Submit(fresh=True))
    for record in records if not quiet else []:  # --json: stdout is the rows alone
        print_submitted(record, job.spec)
    wait_for(registry, records, say)
    rows = checks.read_job_rows(Path(records[0].run_dir) / OUT_DIR)
    code = exit_status(records)
    if code:
        rows.append(checks.Check("doctor job", records[0].job_id, f"{records[0].state}: {records[0].reason}", "FAIL"))
    return rows, max(code and 1, checks.exit_code(rows))
