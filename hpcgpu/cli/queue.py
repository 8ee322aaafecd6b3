"""`hpcgpu queue FILE [--devices 0,1,4,7]`: many jobs over the free GPUs of this machine.

FILE has one job per line, written as the arguments of `hpcgpu submit`:

    configs/tiny.yaml --gpus 2
    configs/tiny.yaml --set train.lr=1e-3 --set name=tiny-lr3   # a comment
    exp.yaml --new                                                # always a fresh run dir
    exp.yaml --sweep train.lr=1e-3,3e-3                           # one job per point

Spec paths are relative to FILE. Every line is checked before any job starts. A line whose
identical spec already finished is skipped, and one that was stopped resumes, so running the same
queue again after Ctrl-C goes on where it stopped. The GPUs are read every --poll seconds while a
job waits: a busy one is used once free in --free-checks readings in a row. --retries N runs a
failed job again (resuming its run dir) up to N times.
"""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import click

from hpcgpu.cli import usage_error_line
from hpcgpu.cli.options import Renamed, busy_options, ignore_busy_option, spec_options
from hpcgpu.cli.table import format_table
from hpcgpu.errors import HpcgpuError, UsageError
from hpcgpu.gpu.busy import BusyThresholds, busy_reasons, select, strictest, usage_text
from hpcgpu.gpu.source import default_source
from hpcgpu.launch.queue import (GpuPool, GpuWatch, Queue, QueueEntry, exit_code, local_starter,
                                 queue_file_lines, summary_rows)
from hpcgpu.launch.registry import Registry
from hpcgpu.launch.resolve import QUEUE, read_resolved
from hpcgpu.launch.rundir import find_finished_run
from hpcgpu.spec import Spec

LINE_FORM = "a line is: SPEC [--gpus N] [--set K=V]... [--sweep K=V1,V2] [--new]"


@click.command("line", add_help_option=False)
@spec_options
@click.option("--sweep", "sweeps", multiple=True)
@click.option("--new", "fresh", is_flag=True)
def _line(spec_file: str, overrides: tuple[str, ...], gpus: int | None, nodes: int | None,
          sweeps: tuple[str, ...], fresh: bool) -> dict:
    """The flags a queue line may carry: those of `hpcgpu submit` that make sense here."""
    return {"spec_file": spec_file, "overrides": overrides, "gpus": gpus, "nodes": nodes, "sweeps": sweeps,
            "fresh": fresh}


def parse_line(queue_file: Path, line: int, text: str) -> list[QueueEntry]:
    """One line's jobs: one, or one per point of a sweep (its `sweep:` or --sweep flags). The spec
    is read and resolved here, once, as `hpcgpu submit --executor local` would (hpcgpu/launch/resolve.py);
    the jobs run the resolved specs."""
    where = f"{queue_file}:{line}"
    try:
        params = _line.main(args=shlex.split(text), prog_name=where, standalone_mode=False)
        spec_path = Path(params["spec_file"])
        if not spec_path.is_absolute():
            spec_path = queue_file.parent / spec_path
        resolved = read_resolved(str(spec_path), params["overrides"], params["gpus"], params["nodes"],
                                 params["sweeps"], QUEUE, say=say)
        if not resolved.tasks:
            return [point_entry(where, line, spec_path, params, resolved.spec)]
        # each point shown as the --set overrides that would give its spec
        return [point_entry(where, line, spec_path, params, task.spec, task.label(),
                            tuple(f"{k}={json.dumps(v)}" for k, v in task.values.items()) + ("sweep={}",))
                for task in resolved.tasks]
    except click.UsageError as exc:
        raise UsageError(f"{where}: {usage_error_line(exc, LINE_FORM)}") from None
    except ValueError as exc:  # shlex: an unclosed quote
        raise UsageError(f"{where}: {exc} ({LINE_FORM})") from None
    except UsageError:
        raise
    except HpcgpuError as exc:
        raise UsageError(f"{where}: {exc}") from None


def say(message: str) -> None:
    click.echo(f"hpcgpu: {message}", err=True)


