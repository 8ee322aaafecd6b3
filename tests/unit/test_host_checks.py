"""Checks before a job is made (hpcgpu/launch/checks.py): what the job would fail on after its wait in
the queue is found by validate, sbatch and submit (SLURM and local) as one line and exit 2, with
nothing written; runs_dir that cannot hold run dirs; env_passthrough variables missing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS, REPO
from hpcgpu.launch import checks
from hpcgpu.spec import load_spec

EVAL_TEXT = str(CONFIGS / "data" / "pydocs-eval.txt")
TINY = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 256}

# every command that makes (or would make) a job; SLURM submit checks before it asks sinfo,
# so these cases need no cluster
COMMANDS = {
    "validate": ["validate"],
    "sbatch": ["sbatch"],
    "submit-slurm": ["submit"],
    "submit-local": ["submit", "--executor", "local"],
}


def hpcgpu(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("HPCGPU_DEBUG", "HF_TOKEN", "SBATCH_EXPORT")}
    environ.update({"CUDA_VISIBLE_DEVICES": "", "HPCGPU_REGISTRY": str(cwd / "jobs.db"), **env})
    return subprocess.run([sys.executable, "-m", "hpcgpu", *args], capture_output=True, text=True, cwd=cwd,
                          env=environ, timeout=120)


def train_doc(tmp_path: Path, **over) -> dict:
    doc = {"name": "chk", "task": "train", "resources": {"gpus": 1, "cpus_per_gpu": 1},
           "model": {"config": dict(TINY)}, "data": {"train": EVAL_TEXT, "seq_len": 32},
           "train": {"global_batch_size": 2, "max_steps": 1}, "runs_dir": str(tmp_path / "runs")}
    doc.update(over)
    return doc


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "exp" / "s.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def one_error_line(done: subprocess.CompletedProcess, *words: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcgpu: error:"), done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def all_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*")) if folder.exists() else []


# --- defect 5: inputs and model type --------------------------------------------------------------

MISSING = {
    "data.train": ({"data": {"train": "nope/train.txt", "seq_len": 32}}, "nope/train.txt"),
    "data.eval": ({"data": {"train": EVAL_TEXT, "eval": "eval.txt", "seq_len": 32}}, "eval.txt"),
    "deepspeed.config": ({"distributed": {"deepspeed": {"config": "ds.json"}}}, "ds.json"),
    "model.name_or_path": ({"model": {"name_or_path": "./my-model"}}, "my-model"),
    "model.name_or_path-nested": ({"model": {"name_or_path": "models/llama/7b"}}, "models/llama/7b"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(MISSING))
def test_a_missing_input_is_one_line_and_exit_2(tmp_path, case, command):
    over, shown = MISSING[case]
    spec = write(tmp_path, train_doc(tmp_path, **over))
    key = case.removesuffix("-nested").replace("deepspeed.config", "distributed.deepspeed.config")
    line = one_error_line(hpcgpu(*COMMANDS[command], str(spec), cwd=tmp_path), key, shown)
    assert str(tmp_path / "exp") in line  # the path as the job would look for it: from the spec's folder
    assert not (tmp_path / "runs").exists()


def test_a_hub_id_is_not_a_path_and_an_existing_input_passes(tmp_path):
    (tmp_path / "exp" / "ds.json").parent.mkdir()
    (tmp_path / "exp" / "ds.json").write_text("{}")
    for name in ("gpt2", "openai-community/gpt2"):
        spec = write(tmp_path, train_doc(tmp_path, model={"name_or_path": name},
                                          distributed={"deepspeed": {"config": "ds.json"}}))
        done = hpcgpu("validate", str(spec), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert load_spec(spec).model.name_or_path == name


def test_a_folder_for_the_deepspeed_file_is_refused(tmp_path):
    (tmp_path / "exp" / "ds").mkdir(parents=True)
    spec = write(tmp_path, train_doc(tmp_path, distributed={"deepspeed": {"config": "ds"}}))
    one_error_line(hpcgpu("validate", str(spec), cwd=tmp_path), "distributed.deepspeed.config", "folder")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_input_is_refused(tmp_path):
    data = tmp_path / "exp" / "secret.txt"
    data.parent.mkdir()
    data.write_text("x")
    data.chmod(0)
    spec = write(tmp_path, train_doc(tmp_path, data={"train": "secret.txt"}))
    one_error_line(hpcgpu("validate", str(spec), cwd=tmp_path), "data.train", "permission denied")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unknown_model_type_is_one_short_line_with_close_matches(tmp_path, command):
    spec = write(tmp_path, train_doc(tmp_path, model={"config": {**TINY, "model_type": "gtp2"}}))
    line = one_error_line(hpcgpu(*COMMANDS[command], str(spec), cwd=tmp_path), "model.config.model_type",
                          "'gtp2'", "gpt2")
    assert len(line) < 200  # a hint, not transformers' list of hundreds of model types
    assert not (tmp_path / "runs").exists()


def test_model_types_come_from_a_subprocess_cached_per_transformers_version(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    checks.known_model_types.cache_clear()
    version = checks.transformers_version()
    assert version, "transformers is installed in the test environment"
    known = checks.known_model_types(version)
    assert known and {"gpt2", "llama"} <= known
    cached = tmp_path / "cache" / "hpcgpu" / f"model-types-transformers-{version}.json"
    assert set(json.loads(cached.read_text())) == known
    # the next command reads the file and starts no interpreter
    checks.known_model_types.cache_clear()

    def no_subprocess(*args, **kwargs):
        raise AssertionError("asked transformers again although the cache holds the answer")

    monkeypatch.setattr(checks.subprocess, "run", no_subprocess)
    assert checks.known_model_types(version) == known
    # another transformers version is asked again, into a file of its own
    checks.known_model_types.cache_clear()
    asked = []
    monkeypatch.setattr(checks.subprocess, "run", lambda *a, **k: asked.append(a) or subprocess.CompletedProcess(
        a, 0, '\n["only_this"]\n', ""))
    assert checks.known_model_types("0.0.1") == {"only_this"}
    assert len(asked) == 1 and (cached.parent / "model-types-transformers-0.0.1.json").exists()
    checks.known_model_types.cache_clear()


def test_without_transformers_the_model_type_is_not_checked(tmp_path, monkeypatch):
    import importlib.metadata

    spec = load_spec(write(tmp_path, train_doc(tmp_path, model={"config": {**TINY, "model_type": "gtp2"}})))
    with pytest.raises(Exception, match="gtp2"):
        checks.check_host(spec)

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    checks.check_host(spec)  # no transformers on this login node: nothing to ask, no error


def test_every_sweep_task_is_checked(tmp_path):
    spec = write(tmp_path, train_doc(tmp_path, sweep={"model.config.model_type": ["gpt2", "lama"]}))
    one_error_line(hpcgpu("submit", str(spec), "--executor", "local", cwd=tmp_path), "model_type", "'lama'", "llama")
    assert not (tmp_path / "runs").exists()


# --- defect 4: runs_dir that cannot hold run dirs -------------------------------------------------

def blocked_runs_dir(tmp_path: Path, case: str) -> str:
    if case == "file-in-the-way":
        (tmp_path / "runs").write_text("a file")
        return str(tmp_path / "runs")
    if case == "file-at-name":
        (tmp_path / "runs").mkdir()
        (tmp_path / "runs" / "cmd").write_text("a file where runs/<name>/ goes")
        return str(tmp_path / "runs")
    if case == "under-a-file":
        (tmp_path / "runs").write_text("a file")
        return str(tmp_path / "runs" / "deeper")
    if case == "proc":
        return "/proc/hpcgpu-runs"
    assert case == "read-only"
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs").chmod(0o555)
    return str(tmp_path / "runs")


RUNS_DIR_CASES = ["file-in-the-way", "file-at-name", "under-a-file", "proc",
                  pytest.param("read-only", marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes anyway"))]


@pytest.mark.parametrize("command", ["sbatch", "submit-local", "submit-slurm"])
@pytest.mark.parametrize("case", RUNS_DIR_CASES)
def test_an_unwritable_runs_dir_is_one_line_naming_key_and_path(tmp_path, case, command):
    runs_dir = blocked_runs_dir(tmp_path, case)
    before = all_files(tmp_path)
    spec = tmp_path / "cmd.yaml"
    spec.write_text(f"name: cmd\ntask: command\ncommand: [echo, hi]\nresources: {{gpus: 1}}\nruns_dir: {runs_dir}\n")
    extra = ["-o", str(tmp_path / "job.sbatch")] if command == "sbatch" else []
    done = hpcgpu(*COMMANDS[command], str(spec), *extra, cwd=tmp_path)
    if command == "submit-slurm" and case == "proc" and done.returncode == 3:
        pytest.skip("no SLURM here: sinfo is asked before the run dir is made")
    one_error_line(done, "runs_dir", runs_dir)
    left = set(all_files(tmp_path)) - set(before) - {spec}
    assert not {p for p in left if not p.name.startswith("jobs.db")}, left  # nothing half-written


def test_make_run_dir_removes_what_it_made_when_spec_yaml_cannot_be_written(tmp_path, monkeypatch):
    from hpcgpu.errors import SpecError
    from hpcgpu.launch import rundir

    spec = load_spec(CONFIGS / "hello-command.yaml", [f"runs_dir={tmp_path / 'a' / 'runs'}"])

    def disk_full(path, text, mode=None):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(rundir, "write_atomic", disk_full)
    with pytest.raises(SpecError, match="runs_dir.*No space left"):
        rundir.make_run_dir(spec)
    assert list(tmp_path.iterdir()) == []  # not even the runs/<name>/ folders it made on the way


# --- env_passthrough ------------------------------------------------------------------------------

PASS = "name: cmd\ntask: command\ncommand: [echo, hi]\nenv_passthrough: [HF_TOKEN, WANDB_API_KEY]\n"


@pytest.mark.parametrize("command", ["submit-slurm", "submit-local"])
def test_submit_refuses_when_a_passthrough_variable_is_not_set(tmp_path, command):
    spec = tmp_path / "cmd.yaml"
    spec.write_text(PASS + f"runs_dir: {tmp_path / 'runs'}\n")
    line = one_error_line(hpcgpu(*COMMANDS[command], str(spec), cwd=tmp_path, WANDB_API_KEY="w"),
                          "env_passthrough", "HF_TOKEN", "not set")
    assert "WANDB_API_KEY" not in line  # only the one that is missing
    assert not (tmp_path / "runs").exists()


def test_sbatch_warns_about_an_unset_passthrough_variable_and_writes_the_script(tmp_path):
    spec = tmp_path / "cmd.yaml"
    spec.write_text(PASS + f"runs_dir: {tmp_path / 'runs'}\n")
    done = hpcgpu("sbatch", str(spec), cwd=tmp_path, HF_TOKEN="x")
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("hpcgpu: warning: env_passthrough: WANDB_API_KEY is not set")
    assert "HF_TOKEN" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert len(list((tmp_path / "runs" / "cmd").glob("*/job.sbatch"))) == 1
    quiet = hpcgpu("sbatch", str(spec), cwd=tmp_path, HF_TOKEN="x", WANDB_API_KEY="y")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_an_sbatch_export_that_drops_passthrough_variables_is_refused(tmp_path):
    spec = tmp_path / "cmd.yaml"
    spec.write_text(PASS + f"runs_dir: {tmp_path / 'runs'}\n")
    env = {"HF_TOKEN": "x", "WANDB_API_KEY": "y"}
    one_error_line(hpcgpu("submit", str(spec), cwd=tmp_path, SBATCH_EXPORT="NONE", **env),
                   "SBATCH_EXPORT=NONE", "HF_TOKEN")
    one_error_line(hpcgpu("submit", str(spec), cwd=tmp_path, SBATCH_EXPORT="PATH,HF_TOKEN", **env),
                   "WANDB_API_KEY")
    # the local executor does not go through sbatch
    assert hpcgpu("submit", str(spec), "--executor", "local", "--dry-run", cwd=tmp_path,
                  SBATCH_EXPORT="NONE", **env).returncode == 0
    assert not (tmp_path / "runs").exists()
