"""The code snapshot (launch/snapshot.py, runtime/code.py): what is copied at submit, provenance.json,
the size guard, the switch, and a local command job that runs the copy, also when resumed after its
script was edited in the working tree."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import job_env, only_run_dir, submit
from hpcgpu.contract import RunPaths
from hpcgpu.errors import SpecError
from hpcgpu.launch.rundir import make_run_dir
from hpcgpu.launch.snapshot import commit_text, plan_snapshot
from hpcgpu.runtime.code import CodeMap, code_map, mapped_search_path
from hpcgpu.spec import load_spec
from hpcgpu.spec.schema import Container

GIT = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-c", "commit.gpgsign=false"]

SCRIPT = """
import os, sys
print("version", VERSION, "file", os.path.abspath(__file__), "cwd", os.getcwd(), flush=True)
marker = os.path.join(os.environ["HPCGPU_RUN_DIR"], "ran-once")
if not os.path.exists(marker):  # the first start fails: submitting again resumes this run dir
    open(marker, "w").close()
    sys.exit(3)
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def command_repo(tmp_path: Path, **spec_keys: str) -> Path:
    """A repository with a command spec in exp/ running exp/train.py (relative), committed; the runs dir
    outside it. Returns the spec file."""
    repo = tmp_path / "repo"
    (repo / "exp").mkdir(parents=True)
    (repo / "exp" / "train.py").write_text("VERSION = 1\n" + SCRIPT)
    (repo / ".gitignore").write_text("*.bin\n")
    spec = repo / "exp" / "job.yaml"
    extra = "".join(f"{k}: {v}\n" for k, v in spec_keys.items())
    spec.write_text(textwrap.dedent(f"""\
        name: snap
        task: command
        resources: {{gpus: 1, cpus_per_gpu: 1}}
        command: [{json.dumps(sys.executable)}, train.py]
        runs_dir: {tmp_path / 'runs'}
        """) + extra)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    return spec


def test_copies_tracked_and_untracked_files_not_ignored(tmp_path):
    spec_file = command_repo(tmp_path)
    repo = spec_file.parent.parent
    (repo / "exp" / "helper.py").write_text("X = 1\n")  # untracked, not ignored: copied
    (repo / "weights.bin").write_bytes(b"0" * 10)  # ignored: not copied
    snapshot = plan_snapshot(load_spec(str(spec_file)), spec_file)
    assert snapshot is not None and snapshot.source.git and snapshot.source.root == repo.resolve()
    assert sorted(str(name) for name, _ in snapshot.files) == [".gitignore", "exp/helper.py", "exp/job.yaml",
                                                               "exp/train.py"]


def test_without_a_repository_the_spec_folder_is_copied_but_not_the_runs_dir(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "train.pyc").write_bytes(b"x")
    (tmp_path / "runs" / "snap" / "old").mkdir(parents=True)
    (tmp_path / "runs" / "snap" / "old" / "spec.yaml").write_text("name: snap\n")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(f"name: snap\ntask: command\ncommand: [python, train.py]\nruns_dir: {tmp_path / 'runs'}\n")
    snapshot = plan_snapshot(load_spec(str(spec_file)), spec_file)
    assert snapshot is not None and not snapshot.source.git
    assert sorted(str(name) for name, _ in snapshot.files) == ["job.yaml", "train.py"]


