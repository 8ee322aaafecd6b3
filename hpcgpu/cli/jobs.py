"""Submitted jobs: `hpcgpu status [JOB]`, `list`, `logs JOB`, `cancel JOB` (one family, one module).

Host side only: the registry (sqlite3) and one scheduler call per refresh; nothing heavy loads here.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import click

from hpcgpu.cli.table import format_table
from hpcgpu.contract import RunPaths, checkpoint_step, is_finished
from hpcgpu.errors import HpcgpuError, UsageError
from hpcgpu.launch.executors import executor_for, refresh
from hpcgpu.launch.joblogs import RANK_LABEL, interleave
from hpcgpu.launch.progress import last_checkpoint, last_progress, resume_spec, resumed_since, run_warnings
from hpcgpu.launch.state import find_job, is_final
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.scheduler import FINAL_STATES, format_duration, parse_duration
from hpcgpu.launch.snapshot import commit_text
from hpcgpu.spec import load_spec

job_argument = click.argument("job_ref", metavar="JOB")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


# --- views ----------------------------------------------------------------------------------------

def elapsed_of(job: JobRecord, unit: JobRecord | TaskRecord) -> str:
    if unit.elapsed or executor_for(job).elapsed_from_scheduler:
        return unit.elapsed
    if isinstance(unit, TaskRecord):  # a local sweep's task: its own run, once started
        return format_duration(time.time() - unit.run_start) if unit.run_start else ""
    return format_duration((job.ended or time.time()) - job.submitted)  # a local job: one run


def gpu_hours(elapsed_s: int | None, gpus: int | None) -> float | None:
    return None if elapsed_s is None or gpus is None else round(elapsed_s * gpus / 3600, 3)


def unit_view(job: JobRecord, unit: JobRecord | TaskRecord) -> dict[str, Any]:
    progress = last_progress(unit.run_dir)
    elapsed = elapsed_of(job, unit)
    elapsed_s = parse_duration(elapsed) if elapsed else None
    return {
        "id": unit.job_id if isinstance(unit, JobRecord) else unit.id,
        "state": unit.state, "reason": unit.reason, "failure": unit.failure or None,
        "elapsed": elapsed, "elapsed_s": elapsed_s,  # every run of a requeued job together
        "gpus": unit.gpus, "gpu_hours": gpu_hours(elapsed_s, unit.gpus),
        "nodes": unit.nodes, "restarts": unit.restarts, "exit_code": unit.exit_code,
        "step": progress.step, "loss": progress.loss, "rows": progress.rows, "rows_total": progress.rows_total,
        "max_steps": progress.max_steps, "tokens_per_s": progress.tokens_per_s,
        # only while it runs: a queued or ended job has no rate to go by
        "eta_s": round(eta) if (eta := progress.eta_s()) is not None and unit.state == "RUNNING" else None,
        "progress": progress.text(), "run_dir": unit.run_dir,
        "warnings": run_warnings(unit.run_dir) if unit.run_dir else [],
        "commit": commit_text(unit.run_dir) if unit.run_dir else None,  # the code it runs (provenance.json)
    }


def job_view(job: JobRecord, registry: Registry | None = None) -> dict[str, Any]:
    view = unit_view(job, job)
    later = resumed_by(job, registry) if registry is not None else None
    if later is not None:  # the run dir's progress is the later job's now, not this one's
        view.update(step=None, loss=None, rows=None, rows_total=None, max_steps=None, tokens_per_s=None,
                    eta_s=None, progress=f"- (run dir resumed by job {later.job_id})", resumed_by=later.job_id)
    view.update({"name": job.name, "executor": job.executor, "spec": job.spec, "after": job.after,
                 "submitted": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.submitted))})
    if job.is_array:
        view["tasks"] = [dict(unit_view(job, t), values=t.values) for t in job.tasks]
        view["step"] = view["loss"] = view["rows"] = view["rows_total"] = view["eta_s"] = None
        view["progress"] = "-"
        hours = [t["gpu_hours"] for t in view["tasks"] if t["gpu_hours"] is not None]
        view["gpu_hours"] = round(sum(hours), 3) if hours else None  # the array's: all its tasks
    view["logs"] = [str(p) for p in executor_for(job).log_files(job, None)] if not job.is_array else []
    if not job.is_array:
        view.update(go_on_view(job, later))
    return view


# ended before its run did, by a stop, a cancel or the scheduler: the same submit goes on from its run dir
STOPPED_STATES = frozenset({"CANCELLED", "PREEMPTED", "TIMEOUT", "NODE_FAIL", "DEADLINE"})


def go_on_view(job: JobRecord, later: JobRecord | None) -> dict[str, Any]:
    """Where a job's run went on from (a resume of an earlier job's checkpoint) and, for one that
    stopped before its run finished (and no later job took the run on), its newest complete
    checkpoint and the command that resumes it."""
    resumed = resumed_since(job.run_dir, job.submitted, later.submitted if later else None)
    view: dict[str, Any] = {"resumed": resumed.text() if resumed else None, "checkpoint": None,
                            "checkpoint_step": None, "resume_command": None}
    if job.state in STOPPED_STATES and later is None and not is_finished(Path(job.run_dir)):
        checkpoint = last_checkpoint(job.run_dir)
        view["checkpoint"] = str(checkpoint) if checkpoint else None
        view["checkpoint_step"] = checkpoint_step(checkpoint) if checkpoint else None
        view["resume_command"] = f"hpcgpu submit {resume_spec(job.spec, job.run_dir)} --executor {job.executor}"
    return view


def resumed_by(job: JobRecord, registry: Registry) -> JobRecord | None:
    """The next job that went on in this job's run dir (submit again resumes an unfinished run)."""
    if job.is_array:
        return None
    later = [j for j in registry.with_run_dir(job.run_dir) if j.submitted > job.submitted and j.job_id != job.job_id]
    return min(later, key=lambda j: j.submitted) if later else None


