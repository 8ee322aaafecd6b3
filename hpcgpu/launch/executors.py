"""Executors: where a job runs, behind one interface (as submitit's `Executor`): SLURM and the local one.

An executor submits a resolved spec, refreshes its jobs' states, cancels one, names its log files and
reads why a run failed. It is chosen once, here: from the `--executor` flag (`executor_named`) or from
a registry row (`executor_for`); nothing else on the host asks an executor's name. The work itself
stays in the module that owns it (submission.py and local_submit.py submit, state.py refreshes,
cancel.py cancels, failures.py and joblogs.py read the logs); the classes say which piece is whose.
A new executor is one class here and one line in EXECUTORS.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

from hpcgpu.errors import HpcgpuError, SchedulerError
from hpcgpu.launch import local_submit, submission
from hpcgpu.launch.cancel import scancel, stop_local
from hpcgpu.launch.failures import local_failure, slurm_failure
from hpcgpu.launch.joblogs import rank_log, slurm_log_files
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.resolve import Resolved, Use, submit_use
from hpcgpu.launch.state import refresh_local_jobs, refresh_slurm_jobs
from hpcgpu.launch.sweep import SweepTask
from hpcgpu.spec import dump_spec

Say = Callable[[str], None]


def _quiet(message: str) -> None:
    pass


def _nothing(record: JobRecord) -> None:
    pass


@dataclass(frozen=True)
class Submit:
    """How `hpcgpu submit` asks for a job: a fresh run dir or the unfinished one resumed, GPUs in use
    taken anyway (local), where messages go, and what to do once a local job is registered."""

    fresh: bool = False
    ignore_busy: bool = False
    say: Say = _quiet
    started: Callable[[JobRecord], None] = _nothing
    waiting: JobRecord | None = None  # local: the record registered while it waited for --after's job


class Executor(ABC):
    name: ClassVar[str]
    # the job runs in this process: submit returns once it has ended (else it waits in a queue)
    runs_here: ClassVar[bool]
    # `status` takes a job's elapsed time from the scheduler (else from the executor's own clock)
    elapsed_from_scheduler: ClassVar[bool]
    # one log holds every rank, labelled `N: ` (srun --label): `logs --rank N` filters it
    labels_ranks: ClassVar[bool]

    def use(self, dry_run: bool) -> Use:
        """What the resolve step's host checks demand for `hpcgpu submit` with this executor."""
        return submit_use(self.runs_here, dry_run)

    @abstractmethod
    def dry_run(self, resolved: Resolved, say: Say) -> str:
        """What `submit --dry-run` prints: the resolved spec and what would run."""

    @abstractmethod
    def submit(self, resolved: Resolved, spec_ref: str, registry: Registry, how: Submit) -> list[JobRecord]:
        """Submit (or run) the resolved spec; its registered jobs."""

    @abstractmethod
    def refresh(self, registry: Registry, jobs: list[JobRecord]) -> None:
        """Bring this executor's jobs' states up to date and save them."""

    @abstractmethod
    def cancel(self, registry: Registry, job: JobRecord, task: TaskRecord | None, ref: str, now: bool = False) -> str:
        """Cancel a job (or an array task), at its next checkpoint unless `now`; one line saying what happened."""

    @abstractmethod
    def log_files(self, job: JobRecord, task: TaskRecord | None, rank: int | None = None) -> list[Path]:
        """The files a job (or task) logs to; a rank's own where the executor keeps one per rank."""

    @abstractmethod
    def failure_of(self, job: JobRecord, unit: JobRecord | TaskRecord) -> tuple[dict[str, Any], str]:
        """Which rank failed first, where, how, its last error line -> (fields, one-line reason)."""


def sweep_lines(tasks: list[SweepTask]) -> str:
    return "".join(f"# sweep task {task.index}: {task.label()}\n" for task in tasks)


