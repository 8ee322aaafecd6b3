"""Sweeps: a grid over dotted spec keys becomes one job array, one resolved spec and run dir per task.

Layout of a sweep (the array's "run dir"):
    runs/<name>/<sweep id>/
        sweep.yaml      the swept keys and each task's values
        tasks.txt       line i+1 = the spec of array task i (read by the batch script)
        <i>/spec.yaml   task i's fully resolved spec (`sweep: {}` and its values applied)
        <i>/slurm-<array job>_<task>.out|.err, metrics.jsonl, checkpoints/, ...
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpcgpu.contract import RunPaths
from hpcgpu.errors import SpecError, UsageError
from hpcgpu.launch.options import sbatch_options
from hpcgpu.launch.rundir import make_dirs, remove_dirs, run_dir_path, runs_dir_error, write_atomic
from hpcgpu.launch.sbatch import env_exports
from hpcgpu.launch.snapshot import plan_snapshot, write_code
from hpcgpu.spec import Spec, dump_spec, parse_override, spec_from_raw, spec_to_dict
from hpcgpu.spec.derive import signal_name
from hpcgpu.spec.load import set_dotted
from hpcgpu.spec.parse import LineMap


@dataclass(frozen=True)
class SweepTask:
    index: int
    values: dict[str, Any]
    spec: Spec

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values.items())


def parse_sweep_flag(item: str) -> tuple[str, list[Any]]:
    """`--sweep train.lr=1e-3,3e-3` -> ("train.lr", [0.001, 0.003]); `k=[[1,2],[3]]` takes a YAML list."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip() or not text.strip():
        raise UsageError(f"--sweep {item!r}: expected KEY=V1,V2,... e.g. --sweep train.lr=1e-3,3e-3")
    if text.strip().startswith("["):
        values = parse_override(f"{key}={text}")[1]
        if not isinstance(values, list):
            raise UsageError(f"--sweep {item!r}: not a YAML list")
        return key.strip(), values
    return key.strip(), [parse_override(f"{key}={v}")[1] for v in text.split(",")]


def with_sweep(spec: Spec, flags: tuple[str, ...]) -> Spec:
    """The spec with --sweep flags merged over its `sweep:` mapping (checked like a spec key)."""
    if not flags:
        return spec
    sweep = dict(spec.sweep)
    for item in flags:
        key, values = parse_sweep_flag(item)
        sweep[key] = values
    raw = spec_to_dict(spec)
    raw["sweep"] = sweep
    lines = LineMap()
    lines.flags.update({f"sweep.{k}": f"--sweep {k}=..." for k in sweep})
    return spec_from_raw(raw, lines)


def sweep_tasks(spec: Spec) -> list[SweepTask]:
    """The grid product of `spec.sweep`, in the order keys and values are written; [] without a sweep."""
    if not spec.sweep:
        return []
    keys = list(spec.sweep)
    base = spec_to_dict(spec)
    base["sweep"] = {}
    tasks = []
    for index, combo in enumerate(itertools.product(*(spec.sweep[k] for k in keys))):
        values = dict(zip(keys, combo))
        raw = copy.deepcopy(base)
        lines = LineMap()
        for key, value in values.items():
            set_dotted(raw, key, value, lines)
            lines.flags[key] = f"sweep {key}={value!r}"
        try:
            task_spec = spec_from_raw(raw, lines)
        except SpecError as exc:
            raise SpecError("", f"sweep task {index} ({' '.join(f'{k}={v!r}' for k, v in values.items())}): "
                            f"{exc}") from None
        # the values as the spec typed them ("1e-3" is a YAML string but train.lr is a float)
        plain = spec_to_dict(task_spec)
        tasks.append(SweepTask(index, {k: get_dotted(plain, k) for k in values}, task_spec))
    return tasks


def get_dotted(data: dict, key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def job_shape(spec: Spec) -> tuple:
    """What the one batch script of an array fixes for all its tasks."""
    return (sbatch_options(spec, Path("RUN_DIR")), env_exports(spec), spec.slurm.setup,
            spec.env.get("MASTER_PORT"), signal_name(spec))


def check_one_script(tasks: list[SweepTask]) -> None:
    """Array tasks share one batch script: swept keys may change the run, not the request or exports."""
    first = job_shape(tasks[0].spec)
    for task in tasks[1:]:
        if job_shape(task.spec) != first:
            keys = ", ".join(task.values)
            raise UsageError(f"sweep over {keys}: task {task.index} needs a different batch script "
                             "(resources, slurm options or env differ), but one job array shares one; "
                             "sweep over training/model keys, or submit such variants separately")


@dataclass(frozen=True)
class SweepDir:
    root: Path
    tasks_file: Path
    run_dirs: list[Path]


def write_sweep(spec: Spec, tasks: list[SweepTask], spec_file: str | None = None) -> SweepDir:
    """Create the sweep dir: each task's run dir with its resolved spec (and code snapshot), the index, a summary."""
    snapshot = plan_snapshot(spec, spec_file) if spec_file else None  # refused over code.max_mb before any folder
    root = run_dir_path(spec)
    created = make_dirs(root, spec.runs_dir)  # a runs_dir that cannot hold it: one runs_dir error
    run_dirs = []
    try:
        for task in tasks:
            run_dir = root / str(task.index)
            run_dir.mkdir(parents=True, exist_ok=True)
            write_code(task.spec, spec_file, snapshot, run_dir)
            write_atomic(RunPaths(run_dir).spec, dump_spec(task.spec))
            run_dirs.append(run_dir)
        tasks_file = root / "tasks.txt"
        write_atomic(tasks_file, "".join(f"{d / 'spec.yaml'}\n" for d in run_dirs))
        summary = {"name": spec.name, "sweep": spec.sweep,
                   "tasks": [{"index": t.index, "run_dir": str(d), "values": t.values}
                             for t, d in zip(tasks, run_dirs)]}
        write_atomic(root / "sweep.yaml", yaml.safe_dump(summary, sort_keys=False))
    except OSError as exc:
        remove_dirs(created)  # half a sweep is no sweep
        raise runs_dir_error(spec.runs_dir, exc, root) from None
    return SweepDir(root, tasks_file, run_dirs)


def array_chunks(count: int, max_array_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each job array: indices run 0..MaxArraySize-1, so big sweeps split."""
    size = max(1, max_array_size)
    return [(start, min(size, count - start)) for start in range(0, count, size)]


def array_range(length: int, parallelism: int | None) -> str:
    """`0-9%4`: SLURM's --array value (at most `parallelism` tasks at once)."""
    text = f"0-{length - 1}" if length > 1 else "0"
    return f"{text}%{parallelism}" if parallelism else text