def point_entry(where: str, line: int, spec_path: Path, params: dict, spec: Spec, label: str = "",
                extra: tuple[str, ...] = ()) -> QueueEntry:
    """The job of one line (or of one sweep point), checked."""
    if spec.resources.nodes > 1:
        raise UsageError(f"{where}: the queue runs jobs on this machine: drop --nodes / resources.nodes > 1")
    spec_ref = str(spec_path.resolve())
    argv = [spec_ref] + [a for kv in tuple(params["overrides"]) + extra for a in ("--set", kv)]
    argv += [f"--gpus={params['gpus']}"] if params["gpus"] else []
    argv += ["--new"] if params["fresh"] else []
    finished = None if params["fresh"] else find_finished_run(spec)
    name = f"{spec.name}[{label}]" if label else spec.name
    return QueueEntry(line, tuple(argv), name, spec.resources.gpus, str(finished or ""), spec=spec, spec_ref=spec_ref,
                      fresh=params["fresh"])


def read_entries(queue_file: Path) -> list[QueueEntry]:
    try:
        lines = queue_file_lines(queue_file)
    except FileNotFoundError:
        raise UsageError(f"queue file {queue_file}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"queue file {queue_file}: a folder, not a file") from None
    except UnicodeDecodeError:
        raise UsageError(f"queue file {queue_file}: not text (UTF-8)") from None
    if not lines:
        raise UsageError(f"queue file {queue_file} names no job (one `SPEC [--gpus N] [--set K=V]` per line)")
    return [entry for no, text in lines for entry in parse_line(queue_file, no, text)]


def pool_thresholds(entries: list[QueueEntry], memory_pct: float | None, util_pct: float | None
                    ) -> BusyThresholds:
    """When a GPU is too busy for the pool: the flags, else the lines' resources.busy (where lines
    differ, the strictest: a GPU that any job would call busy is left out)."""
    th = strictest([BusyThresholds.from_spec(e.spec.resources.busy) for e in entries if e.spec is not None])
    return BusyThresholds(th.memory_pct if memory_pct is None else memory_pct,
                          th.util_pct if util_pct is None else util_pct, th.processes)


def gpu_ids_as_given(devices: str) -> list[str]:
    """--devices without NVML to check it against: indexes or GPU UUIDs, each once (they become the jobs'
    CUDA_VISIBLE_DEVICES)."""
    ids = [g.strip() for g in devices.split(",") if g.strip()]
    bad = [g for g in ids if not (g.isdigit() or g.startswith(("GPU-", "MIG-")))]
    if not ids:
        raise UsageError(f"--devices {devices!r}: no GPU named")
    if bad:
        raise UsageError(f"--devices {devices}: GPU indexes (0,1) or UUIDs (GPU-...), comma-separated; "
                         f"not {', '.join(bad)}")
    if len(set(ids)) < len(ids):
        raise UsageError(f"--devices {devices}: a GPU named twice")
    return ids


def gpu_pool(devices: str | None, ignore_busy: bool, th: BusyThresholds = BusyThresholds(), free_checks: int = 3
             ) -> tuple[GpuPool, list[str]]:
    """The GPUs the queue may use and notes about the busy ones (waiting until free, or used with
    --ignore-busy: with their processes and memory). Busy ones stay in the pool, watched: each is
    used once free in `free_checks` readings in a row. ids None: no GPU, CPU mode."""
    if not devices and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return GpuPool(None), []  # GPUs hidden on purpose: the CPU it is
    source = default_source()
    if not source.available():
        if devices:  # nothing here to check them against but their form
            ids = gpu_ids_as_given(devices)
            return GpuPool(ids), [f"warning: NVML is not available here: GPUs {','.join(ids)} are taken as given "
                                  "(not checked to exist, not watched for other jobs)"]
        return GpuPool(None), []
    readings = source.read(processes=True)  # the first reading: the watch goes on from it
    chosen, why = select(readings, devices, None if devices else os.environ.get("CUDA_VISIBLE_DEVICES"))
    if devices and len(chosen) < len([g for g in devices.split(",") if g.strip()]):
        raise UsageError(f"--devices {devices}: {why}")
    notes = []
    for r in chosen:
        reasons = busy_reasons(r, th)
        if reasons and not ignore_busy:
            notes.append(f"GPU {r.index} left out, busy: {', '.join(reasons)}; {usage_text(r)}; used once free in "
                         f"{free_checks} readings in a row (--ignore-busy uses it now)")
        elif reasons:
            notes.append(f"warning: GPU {r.index} is busy: {', '.join(reasons)}; {usage_text(r)}; "
                         "used anyway (--ignore-busy)")
    watch = None if ignore_busy else GpuWatch(source, th, free_checks, chosen)
    return GpuPool([str(r.index) for r in chosen], watch, {str(r.index): r for r in chosen}), notes


def pool_text(pool: GpuPool) -> str:
    """What the queue runs over: 'GPUs 2,3 (and 0,1 once free)'."""
    if pool.ids is None:
        return "the CPU, one job at a time (no GPU here)"
    ready = pool.ready()
    later = [d for d in pool.ids if d not in ready]
    return f"GPUs {','.join(ready)}" + (f" (and {','.join(later)} once free)" if later else "")


@click.command()
@click.argument("queue_file", metavar="FILE", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--devices", "--gpus", "devices", cls=Renamed, default=None, metavar="0,1,4,7",
              help="The GPUs the queue may use (default: every GPU here; a busy one once it is free).")
@ignore_busy_option
@busy_options("the lines' resources.busy")
@click.option("--free-checks", type=click.IntRange(min=1), default=3, show_default=True, metavar="N",
              help="A busy GPU is used once free in N readings in a row (one reading every --poll seconds).")
@click.option("--poll", "poll_s", type=click.FloatRange(min=0.05), default=2.0, show_default=True, metavar="SECONDS",
              help="How often the queue reads the GPUs and looks at its jobs.")
@click.option("--retries", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Run a failed job again, resuming its run dir, up to N times.")
@click.option("--dry-run", is_flag=True, help="Check every line and show the pool; start nothing.")
def queue(queue_file: Path, devices: str | None, ignore_busy: bool, busy_memory_pct: float | None,
          busy_util_pct: float | None, free_checks: int, poll_s: float, retries: int, dry_run: bool) -> int:
    """Run the jobs of FILE (one `SPEC [--gpus N] [--set K=V]` per line) over free local GPUs."""
    entries = read_entries(queue_file)
    th = pool_thresholds(entries, busy_memory_pct, busy_util_pct)
    pool, notes = gpu_pool(devices, ignore_busy, th, free_checks)
    if pool.ids is not None:
        if not pool.ready():  # waiting for all of them to free up is more likely a wrong --devices
            for note in notes:  # why each is busy
                click.echo(f"queue: {note}", err=True)
            raise UsageError("no free GPU to run the queue on" + (f" among --devices {devices}" if devices else "")
                             + " (--ignore-busy uses busy ones)")
        too_big = [e for e in entries if e.gpus > len(pool.ids)]
        if too_big:
            e = too_big[0]
            raise UsageError(f"{queue_file}:{e.line}: {e.name} needs {e.gpus} GPUs, the queue has {len(pool.ids)} "
                             f"({','.join(pool.ids)}); lower --gpus on the line")
    for note in notes:
        click.echo(f"queue: {note}", err=True)
    todo = sum(1 for e in entries if not e.finished_in)
    click.echo(f"queue: {todo} of {len(entries)} job(s) to run over {pool_text(pool)}", err=True)
    if dry_run:
        click.echo(format_table([("LINE", "NAME", "GPUS", "ARGS")] + [
            (str(e.line), e.name, str(e.gpus), "skipped: finished in " + e.finished_in if e.finished_in
             else shlex.join(e.argv)) for e in entries]))
        return 0
    results = Queue(entries, pool, local_starter(Registry()), lambda m: click.echo(m, err=True), poll_s=poll_s,
                    retries=retries).run()
    click.echo(format_table(summary_rows(results)))
    return exit_code(results)
