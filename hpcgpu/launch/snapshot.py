"""The code a job runs, copied into its run dir at submit, and where it came from (provenance.json).

A queued job waits for hours and a requeued one resumes days later: each runs <run dir>/code/, taken
here, never the working tree of that moment (the job side maps its paths: runtime/code.py). What is
copied: the git-tracked and untracked, not-ignored files of the repository the spec lives in, or the
spec's folder where there is none; for task command and callable (train and infer run hpcgpu's own
code, whose version provenance.json records)."""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hpcgpu.contract import RunPaths
from hpcgpu.errors import SpecError
from hpcgpu.launch.registry import registry_files
from hpcgpu.spec import Spec

PACKAGES = ("hpcgpu", "torch", "transformers", "deepspeed", "peft")
SNAPSHOT_TASKS = ("command", "callable")
# a folder without a repository: what no one means as code (and the runs dir, which holds the snapshots)
SKIPPED_DIRS = {".git", ".venv", "venv", "__pycache__", "node_modules", ".mypy_cache", ".pytest_cache"}
GIT_TIMEOUT_S = 30


@dataclass(frozen=True)
class Source:
    """Where a spec's code lives: its repository's top folder (`git` true) or the spec's own folder."""
    root: Path
    git: bool


@dataclass(frozen=True)
class Snapshot:
    """What a submission copies: the files (relative to source.root) and their total size."""
    source: Source
    files: list[tuple[Path, int]]

    @property
    def size(self) -> int:
        return sum(size for _, size in self.files)


def git(root: Path, *args: str) -> str | None:
    """`git -C root ARGS`'s output; None where git is missing or fails (not a repository)."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def source_of(spec_file: str | os.PathLike) -> Source:
    folder = Path(spec_file).expanduser().resolve().parent
    top = git(folder, "rev-parse", "--show-toplevel")
    return Source(Path(top.strip()).resolve(), True) if top else Source(folder, False)


def code_files(source: Source, runs_dir: Path) -> list[Path]:
    """The files to copy, relative to the source's root; never anything under the runs dir, nor the job
    registry's files (registry_files), which a copy must not even open."""
    if source.git:
        out = git(source.root, "ls-files", "-co", "--exclude-standard", "-z") or ""
        names = [Path(n) for n in out.split("\0") if n]
    else:
        names = []
        for folder, dirs, files in os.walk(source.root):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not is_under(Path(folder, d), runs_dir)]
            names += [Path(folder, f).relative_to(source.root) for f in files]
    registry = registry_files()
    return [n for n in names if not is_under(source.root / n, runs_dir) and (source.root / n).resolve() not in registry]


def is_under(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder)
        return True
    except (ValueError, OSError):
        return False


def plan_snapshot(spec: Spec, spec_file: str | os.PathLike) -> Snapshot | None:
    """The snapshot a submission of `spec` takes (None: none, for its task or `code.snapshot: false`),
    refused (SpecError, exit 2) when bigger than code.max_mb: before any run dir exists."""
    if not spec.code.snapshot or spec.task not in SNAPSHOT_TASKS:
        return None
    source = source_of(spec_file)
    runs_dir = Path(spec.runs_dir).expanduser().resolve()
    files = []
    for name in code_files(source, runs_dir):
        path = source.root / name
        if path.is_file() and not path.is_symlink():  # a deleted tracked file, a link out: not copied
            files.append((name, path.stat().st_size))
        elif path.is_symlink():
            files.append((name, 0))
    snapshot = Snapshot(source, files)
    check_size(spec, snapshot)
    return snapshot


def check_size(spec: Spec, snapshot: Snapshot) -> None:
    limit = spec.code.max_mb * 1e6
    if snapshot.size <= limit:
        return
    biggest = sorted(snapshot.files, key=lambda f: f[1], reverse=True)[:3]
    named = ", ".join(f"{name} ({size / 1e6:.1f} MB)" for name, size in biggest)
    raise SpecError("code.max_mb", f"the code snapshot of {snapshot.source.root} would be {snapshot.size / 1e6:.1f} MB, "
                    f"over {spec.code.max_mb:g} MB; biggest: {named}: ignore them in .gitignore (or git rm "
                    "--cached), raise code.max_mb, or set code.snapshot: false")


def copy_snapshot(snapshot: Snapshot, dest: Path) -> None:
    """Copy the files into `dest`, keeping modes (a script stays executable) and links as links."""
    for name, _ in snapshot.files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copy2(snapshot.source.root / name, target, follow_symlinks=False)
        except FileNotFoundError:  # gone since it was listed (another program's temporary file): not code
            pass


def versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata: torch is never imported on the host."""
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_state(root: Path, paths: RunPaths) -> dict[str, object]:
    """The commit and whether the tree differs from it; a dirty tree's `git diff HEAD` goes to code.diff."""
    commit = git(root, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git(root, "status", "--porcelain") or ""
    dirty = bool(status.strip())
    if dirty:
        diff = git(root, "diff", "HEAD", "--binary") or ""
        untracked = [line[3:] for line in status.splitlines() if line.startswith("?? ")]
        if untracked:
            diff += "".join(f"# untracked: {name}\n" for name in untracked)
        paths.code_diff.write_text(diff)
    return {"commit": commit.strip(), "dirty": dirty, "diff": paths.code_diff.name if dirty else None}


def provenance(spec: Spec, spec_file: str | os.PathLike | None, snapshot: Snapshot | None,
               paths: RunPaths) -> dict[str, object]:
    source = snapshot.source if snapshot else (source_of(spec_file) if spec_file else None)
    record: dict[str, object] = {"spec_file": str(Path(spec_file).resolve()) if spec_file else None}
    record.update(git_state(source.root, paths) if source and source.git else {"commit": None, "dirty": None})
    record["snapshot"] = ({"source": str(snapshot.source.root), "folder": paths.code.name,
                           "files": len(snapshot.files), "bytes": snapshot.size} if snapshot else None)
    record["python"] = platform.python_version()
    record["packages"] = versions()
    container = getattr(spec, "container", None)
    record["container"] = getattr(container, "image", None)
    return record


def write_code(spec: Spec, spec_file: str | os.PathLike | None, snapshot: Snapshot | None, run_dir: Path) -> None:
    """The snapshot into <run dir>/code/ and provenance.json (last: its presence says the copy is whole)."""
    paths = RunPaths(run_dir)
    if snapshot is not None:
        copy_snapshot(snapshot, paths.code)
    record = provenance(spec, spec_file, snapshot, paths)
    paths.provenance.write_text(json.dumps(record, indent=2) + "\n")


def commit_text(run_dir: str | os.PathLike) -> str | None:
    """'abc1234', 'abc1234 dirty', or None where the run dir records no commit (no repository)."""
    try:
        record = json.loads(RunPaths(Path(run_dir)).provenance.read_text())
    except (OSError, ValueError):
        return None
    commit = record.get("commit") if isinstance(record, dict) else None
    if not commit:
        return None
    return str(commit)[:7] + (" dirty" if record.get("dirty") else "")
