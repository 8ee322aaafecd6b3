"""`hpcgpu submit` to SLURM: check the request, make the run dir(s), submit with submitit, register.

A spec without a sweep is one job; a sweep is one job array (several when it is larger than the
cluster's MaxArraySize), one resolved spec and run dir per task.
"""
from __future__ import annotations

import contextlib
import fcntl
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hpcgpu.contract import RunPaths, is_finished
from hpcgpu.errors import HpcgpuError, SchedulerError
from hpcgpu.launch.options import per_node_text, sbatch_options
from hpcgpu.launch.preflight import check_request
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.rundir import (make_run_dir, resume_text, run_dir_path, runs_of_this_spec, shared_folder_note,
                                  take_spec)
from hpcgpu.launch.runlock import is_locked
from hpcgpu.launch.sbatch import ArrayIndex, render_body
from hpcgpu.launch.scheduler import max_array_size, read_cluster
from hpcgpu.launch.state import is_final
from hpcgpu.launch.sweep import SweepTask, array_chunks, array_range, check_one_script, write_sweep
from hpcgpu.spec import Spec

Options = list[tuple[str, "str | None"]]
# brings any jobs' states up to date, whichever executor ran them (hpcgpu/launch/executors.py `refresh`)
Refresh = Callable[[Registry, list[JobRecord]], list[JobRecord]]


@dataclass(frozen=True)
class Plan:
    """One batch script to submit: its options, its command (the script body), where it logs."""

    options: Options
    command: str
    folder: Path  # the run dir (of an array: the sweep dir)


def header(spec: Spec, spec_ref: str) -> str:
    r = spec.resources
    return (f'# hpcgpu job "{spec.name}" (task: {spec.task}, {spec.world_size} rank(s): {r.nodes} node(s) x '
            f"{per_node_text(spec)})\n# Submitted by `hpcgpu submit` through submitit. Resolved spec: {spec_ref}\n")


def single_plan(spec: Spec, run_dir: Path) -> Plan:
    spec_path = RunPaths(run_dir).spec
    return Plan(sbatch_options(spec, run_dir),
                header(spec, str(spec_path)) + render_body(spec, run_dir, spec_path), run_dir)


def array_plan(spec: Spec, root: Path, tasks_file: Path, offset: int, length: int) -> Plan:
    """spec: any task's spec (check_one_script made sure they share the batch script)."""
    options = sbatch_options(spec, root, array=array_range(length, spec.slurm.array_parallelism))
    index = ArrayIndex(tasks_file, offset)
    command = header(spec, f"line SLURM_ARRAY_TASK_ID+{offset}+1 of {tasks_file}") + render_body(
        spec, root, tasks_file, array=index)
    return Plan(options, command, root)


def check_cluster(spec: Spec) -> None:
    """Refuse, before anything is written, a request no node of the partition can hold (exit 2)."""
    check_request(spec, read_cluster())


def submit_plan(plan: Plan) -> str:
    from hpcgpu.launch.submitit_slurm import submit_command  # submitit loads only when submitting

    return submit_command(plan.folder, plan.options, plan.command)


def submit_single(spec: Spec, spec_file: str, registry: Registry, refresh: Refresh, fresh: bool = False,
                  say: Callable[[str], None] = lambda line: None) -> JobRecord:
    """One SLURM job of `spec`: in the newest unfinished run dir of the identical spec, resumed from its
    last complete checkpoint (as the local executor does), unless `fresh` or a job of it may still run."""
    check_cluster(spec)
    registry.check()  # a damaged or locked-out registry stops here: no job reaches SLURM untracked
    with contextlib.ExitStack() as held:
        run_dir = None if fresh else resumable_run(spec, registry, held, say, refresh)
        made = run_dir is None
        run_dir = make_run_dir(spec, spec_file=spec_file) if run_dir is None else run_dir
        note = shared_folder_note(spec, run_dir) if made else None
        if note:
            say(note)
        try:
            job_id = submit_plan(single_plan(spec, run_dir))
        except HpcgpuError:
            if made:
                shutil.rmtree(run_dir, ignore_errors=True)  # made a moment ago for this job, which never was
            raise
        return registry.add(JobRecord(job_id, spec.name, spec_file, str(run_dir), "slurm"))