def step_cell(view: dict[str, Any]) -> str:
    """The STEP column: the last step, or rows done/total for task: infer."""
    if view.get("rows") is not None:
        return f"{view['rows']}/{view['rows_total'] if view['rows_total'] is not None else '?'} rows"
    if view.get("resumed_by"):
        return f"-> {view['resumed_by']}"
    if view["step"] is None:
        return "-"
    return f"{view['step']}/{view['max_steps']}" if view.get("max_steps") else str(view["step"])


def eta_text(view: dict[str, Any]) -> str:
    return f"  ETA {format_duration(view['eta_s'])}" if view.get("eta_s") is not None else ""


def fmt_loss(loss: Any) -> str:
    return f"{loss:.4f}" if isinstance(loss, (int, float)) else "-"


def fmt_hours(hours: Any) -> str:
    return f"{hours:.2f}" if isinstance(hours, (int, float)) else "-"


def state_text(view: dict[str, Any]) -> str:
    """The state, with why where it helps: SLURM's reason for waiting, or (briefly, for tables)
    which rank failed where and how."""
    if view["reason"] and view["state"] in ("PENDING", "REQUEUED"):
        return f"{view['state']} ({view['reason']})"
    failure = view.get("failure")
    if failure and "rank" in failure:
        how = failure["signal"] or f"exit {failure['exit_code']}"
        return f"{view['state']} (rank {failure['rank']} on {failure['node'] or '?'}, {how})"
    return view["state"]


def print_jobs(views: list[dict[str, Any]]) -> None:
    rows = [["JOB", "NAME", "EXECUTOR", "STATE", "ELAPSED", "GPU-H", "NODES", "RESTARTS", "STEP", "LOSS",
             "RUN DIR"]]
    for v in views:
        state = state_text(v)
        if "tasks" in v:
            state = f"{state} [{len(v['tasks'])} tasks]"
        rows.append([v["id"], v["name"], v["executor"], state, v["elapsed"] or "-", fmt_hours(v["gpu_hours"]),
                     v["nodes"] or "-", str(v["restarts"]), step_cell(v), fmt_loss(v["loss"]), v["run_dir"]])
    click.echo(format_table(rows))


def gpu_time_text(view: dict[str, Any]) -> str:
    if view["gpu_hours"] is None:
        return "-"
    return f"{view['gpu_hours']:.2f} GPU-hours" + (f" ({view['gpus']} GPUs)" if view.get("gpus") else "")


def checkpoint_text(view: dict[str, Any]) -> str | None:
    """A stopped job's newest complete checkpoint, or that it has none to go on from."""
    if not view.get("resume_command"):
        return None
    if view.get("checkpoint"):
        return f"{view['checkpoint']} (step {view['checkpoint_step']}, the newest complete checkpoint)"
    return "no complete checkpoint: the resumed run starts from step 0" if view.get("step") is not None else None