def test_the_job_registry_beside_the_spec_is_never_copied_and_a_vanished_file_is_skipped(tmp_path, monkeypatch):
    """A copy opening the registry's files dropped the submitting process's sqlite locks (POSIX locks go
    with any close): 20 parallel submits from the registry's folder left 11-19 rows. A file listed, then
    gone (another submit's temporary file) is not code: the copy goes on."""
    from hpcgpu.launch.registry import JobRecord, Registry
    from hpcgpu.launch.snapshot import copy_snapshot

    monkeypatch.setenv("HPCGPU_REGISTRY", str(tmp_path / "jobs.db"))
    Registry().add(JobRecord("1", "snap", "job.yaml", "/r", "slurm"))
    for side in ("jobs.db-wal", "jobs.db-shm", "jobs.db-journal"):
        (tmp_path / side).touch()
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "scratch.tmp").write_text("x")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(f"name: snap\ntask: command\ncommand: [python, train.py]\nruns_dir: {tmp_path / 'runs'}\n")
    snapshot = plan_snapshot(load_spec(str(spec_file)), spec_file)
    assert sorted(str(name) for name, _ in snapshot.files) == ["job.yaml", "scratch.tmp", "train.py"]
    (tmp_path / "scratch.tmp").unlink()
    copy_snapshot(snapshot, tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["job.yaml", "train.py"]


def test_provenance_records_commit_dirty_diff_versions_and_container(tmp_path):
    spec_file = command_repo(tmp_path)
    repo = spec_file.parent.parent
    head = git(repo, "rev-parse", "HEAD").strip()
    (repo / "exp" / "train.py").write_text("VERSION = 2\n" + SCRIPT)  # dirty: the diff is recorded
    spec = dataclasses.replace(load_spec(str(spec_file)), container=Container(image="docker://nvcr.io/x:1"))
    run_dir = make_run_dir(spec, spec_file=spec_file)
    paths = RunPaths(run_dir)
    record = json.loads(paths.provenance.read_text())
    assert record["commit"] == head and record["dirty"] is True and record["diff"] == "code.diff"
    assert "+VERSION = 2" in paths.code_diff.read_text()
    assert record["container"] == "docker://nvcr.io/x:1"
    assert record["python"] == ".".join(map(str, sys.version_info[:3]))
    assert set(record["packages"]) == {"hpcgpu", "torch", "transformers", "deepspeed", "peft"}
    assert record["packages"]["hpcgpu"]
    assert record["snapshot"]["source"] == str(repo.resolve()) and record["snapshot"]["files"] == 3
    assert (paths.code / "exp" / "train.py").read_text().startswith("VERSION = 2")  # the tree as submitted
    assert commit_text(run_dir) == head[:7] + " dirty"


def test_the_switch_turns_the_copy_off_and_keeps_provenance(tmp_path):
    spec_file = command_repo(tmp_path, code="{snapshot: false}")
    spec = load_spec(str(spec_file))
    assert plan_snapshot(spec, spec_file) is None
    run_dir = make_run_dir(spec, spec_file=spec_file)
    record = json.loads(RunPaths(run_dir).provenance.read_text())
    assert not RunPaths(run_dir).code.exists() and record["snapshot"] is None
    assert record["commit"] and record["dirty"] is False and code_map(RunPaths(run_dir)) is None


def test_a_snapshot_over_the_limit_is_refused_naming_the_biggest_files(tmp_path):
    spec_file = command_repo(tmp_path, code="{max_mb: 0.001}")
    (spec_file.parent / "ckpt.pt").write_bytes(b"0" * 5000)  # tracked by mistake (untracked, not ignored)
    spec = load_spec(str(spec_file))
    with pytest.raises(SpecError) as err:
        make_run_dir(spec, spec_file=spec_file)
    assert "exp/ckpt.pt (0.0 MB)" in str(err.value) and "code.max_mb" in str(err.value)
    done = submit(spec_file, env=job_env(HPCGPU_REGISTRY=str(tmp_path / "jobs.db")))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "biggest: exp/ckpt.pt" in lines[0]
    assert not (tmp_path / "runs" / "snap").exists() or not any((tmp_path / "runs" / "snap").iterdir())


def test_callable_modules_import_from_the_copy(tmp_path, monkeypatch):
    source, copy = tmp_path / "src", tmp_path / "run" / "code"
    (source / "pkg").mkdir(parents=True)
    (copy / "pkg").mkdir(parents=True)
    monkeypatch.chdir(source / "pkg")
    found = mapped_search_path(CodeMap(source, copy), ["", str(source), "/usr/lib/python3"])
    assert found == [str(copy / "pkg"), str(copy), "/usr/lib/python3"]


def test_a_local_command_job_runs_the_snapshot_and_its_resume_too(tmp_path):
    """The local executor starts at once, so the edit comes between the first start and the resume:
    the resumed run still runs the submit-time script (tests/slurm/test_snapshot_slurm.py edits it
    while a SLURM job waits)."""
    spec_file = command_repo(tmp_path)
    repo = spec_file.parent.parent
    env = job_env(HPCGPU_REGISTRY=str(tmp_path / "jobs.db"))
    first = submit(spec_file, env=env)
    assert first.returncode != 0
    run_dir = only_run_dir(tmp_path / "runs", "snap")
    code = RunPaths(run_dir).code
    (repo / "exp" / "train.py").write_text("VERSION = 2\n" + SCRIPT)  # edited after submit
    again = submit(spec_file, env=env)
    assert again.returncode == 0, again.stderr
    assert f"resuming the unfinished run {run_dir}" in again.stderr
    log = RunPaths(run_dir).rank_log(0).read_text()
    ran = [line for line in log.splitlines() if line.startswith("version")]
    assert len(ran) == 2, log
    for line in ran:  # both starts: the copy's script, in the submit folder (data and outputs stay there)
        assert line == f"version 1 file {code / 'exp' / 'train.py'} cwd {repo / 'exp'}", line
    status = subprocess.run([sys.executable, "-m", "hpcgpu", "status", "local-2"], capture_output=True,
                            text=True, env=env, timeout=60)
    head = git(repo, "rev-parse", "HEAD").strip()
    assert f"commit    {head[:7]}\n" in status.stdout, status.stdout
    fresh = submit(spec_file, "--new", env=env)  # beside the first run, in the same submit folder: the note says so
    assert "note: the program runs in" in fresh.stderr and "version 2" in fresh.stdout + RunPaths(
        max((tmp_path / "runs" / "snap").iterdir())).rank_log(0).read_text()


def test_command_arguments_naming_files_of_the_tree_point_into_the_copy(tmp_path, monkeypatch):
    source, copy = tmp_path / "src", tmp_path / "run" / "code"
    for root in (source, copy):
        (root / "exp").mkdir(parents=True)
        (root / "exp" / "train.py").write_text("")
    code = CodeMap(source, copy)
    monkeypatch.chdir(tmp_path)  # the working dir stays where it is; file arguments of the tree move
    assert code.argument("src/exp/train.py") == str(copy / "exp" / "train.py")
    assert code.argument(str(source / "exp" / "train.py")) == str(copy / "exp" / "train.py")
    assert code.argument("--out=src/exp") == "--out=src/exp"
    assert code.argument("src/exp/missing.csv") == "src/exp/missing.csv"  # not a file of the copy
    assert code.argument("import os\0" + "x" * 5000).startswith("import os")  # a -c program
    monkeypatch.chdir(source / "exp")  # inside the tree: a relative script name moves too
    assert code.argument("train.py") == str(copy / "exp" / "train.py")
