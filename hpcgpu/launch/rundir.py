"""Run directories: runs/<name>/<id>/ with the fully resolved spec.yaml inside."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

import yaml

from hpcgpu.errors import SpecError
from hpcgpu.contract import RunPaths, checkpoint_step, complete_checkpoints, is_finished
from hpcgpu.launch.snapshot import plan_snapshot, write_code
from hpcgpu.spec import Spec, dump_spec


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def run_dir_path(spec: Spec, root: str | os.PathLike | None = None, run_id: str | None = None) -> Path:
    """Where a new run of this spec goes: <runs_dir>/<name>/<id>/ (nothing is created)."""
    base = Path(root if root is not None else spec.runs_dir).expanduser()
    return (base / spec.name / (run_id or new_run_id())).resolve()


def make_run_dir(spec: Spec, root: str | os.PathLike | None = None, run_id: str | None = None,
                 spec_file: str | os.PathLike | None = None) -> Path:
    """Create the run dir and write spec.yaml atomically (never a half-written spec); with the spec's
    file, the code snapshot and provenance.json too (launch/snapshot.py), a snapshot over code.max_mb
    refused before any folder is made.

    A runs_dir that cannot hold it (read-only, a file in the way, under /proc) is one SpecError naming
    runs_dir and the path, and every folder made on the way is removed again."""
    spec_file = spec_file or None  # a queue line may carry none
    snapshot = plan_snapshot(spec, spec_file) if spec_file is not None else None
    run_dir = run_dir_path(spec, root, run_id)
    runs_dir = str(root) if root is not None else spec.runs_dir
    created = make_dirs(run_dir, runs_dir)
    try:
        write_code(spec, spec_file, snapshot, run_dir)
        write_atomic(RunPaths(run_dir).spec, dump_spec(spec))
    except OSError as exc:
        remove_dirs(created)
        raise runs_dir_error(runs_dir, exc, RunPaths(run_dir).spec) from None
    except BaseException:
        remove_dirs(created)
        raise
    return run_dir


def runs_dir_error(runs_dir: str, exc: OSError, path: Path | None = None) -> SpecError:
    where = exc.filename or path
    reason = exc.strerror or str(exc)
    if isinstance(exc, FileExistsError):
        reason = "a file is in the way"
    return SpecError("runs_dir", f"{runs_dir}: cannot make {where}: {reason}; set runs_dir to a folder you can write")


def make_dirs(path: Path, runs_dir: str) -> list[Path]:
    """`mkdir -p path`; returns the folders this call made, outermost first (remove_dirs undoes them).
    A failure is one runs_dir SpecError, with nothing made left behind."""
    created: list[Path] = []
    for folder in reversed([path, *path.parents]):
        try:
            folder.mkdir()
            created.append(folder)
        except FileExistsError as exc:
            if not folder.is_dir():
                remove_dirs(created)
                raise runs_dir_error(runs_dir, exc, folder) from None
        except OSError as exc:
            remove_dirs(created)
            raise runs_dir_error(runs_dir, exc, folder) from None
    return created


def remove_dirs(created: list[Path]) -> None:
    """Undo make_dirs: the innermost folder with what was written into it, then its parents if empty
    (another submission may have put its own run dir next to ours meanwhile)."""
    if not created:
        return
    shutil.rmtree(created[-1], ignore_errors=True)
    for folder in reversed(created[:-1]):
        try:
            folder.rmdir()
        except OSError:
            return


def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """`mode` is cut by the umask, as open() would cut it: `umask 077` keeps a 0o755 script private."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        if mode is not None:
            tmp.chmod(mode & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def take_spec(run_dir: Path, spec: Spec) -> None:
    """A resumed run dir's spec.yaml becomes this submission's (an infer run going on with another
    replica count resolves to another text of the same spec), once its width can go on there."""
    check_width(run_dir, spec)
    if RunPaths(run_dir).spec.read_text() != (text := dump_spec(spec)):
        write_atomic(RunPaths(run_dir).spec, text)


def current_umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: put it straight back
    os.umask(mask)
    return mask


def submitted_to_slurm(run_dir: Path) -> bool:
    """A run dir SLURM owns (`hpcgpu submit`/`sbatch`): SLURM's requeue resumes it, not a local run."""
    return any(run_dir.glob("*_submission.sh")) or (run_dir / "job.sbatch").exists() \
        or any(run_dir.glob("slurm-*.out"))


def runs_of_this_spec(spec: Spec) -> Iterator[Path]:
    """Run dirs of this spec's name whose resolved spec.yaml is identical to it, newest first."""
    base = Path(spec.runs_dir).expanduser() / spec.name
    try:
        found = sorted((p for p in base.iterdir() if p.is_dir()), reverse=True)
    except OSError:  # none yet, or a folder we cannot read: nothing of ours to resume
        return
    text = dump_spec(spec)
    for run_dir in found:
        try:
            same = same_run_spec(text, RunPaths(run_dir).spec.read_text(), spec.task)
        except (OSError, UnicodeDecodeError):
            continue
        if same:
            yield run_dir.resolve()


def same_run_spec(text: str, recorded: str, task: str) -> bool:
    """Whether a run dir's spec.yaml is this spec's: identical, except that an infer run may go on
    with another replica count and a train run at another width (resources.gpus, resources.nodes): its
    rows, or its loss curve at the same global batch, do not depend on it (the job's plan checks the rest)."""
    if recorded == text or task not in ("infer", "train"):
        return recorded == text
    try:
        now, then = yaml.safe_load(text), yaml.safe_load(recorded)
    except yaml.YAMLError:
        return False
    return _without_replica_count(now) == _without_replica_count(then)


def _without_replica_count(doc: object) -> object:
    if not isinstance(doc, dict) or not isinstance(doc.get("resources"), dict):
        return doc
    return {**doc, "resources": {k: v for k, v in doc["resources"].items() if k not in ("gpus", "nodes")}}


def find_unfinished_run(spec: Spec, in_use: Callable[[Path], bool] = lambda p: False) -> Path | None:
    """The newest run dir of this spec (identical resolved spec) that has not finished: running the
    same spec again resumes it (local executor). Run dirs of SLURM jobs and those `in_use` says a
    live job writes to are never taken."""
    return next((run_dir for run_dir in runs_of_this_spec(spec) if not is_finished(run_dir)
                 and not submitted_to_slurm(run_dir) and not in_use(run_dir)), None)


def find_finished_run(spec: Spec) -> Path | None:
    """The newest run dir of this spec (identical resolved spec) that finished."""
    return next((run_dir for run_dir in runs_of_this_spec(spec) if is_finished(run_dir)), None)


def shared_folder_note(spec: Spec, run_dir: Path) -> str | None:
    """For a command's new run beside earlier runs of the spec's name: the program works in the submit
    folder (as under sbatch and submitit), which they all share, so what it writes there by relative path
    (a snapshot it resumes from) is the earlier runs' too. None for other tasks or a first run."""
    if spec.task != "command":
        return None
    base = Path(spec.runs_dir).expanduser() / spec.name
    try:
        earlier = any(p.is_dir() and p.resolve() != run_dir.resolve() for p in base.iterdir())
    except OSError:
        return None
    if not earlier:
        return None
    return (f"note: the program runs in {Path.cwd()}, which every run of {spec.name} submitted from here shares: "
            "what it writes there by relative path (and resumes from) is the earlier runs' too; "
            "write to ${HPCGPU_RUN_DIR} (this run's folder) for outputs of this run alone")


def resume_text(run_dir: Path, spec: Spec) -> str:
    """'resuming the unfinished run DIR (same spec; --new starts afresh)', with the step it goes on from
    and the width where a train run goes on at another one: read from the run's files, no torch."""
    text = f"resuming the unfinished run {run_dir}"
    done = complete_checkpoints(RunPaths(run_dir).checkpoints)
    if done:
        text += f" from step {checkpoint_step(done[-1])}"
    ran_at, _ = recorded_width(run_dir)
    now = spec.world_size  # ranks, as plan.json records them
    if spec.task == "train" and ran_at is not None and ran_at != now:
        text += f" at {now} GPUs (it ran at {ran_at}; the global batch stays {spec.train.global_batch_size})"
    return text + " (same spec; --new starts afresh)"


def recorded_width(run_dir: Path) -> tuple[int | None, str | None]:
    """(world size, train strategy) of the run's plan.json; (None, None) before the job wrote one."""
    try:
        plan = json.loads(RunPaths(run_dir).plan.read_text())
        return int(plan["world_size"]), (plan.get("train") or {}).get("strategy")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, None


def check_width(run_dir: Path, spec: Spec) -> None:
    """A DeepSpeed run's partitioned checkpoint resumes only at the width it was saved at (DDP and
    FSDP go on at any width): refused here, before the spec is rewritten or a job waits in the queue
    for the refusal the job itself would give (runtime/plan.py check_recorded)."""
    ran_at, strategy = recorded_width(run_dir)
    now = spec.world_size  # ranks, as plan.json records them
    if spec.task == "train" and strategy == "deepspeed" and ran_at is not None and ran_at != now:
        raise SpecError("resources", f"the unfinished run {run_dir} trained with DeepSpeed at {ran_at} GPU(s), and its "
                        f"partitioned checkpoint resumes only at that width, not at {now}: give it {ran_at} GPUs "
                        "(--gpus or resources.nodes x resources.gpus), or start a fresh run (submit --new)")
