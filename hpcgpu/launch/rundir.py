"""Run directories: runs/<name>/<id>/ with the fully resolved spec.yaml inside."""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Callable, Iterator

from hpcgpu.launch.exitcodes import is_finished
from hpcgpu.spec import Spec, dump_spec


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def run_dir_path(spec: Spec, root: str | os.PathLike | None = None, run_id: str | None = None) -> Path:
    """Where a new run of this spec goes: <runs_dir>/<name>/<id>/ (nothing is created)."""
    base = Path(root if root is not None else spec.runs_dir).expanduser()
    return (base / spec.name / (run_id or new_run_id())).resolve()


def make_run_dir(spec: Spec, root: str | os.PathLike | None = None, run_id: str | None = None) -> Path:
    """Create the run dir and write spec.yaml atomically (never a half-written spec)."""
    run_dir = run_dir_path(spec, root, run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "spec.yaml", dump_spec(spec))
    return run_dir


def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    if mode is not None:
        tmp.chmod(mode)
    os.replace(tmp, path)


def submitted_to_slurm(run_dir: Path) -> bool:
    """A run dir SLURM owns (`hpcgpu submit`/`sbatch`): SLURM's requeue resumes it, not a local run."""
    return any(run_dir.glob("*_submission.sh")) or (run_dir / "job.sbatch").exists() \
        or any(run_dir.glob("slurm-*.out"))


def runs_of_this_spec(spec: Spec) -> Iterator[Path]:
    """Run dirs of this spec's name whose resolved spec.yaml is identical to it, newest first."""
    base = Path(spec.runs_dir).expanduser() / spec.name
    if not base.is_dir():
        return
    text = dump_spec(spec)
    for run_dir in sorted((p for p in base.iterdir() if p.is_dir()), reverse=True):
        spec_file = run_dir / "spec.yaml"
        if spec_file.exists() and spec_file.read_text() == text:
            yield run_dir.resolve()


def find_unfinished_run(spec: Spec, in_use: Callable[[Path], bool] = lambda p: False) -> Path | None:
    """The newest run dir of this spec (identical resolved spec) that has not finished: running the
    same spec again resumes it (local executor). Run dirs of SLURM jobs and those `in_use` says a
    live job writes to are never taken."""
    return next((run_dir for run_dir in runs_of_this_spec(spec) if not is_finished(run_dir)
                 and not submitted_to_slurm(run_dir) and not in_use(run_dir)), None)


def find_finished_run(spec: Spec) -> Path | None:
    """The newest run dir of this spec (identical resolved spec) that finished."""
    return next((run_dir for run_dir in runs_of_this_spec(spec) if is_finished(run_dir)), None)


def missing_inputs(spec: Spec) -> list[str]:
    """Input files the spec names that do not exist here, as 'key: path' (hub ids are not paths)."""
    out = []
    for key, value in (("data.train", spec.data.train), ("data.eval", spec.data.eval),
                       ("distributed.deepspeed.config", spec.distributed.deepspeed.config)):
        if value and not Path(value).exists():
            out.append(f"{key}: {value}")
    return out