def resumable_run(spec: Spec, registry: Registry, held: contextlib.ExitStack,
                  say: Callable[[str], None], refresh: Refresh) -> Path | None:
    """The newest unfinished run dir of the identical spec whose every job has ended (the registry's
    rows, brought up to date), claimed for this submission (a lock that a concurrent submit of the same
    spec finds taken); None: a new run dir. A dir with a job that may still run, or with none recorded
    (a submission in flight), is never a second job's."""
    run_dir = next((d for d in runs_of_this_spec(spec) if not is_finished(d)), None)
    if run_dir is None:
        return None
    claim = open(run_dir / ".submit.lock", "a")
    held.callback(claim.close)
    try:
        fcntl.flock(claim.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        say(f"{run_dir} is being submitted by another command; starting a new run")
        return None
    jobs = refresh(registry, registry.with_run_dir(str(run_dir)))
    if not jobs or is_locked(run_dir) or any(not is_final(j.state) for j in jobs):
        live = ", ".join(f"{j.job_id} {j.state}" for j in jobs if not is_final(j.state)) or "no ended job recorded"
        say(f"the unfinished run {run_dir} may still run ({live}); starting a new run (--new says so at once)")
        return None
    take_spec(run_dir, spec)
    say(resume_text(run_dir, spec))
    return run_dir


def submit_sweep(spec: Spec, tasks: list[SweepTask], spec_file: str, registry: Registry) -> list[JobRecord]:
    check_one_script(tasks)
    check_cluster(tasks[0].spec)
    registry.check()
    chunks = array_chunks(len(tasks), max_array_size())
    sweep = write_sweep(spec, tasks, spec_file)
    records: list[JobRecord] = []
    for offset, length in chunks:
        try:
            job_id = submit_plan(array_plan(tasks[0].spec, sweep.root, sweep.tasks_file, offset, length))
        except HpcgpuError:
            if not records:  # nothing of the sweep was submitted: leave nothing behind
                shutil.rmtree(sweep.root, ignore_errors=True)
            raise
        layout = [TaskRecord(f"{job_id}_{i}", str(sweep.run_dirs[offset + i]), tasks[offset + i].values)
                  for i in range(length)]
        records.append(registry.add(JobRecord(job_id, spec.name, spec_file, str(sweep.root), "slurm",
                                              tasks=layout)))
    return records


def submit_to_slurm(spec: Spec, tasks: list[SweepTask], spec_file: str, registry: Registry, refresh: Refresh,
                    fresh: bool = False, say: Callable[[str], None] = lambda line: None) -> list[JobRecord]:
    """tasks: the spec's sweep points (hpcgpu/launch/resolve.py), [] for a single job; refresh: the
    states of the jobs that ran in a run dir it would resume."""
    if tasks:
        return submit_sweep(spec, tasks, spec_file, registry)
    return [submit_single(spec, spec_file, registry, refresh, fresh, say)]


def dry_run_script(spec: Spec, tasks: list[SweepTask]) -> str:
    """The batch file that would be submitted (the first one, for a sweep split in several);
    tasks: the spec's sweep points, [] for a single job."""
    from hpcgpu.launch.submitit_slurm import submission_text  # submitit loads only for a dry run

    if tasks:
        check_one_script(tasks)
        root = run_dir_path(tasks[0].spec)
        try:
            first = array_chunks(len(tasks), max_array_size())[0][1]
        except SchedulerError:  # no SLURM here: SLURM's default MaxArraySize
            first = array_chunks(len(tasks), 1001)[0][1]
        plan = array_plan(tasks[0].spec, root, root / "tasks.txt", 0, first)
    else:
        run_dir = run_dir_path(spec)
        plan = single_plan(spec, run_dir)
    return submission_text(plan.folder, plan.options, plan.command)