def print_job(view: dict[str, Any]) -> None:
    waiting = view["state"] in ("PENDING", "REQUEUED")
    # the failed rank's exit code says more than the batch script's, which srun's teardown sets
    code = view["exit_code"] if view["exit_code"] not in (None, 0) and not view.get("failure") else None
    for label, value in (("job", f"{view['id']} ({view['executor']})"), ("name", view["name"]),
                         ("state", state_text(view) + (f", exit code {code}" if code is not None else "")),
                         ("reason", view["reason"] if view["reason"] and not waiting else None),
                         ("elapsed", (view["elapsed"] or "-") + (" (all runs)" if view["restarts"] else "")),
                         ("gpu time", gpu_time_text(view)), ("nodes", view["nodes"] or "-"),
                         ("restarts", view["restarts"]), ("submitted", view["submitted"]),
                         ("after", f"job {view['after']} (runs once it has completed)" if view.get("after") else None),
                         ("resumed", view.get("resumed")),
                         ("spec", view["spec"]), ("commit", view.get("commit")), ("run dir", view["run_dir"]),
                         ("saved", checkpoint_text(view)),
                         ("go on", f"{view['resume_command']} (resumes this run dir)" if view.get("resume_command")
                          else None)):
        if value is not None:
            click.echo(f"{label:<10}{value}")
    if "tasks" not in view:
        if view["rows"] is not None:
            total = view["rows_total"] if view["rows_total"] is not None else "?"
            click.echo(f"{'rows':<10}{view['rows']}/{total}{eta_text(view)}")
        else:
            speed = f"  {view['tokens_per_s']:,.0f} tok/s" if view.get("tokens_per_s") else ""
            click.echo(f"{'step':<10}{step_cell(view)}  loss {fmt_loss(view['loss'])}{speed}{eta_text(view)}")
        for text in view["warnings"]:
            click.echo(f"{'warning':<10}{text}")
        for path in view["logs"]:
            click.echo(f"{'log':<10}{path}")
        return
    rows = [["TASK", "STATE", "ELAPSED", "GPU-H", "NODES", "RESTARTS", "STEP", "LOSS", "VALUES", "RUN DIR"]]
    for t in view["tasks"]:
        rows.append([t["id"], state_text(t), t["elapsed"] or "-", fmt_hours(t["gpu_hours"]), t["nodes"] or "-",
                     str(t["restarts"]),
                     step_cell(t), fmt_loss(t["loss"]),
                     " ".join(f"{k}={v}" for k, v in t["values"].items()), t["run_dir"]])
    click.echo("")
    click.echo(format_table(rows))


# --- commands -------------------------------------------------------------------------------------

@click.command()
@click.argument("job_ref", metavar="[JOB]", required=False)
@json_option
def status(job_ref: str | None, as_json: bool) -> None:
    """State, elapsed time, nodes, restarts and last step/loss of JOB (or of every active job)."""
    registry = Registry()
    if job_ref:
        job, task = find_job(registry, job_ref)
        refresh(registry, [job])
        view = job_view(job, registry)
        if task is not None:
            view = dict(view, **next(t for t in view["tasks"] if t["id"] == task.id))
            view.pop("tasks")
            view["logs"] = [str(p) for p in executor_for(job).log_files(job, task)]
        if as_json:
            click.echo(json.dumps(view, indent=2))
        else:
            print_job(view)
        return
    jobs = registry.not_in_states(FINAL_STATES)
    show_jobs(registry, jobs, as_json, "no active jobs (`hpcgpu list` shows the finished ones too)")


@click.command(name="list")
@click.option("-n", "limit", type=click.IntRange(min=1), default=20, show_default=True, help="How many jobs.")
@click.option("--all", "show_all", is_flag=True, help="Every job in the registry.")
@json_option
def list_jobs(limit: int, show_all: bool, as_json: bool) -> None:
    """The most recent jobs, newest first (states refreshed in one scheduler call)."""
    registry = Registry()
    jobs = registry.all() if show_all else registry.recent(limit)
    show_jobs(registry, jobs, as_json, f"no jobs in {registry.path}")


def show_jobs(registry: Registry, jobs: list, as_json: bool, empty: str) -> None:
    """Refresh the jobs' states in one scheduler call, then print them as a table or JSON."""
    refresh(registry, jobs)
    views = [job_view(j, registry) for j in jobs]
    if as_json:
        click.echo(json.dumps(views, indent=2))
    elif views:
        print_jobs(views)
    else:
        click.echo(empty)