class SlurmExecutor(Executor):
    """SLURM through submitit: the job waits in the cluster's queue; srun labels each rank's lines."""

    name = "slurm"
    runs_here = False
    elapsed_from_scheduler = True
    labels_ranks = True

    def dry_run(self, resolved: Resolved, say: Say) -> str:
        spec, tasks = resolved.spec, resolved.tasks
        try:
            submission.check_cluster(tasks[0].spec if tasks else spec)
        except SchedulerError as exc:  # no SLURM here: the script can still be shown
            say(f"warning: the request was not checked against the cluster: {exc}")
        return ("# --- resolved spec ---\n" + dump_spec(spec) + sweep_lines(tasks)
                + "# --- batch script (submitted by submitit; nothing was submitted) ---\n"
                + submission.dry_run_script(spec, tasks))

    def submit(self, resolved: Resolved, spec_ref: str, registry: Registry, how: Submit) -> list[JobRecord]:
        return submission.submit_to_slurm(resolved.spec, resolved.tasks, spec_ref, registry, refresh, how.fresh,
                                          how.say)

    def refresh(self, registry: Registry, jobs: list[JobRecord]) -> None:
        refresh_slurm_jobs(registry, jobs, self.failure_of)

    def cancel(self, registry: Registry, job: JobRecord, task: TaskRecord | None, ref: str, now: bool = False) -> str:
        self.refresh(registry, [job])  # what there is to stop: a job still waiting has no checkpoint to take
        return scancel(job, job.task(task.id) if task else None, ref, now)

    def log_files(self, job: JobRecord, task: TaskRecord | None, rank: int | None = None) -> list[Path]:
        return slurm_log_files(job, task)

    def failure_of(self, job: JobRecord, unit: JobRecord | TaskRecord) -> tuple[dict[str, Any], str]:
        return slurm_failure(job, unit)


class LocalExecutor(Executor):
    """The local executor: the ranks run here, with SLURM's environment, one log file per rank."""

    name = "local"
    runs_here = True
    elapsed_from_scheduler = False
    labels_ranks = False

    def dry_run(self, resolved: Resolved, say: Say) -> str:
        spec, tasks = resolved.spec, resolved.tasks
        return (dump_spec(spec) + sweep_lines(tasks)
                + f"# would run {spec.world_size} local rank(s): python -m hpcgpu run <run dir>/spec.yaml"
                + (f", for each of {len(tasks)} sweep tasks in turn" if tasks else "") + "\n")

    def submit(self, resolved: Resolved, spec_ref: str, registry: Registry, how: Submit) -> list[JobRecord]:
        registry.check()  # a damaged or unwritable registry stops here, before any run dir or rank exists
        if resolved.tasks:
            return [local_submit.submit_local_sweep(resolved.spec, resolved.tasks, spec_ref, registry,
                                                    ignore_busy=how.ignore_busy, say=how.say, started=how.started,
                                          waiting=how.waiting)]
        return [local_submit.submit_local(resolved.spec, spec_ref, registry, fresh=how.fresh,
                                          ignore_busy=how.ignore_busy, say=how.say, started=how.started,
                                          waiting=how.waiting)]

    def refresh(self, registry: Registry, jobs: list[JobRecord]) -> None:
        refresh_local_jobs(registry, jobs, self.failure_of)

    def cancel(self, registry: Registry, job: JobRecord, task: TaskRecord | None, ref: str, now: bool = False) -> str:
        return stop_local(registry, job, ref, self.failure_of, now)

    def log_files(self, job: JobRecord, task: TaskRecord | None, rank: int | None = None) -> list[Path]:
        return [rank_log(task or job, rank)]

    def failure_of(self, job: JobRecord, unit: JobRecord | TaskRecord) -> tuple[dict[str, Any], str]:
        return local_failure(job, unit)


EXECUTORS: dict[str, Executor] = {e.name: e for e in (SlurmExecutor(), LocalExecutor())}  # the flag's order


def executor_named(name: str) -> Executor:
    """The executor `--executor NAME` or a registry row names: the one place a name is looked at."""
    try:
        return EXECUTORS[name]
    except KeyError:
        raise HpcgpuError(f"unknown executor {name!r}: expected one of {', '.join(EXECUTORS)}") from None


def executor_for(job: JobRecord) -> Executor:
    """The executor that runs (or ran) a registered job."""
    return executor_named(job.executor)


def refresh(registry: Registry, jobs: list[JobRecord]) -> list[JobRecord]:
    """Bring the jobs' states up to date, each executor its own (SLURM's in one scheduler call), and
    save them; returns the jobs."""
    mine: dict[str, list[JobRecord]] = {}
    for job in jobs:
        mine.setdefault(job.executor, []).append(job)
    for name, group in mine.items():
        executor_named(name).refresh(registry, group)
    return jobs
