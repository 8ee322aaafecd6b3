"""The host-side CLI as a user runs it: exit codes, one-line errors, files written, no heavy imports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import CONFIGS, REPO
from hpcgpu.spec import load_spec


def hpcgpu(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HPCGPU_DEBUG"}
    return subprocess.run([sys.executable, "-m", "hpcgpu", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=60)


def test_help():
    done = hpcgpu("--help")
    assert done.returncode == 0, done.stderr
    for command in ("validate", "sbatch", "submit", "schema"):
        assert command in done.stdout


def test_validate_ok():
    done = hpcgpu("validate", "configs/tiny-gpt2.yaml")
    assert done.returncode == 0, done.stderr
    assert "tiny-gpt2" in done.stdout and done.stderr == ""


def test_validate_overrides_show_in_summary():
    done = hpcgpu("validate", "configs/hello-command.yaml", "--gpus", "4", "--nodes", "2", "--set",
                  "resources.time='02:00:00'")
    assert done.returncode == 0, done.stderr
    assert "8 (2 node(s) x 4 GPU(s)" in done.stdout and "02:00:00" in done.stdout


BAD = {
    "not-yaml": ("name: a\ncommand: [x\n", "not valid YAML"),
    "list": ("- a\n- b\n", "mapping"),
    "unknown-key": ("name: a\ntask: command\ncommand: [x]\nresources: {gpu: 2}\n", "did you mean 'gpus'"),
    "wrong-type": ("name: a\ntask: command\ncommand: [x]\nresources: {gpus: two}\n", "resources.gpus"),
    "zero-count": ("name: a\ntask: command\ncommand: [x]\nresources: {nodes: 0}\n", "resources.nodes"),
    "bad-time": ("name: a\ntask: command\ncommand: [x]\nresources: {time: '25:00'}\n", "resources.time"),
    "empty": ("", "empty"),
    "missing": (None, "not found"),
}


@pytest.mark.parametrize("command", ["validate", "sbatch"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_spec_one_line_exit_2(tmp_path, case, command):
    text, words = BAD[case]
    path = tmp_path / "s.yaml"
    if text is not None:
        path.write_text(text)
    done = hpcgpu(command, str(path), "--set", f"runs_dir={tmp_path / 'runs'}")
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("hpcgpu: error:") and words in lines[0] and "s.yaml" in lines[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()  # nothing is written for a bad spec


def test_debug_shows_traceback(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: a\ntask: command\ncommand: [x]\nresources: {gpus: 0}\n")
    done = hpcgpu("--debug", "validate", str(path))
    assert done.returncode == 2
    assert "Traceback" in done.stderr and "hpcgpu: error:" in done.stderr


@pytest.mark.parametrize("flags", [["--gpus", "0"], ["--nodes", "-1"], ["--gpus", "two"], ["--bogus"]])
def test_bad_flag_exit_2(flags):
    done = hpcgpu("validate", "configs/hello-command.yaml", *flags)
    assert done.returncode == 2, done.stdout
    assert "Traceback" not in done.stderr and flags[0] in done.stderr


def test_sbatch_writes_script_and_run_dir(tmp_path):
    out = tmp_path / "job.sbatch"
    runs = tmp_path / "runs"
    done = hpcgpu("sbatch", str(CONFIGS / "tiny-gpt2.yaml"), "-o", str(out), "--gpus", "4",
                  "--set", f"runs_dir={runs}", "--set", "train.max_steps=7")
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.startswith("#!/bin/bash") and os.access(out, os.X_OK)
    run_dirs = list((runs / "tiny-gpt2").iterdir())
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    assert str(run_dir) in done.stdout
    assert (run_dir / "job.sbatch").read_text() == text
    # the resolved spec in the run dir is the spec the job will run: same values, flags included
    resolved = load_spec(run_dir / "spec.yaml")
    assert resolved == load_spec(CONFIGS / "tiny-gpt2.yaml", [f"runs_dir={runs}", "train.max_steps=7"], gpus=4)
    assert resolved.resources.gpus == 4 and resolved.train.max_steps == 7
    assert str(run_dir / "spec.yaml") in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


def test_sbatch_output_folder_must_exist(tmp_path):
    done = hpcgpu("sbatch", "configs/hello-command.yaml", "-o", str(tmp_path / "no" / "job.sbatch"),
                  "--set", f"runs_dir={tmp_path / 'runs'}")
    assert done.returncode == 2 and done.stderr.startswith("hpcgpu: error:") and "Traceback" not in done.stderr


def test_schema_is_json():
    done = hpcgpu("schema")
    assert done.returncode == 0, done.stderr
    schema = json.loads(done.stdout)
    assert schema["type"] == "object" and "resources" in schema["properties"]
    assert schema["properties"]["resources"]["additionalProperties"] is False


HEAVY = ("torch", "transformers", "deepspeed", "submitit", "accelerate", "numpy", "matplotlib", "pynvml", "tensorboard",
         "wandb")


def test_host_commands_import_nothing_heavy(tmp_path):
    probe = textwrap.dedent(f"""
        import contextlib, io, sys
        import hpcgpu.cli
        runs = {str(tmp_path / 'runs')!r}
        for argv in (["--help"], ["validate", "configs/tiny-gpt2.yaml"], ["schema"],
                     ["sbatch", "configs/tiny-gpt2.yaml", "--set", "runs_dir=" + runs]):
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    hpcgpu.cli.main(argv)
                except SystemExit as exc:
                    assert exc.code in (0, None), (argv, exc.code)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print(" ".join(heavy))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"host-side commands imported: {done.stdout.strip()}"


def test_sbatch_refuses_a_sweep_instead_of_dropping_points(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\ntask: command\ncommand: [echo]\nsweep: {train.lr: [0.1, 0.2]}\n"
                    f"runs_dir: {tmp_path / 'runs'}\n")
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "sbatch", str(spec), "-o", str(tmp_path / "j.sbatch")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "hpcgpu submit" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "j.sbatch").exists() and not (tmp_path / "runs").exists()
    ok = subprocess.run([sys.executable, "-m", "hpcgpu", "sbatch", str(spec), "--set", "sweep={}", "-o",
                         str(tmp_path / "j.sbatch")], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and (tmp_path / "j.sbatch").exists(), ok.stderr
