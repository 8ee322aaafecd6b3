"""`hpcgpu registry rebuild`: rows of the job registry recovered from the run dirs a runs_dir holds
(after a damaged registry was moved aside)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from hpcgpu.contract import first_failure, is_finished
from hpcgpu.launch.failures import described
from hpcgpu.launch.registry import JobRecord, Registry


RUN_ID_TIME = "%Y%m%d-%H%M%S"  # a run dir's name starts with its start time (launch/state.py)


def rebuild_rows(runs_dirs: Sequence[Path], registry: Registry) -> list[JobRecord]:
    """A row for every run dir under `runs_dirs` (<runs_dir>/<name>/<run id>/spec.yaml) that the
    registry lacks: its SLURM job id where a slurm-<id>.out is there (else a local id), COMPLETED
    where it finished, FAILED with the first failure where a rank recorded one, else STOPPED (an
    unfinished run: submitting its spec again resumes it)."""
    known = {job.run_dir for job in registry.all()}
    added = []
    for spec in sorted(p for d in runs_dirs for p in Path(d).glob("*/*/spec.yaml")):
        run_dir = spec.parent.resolve()
        if str(run_dir) in known:
            continue
        slurm = sorted(run_dir.glob("slurm-*.out"), key=lambda p: p.stat().st_mtime)
        failure = first_failure(run_dir)
        state = "COMPLETED" if is_finished(run_dir) else "FAILED" if failure is not None else "PREEMPTED"
        job = JobRecord(job_id=slurm[-1].stem.removeprefix("slurm-").split("_")[0] if slurm else "",
                        name=run_dir.parent.name, spec=str(spec), run_dir=str(run_dir),
                        executor="slurm" if slurm else "local", state=state, submitted=run_started(run_dir),
                        reason="rebuilt from the run dir", failure=described(failure)[0] if failure else None)
        added.append(registry.add(job))
    return added


def run_started(run_dir: Path) -> float:
    try:
        return time.mktime(time.strptime(run_dir.name[:15], RUN_ID_TIME))
    except ValueError:
        return run_dir.stat().st_mtime