@click.command()
@job_argument
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output until the job ends (Ctrl-C stops).")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="Only this rank: a local job's logs/rank-N.log (default 0), or a SLURM job's lines "
                   "that srun labels 'N: '.")
def logs(job_ref: str, follow: bool, rank: int | None) -> None:
    """Print JOB's output: slurm-<id>.out and .err in its run dir, merged line by line in the order they
    were written, or a local job's logs/rank-N.log."""
    registry = Registry()
    job, task = find_job(registry, job_ref)
    one_unit(job, task, "logs")
    if rank is not None:
        check_rank(job_ref, Path((task or job).run_dir), rank)
    executor = executor_for(job)
    files = executor.log_files(job, task, rank)
    if not any(p.exists() for p in files) and not follow:
        state = (task or job).state
        raise UsageError(f"no log yet for {job_ref} ({state}): expected {files[0]}")
    offsets = {p: 0 for p in files}
    emit = (lambda text: only_rank(text, rank)) if rank is not None and executor.labels_ranks else (lambda text: text)
    try:
        print_new(offsets, emit, whole_lines=follow)
        while follow:
            refresh(registry, [job])
            unit = job.task(task.id) if task else job
            if unit is not None and is_final(unit.state):
                time.sleep(0.5)  # the last lines may land just after SLURM records the end
                print_new(offsets, emit)
                return
            for _ in range(4):
                time.sleep(0.5)
                print_new(offsets, emit, whole_lines=True)
    except KeyboardInterrupt:
        return


def one_unit(job: JobRecord, task: TaskRecord | None, command: str) -> JobRecord | TaskRecord:
    """The job, or the array task named: a command about one run refuses a whole array in one line."""
    if job.is_array and task is None:
        raise UsageError(f"job {job.job_id} is an array of {len(job.tasks)} tasks: name one, "
                         f"e.g. hpcgpu {command} {job.tasks[0].id}")
    return task or job


def check_rank(job_ref: str, run_dir: Path, rank: int) -> None:
    """--rank names a rank the job has (its resolved spec says how many), else one line: a rank it
    does not have would print nothing at all (SLURM) or wait for a log that never comes."""
    try:
        ranks = load_spec(str(RunPaths(run_dir).spec)).world_size
    except (HpcgpuError, OSError):
        return  # no spec to tell: the logs say what they have
    if rank >= ranks:
        raise UsageError(f"--rank {rank}: job {job_ref} has {ranks} rank(s), 0-{ranks - 1}")


def only_rank(text: str, rank: int) -> str:
    """The lines srun --label gave to one rank, without the label (` 3: ` when ranks reach 10)."""
    out = []
    for line in text.splitlines(keepends=True):
        m = RANK_LABEL.match(line)
        if m and int(m.group(1)) == rank:
            out.append(line[m.start(2):])
    return "".join(out)


def print_new(offsets: dict[Path, int], emit: Callable[[str], str] = lambda text: text,
              whole_lines: bool = False) -> None:
    """Print what the logs gained since the last call, .out and .err merged line by line in the order
    they were written (joblogs.interleave). While following, only whole lines are taken, so a filter
    never sees half a line."""
    chunks = []
    for path, offset in offsets.items():
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
                written = os.fstat(fh.fileno()).st_mtime
        except OSError:
            continue
        if whole_lines:
            data = data[: data.rfind(b"\n") + 1]
        if data:
            offsets[path] = offset + len(data)
            chunks.append((data.decode(errors="replace"), written))
    if chunks:
        sys.stdout.write(emit(interleave(chunks)))
        sys.stdout.flush()


@click.command()
@job_argument
@click.option("--now", is_flag=True,
              help="Stop at once, without the checkpoint (SLURM: the ranks are killed; local: the executor kills them).")
def cancel(job_ref: str, now: bool) -> None:
    """Cancel JOB: a SLURM job, one array task (123_4), a whole array (123) or a local job.

    A running job checkpoints first: train and infer stop at their next checkpoint (resubmitting the
    same spec resumes from it; `hpcgpu status JOB` names it and the command); a command's program gets
    the stop signal. --now skips the checkpoint."""
    registry = Registry()
    job, task = find_job(registry, job_ref)
    click.echo(executor_for(job).cancel(registry, job, task, job_ref, now))
