"""Chained jobs (`hpcgpu submit SPEC --after JOB`, hpcgpu/launch/chain.py): the dependency option in
the sbatch text and submitit's parameters, ${after} resolved to the upstream run dir, the one-line
errors, and the local executor's chain (job 2 waits for job 1 and trains from ${after}/model; a
failed job 1 leaves job 2 not run, said by `hpcgpu status`)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import job_env, only_run_dir, submit_cmd, train_spec, write_spec_file
from hpcgpu.launch.chain import Upstream, with_after
from hpcgpu.launch.options import sbatch_options
from hpcgpu.launch.registry import JobRecord, Registry
from hpcgpu.launch.sbatch import render_directives
from hpcgpu.launch.state import waiting_reason
from hpcgpu.spec import load_spec


def one_rank(name: str, **extra: object) -> dict:
    """The tiny GPT-2 on one CPU rank, a few steps: the chain's links, quick."""
    return train_spec(name, resources={"gpus": 1}, train={"global_batch_size": 2, "max_steps": 2}, **extra)


def hpcgpu(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcgpu", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


def test_afterok_in_the_sbatch_text_and_submitit_parameters(tmp_path: Path) -> None:
    from hpcgpu.launch.submitit_slurm import submission_text, submitit_parameters

    spec = load_spec(write_spec_file(tmp_path, one_rank("two", model={"name_or_path": "${after}/model"})))
    upstream = Upstream("123", tmp_path / "runs" / "one" / "x", "RUNNING")
    chained = with_after(spec, upstream, slurm=True, base=tmp_path)
    assert chained.model.name_or_path == f"{upstream.run_dir}/model"
    options = sbatch_options(chained, tmp_path / "run")
    assert ("dependency", "afterok:123") in options
    assert "#SBATCH --dependency=afterok:123" in render_directives(options)
    assert submitit_parameters(options)["additional_parameters"]["dependency"] == "afterok:123"
    assert "#SBATCH --dependency=afterok:123" in submission_text(tmp_path / "run", options, "true")
    # an array task, or a whole array (afterok on an array id waits for all its tasks)
    task = with_after(spec, Upstream("123_4", upstream.run_dir, "PENDING"), slurm=True, base=tmp_path)
    assert task.slurm.extra["dependency"] == "afterok:123_4"
    # an upstream that completed needs no dependency; the local executor never gets one
    done = with_after(spec, Upstream("123", upstream.run_dir, "COMPLETED"), slurm=True, base=tmp_path)
    assert "dependency" not in done.slurm.extra
    assert "dependency" not in with_after(spec, upstream, slurm=False, base=tmp_path).slurm.extra


def test_status_words_for_a_dependency() -> None:
    job = JobRecord("124", "two", "s.yaml", "/r", "slurm", after="123")
    assert waiting_reason(job, "Dependency") == "waiting for job 123 to complete"
    assert waiting_reason(job, "DependencyNeverSatisfied").startswith("will not run: job 123 did not complete")
    assert "hpcgpu cancel 124" in waiting_reason(job, "DependencyNeverSatisfied")
    assert waiting_reason(JobRecord("9", "x", "s", "/r", "slurm"), "Dependency") == "Dependency"


@pytest.mark.parametrize("spec_extra, args, says", [
    ({"model": {"name_or_path": "${after}/model"}}, [], "submit it with --after JOB"),
    ({}, ["--after", "local-99"], "--after local-99: no such job"),
    ({"model": {"name_or_path": "${after.run_dir}/model"}}, ["--after", "local-1"], "the one reference"),
    ({"model": {"name_or_path": "${after}/model"}}, ["--after", "local-1", "--executor", "slurm"],
     "cannot wait for a job of the local executor"),
])
def test_errors_are_one_line_exit_2(tmp_path: Path, spec_extra: dict, args: list[str], says: str) -> None:
    registry = tmp_path / "jobs.db"
    Registry(registry).add(JobRecord("", "one", "one.yaml", str(tmp_path), "local", state="RUNNING", pid=1))
    env = job_env(HPCGPU_REGISTRY=str(registry))
    spec = write_spec_file(tmp_path, one_rank("two", **spec_extra))
    proc = hpcgpu(["submit", str(spec), "--executor", "local", *args, "--dry-run"], env, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_sbatch_of_a_spec_with_after_says_how_to_fill_it_in(tmp_path: Path) -> None:
    """sbatch has no --after: it names ${after} and --set, not a missing file called ${after}/model."""
    spec = write_spec_file(tmp_path, one_rank("two", model={"name_or_path": "${after}/model"}))
    proc = hpcgpu(["sbatch", str(spec)], job_env(HPCGPU_REGISTRY=str(tmp_path / "jobs.db")), tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "${after}" in proc.stderr and "--set model.name_or_path=DIR" in proc.stderr, proc.stderr
    assert "file not found" not in proc.stderr


def test_an_upstream_that_failed_refuses_at_once(tmp_path: Path) -> None:
    registry = tmp_path / "jobs.db"
    Registry(registry).add(JobRecord("", "one", "one.yaml", str(tmp_path), "local", state="FAILED"))
    spec = write_spec_file(tmp_path, one_rank("two", model={"name_or_path": "${after}/model"}))
    proc = hpcgpu(["submit", str(spec), "--executor", "local", "--after", "local-1"],
                  job_env(HPCGPU_REGISTRY=str(registry)), tmp_path)
    assert proc.returncode == 2 and "that job ended FAILED; this one would never run" in proc.stderr, proc.stderr


def registered(path: Path, count: int, proc: subprocess.Popen) -> None:
    """Wait until the registry holds `count` jobs (the upstream one is registered, running)."""
    deadline = time.monotonic() + 60
    while not path.exists() or Registry(path).count() < count:
        assert time.monotonic() < deadline and proc.poll() is None, "the upstream job never registered"
        time.sleep(0.1)


def test_local_chain_runs_job_2_on_job_1_model_and_a_failed_job_1_leaves_it_not_run(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    env = job_env(HPCGPU_REGISTRY=str(db))
    first = write_spec_file(tmp_path, one_rank("one"))
    # job 2: its model is job 1's trained model/, which does not exist when it is submitted
    second = write_spec_file(tmp_path, {k: v for k, v in one_rank("two").items() if k != "model"}
                             | {"model": {"name_or_path": "${after}/model"}})
    job1 = subprocess.Popen(submit_cmd(first), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)
    try:
        registered(db, 1, job1)
        proc = hpcgpu(["submit", str(second), "--executor", "local", "--after", "local-1"], env, tmp_path,
                      timeout=240)
    finally:
        job1.wait(timeout=120)
    assert job1.returncode == 0
    assert proc.returncode == 0, proc.stderr
    assert "waiting for job local-1" in proc.stderr
    run1, run2 = only_run_dir(tmp_path / "runs", "one"), only_run_dir(tmp_path / "runs", "two")
    assert load_spec(run2 / "spec.yaml").model.name_or_path == str(run1 / "model")
    assert (run2 / "model").is_dir()
    status = hpcgpu(["status", "local-2"], env, tmp_path)
    assert "after     job local-1" in status.stdout, status.stdout
    assert "resuming" not in proc.stderr  # it runs in the run dir registered while it waited

    # a job 1 that fails (a command ending with exit 3 once job 2 waits for it): job 2 is recorded as
    # not run, and nothing of it runs
    go = tmp_path / "go"
    fails = f"import os, sys, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.1)\nsys.exit(3)"
    broken = write_spec_file(tmp_path, {"name": "bad", "task": "command", "resources": {"gpus": 1},
                                        "command": [sys.executable, "-c", fails]})
    job3 = subprocess.Popen(submit_cmd(broken), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            cwd=tmp_path)
    registered(db, 3, job3)
    said = tmp_path / "job4.err"
    with open(said, "w") as err:
        job4 = subprocess.Popen(submit_cmd(second, "--after", "local-3"), stdout=subprocess.DEVNULL, stderr=err,
                                text=True, env=env, cwd=tmp_path)
        deadline = time.monotonic() + 60
        while "waiting for job local-3" not in said.read_text():
            assert time.monotonic() < deadline and job4.poll() is None, said.read_text()
            time.sleep(0.1)
        waiting = hpcgpu(["status", "local-4"], env, tmp_path).stdout  # registered while it waits
        assert "PENDING" in waiting and "waiting for job local-3 to complete" in waiting, waiting
        go.touch()
        assert job3.wait(timeout=120) == 3 and job4.wait(timeout=120) == 1, said.read_text()
    assert "job local-4 not run: job local-3 ended FAILED" in said.read_text()
    status = hpcgpu(["status", "local-4"], env, tmp_path)
    assert "CANCELLED" in status.stdout and "not run: job local-3 it waited for ended FAILED" in status.stdout
    assert len(list((tmp_path / "runs" / "two").glob("*/logs"))) == 1  # only job 2's first run ran ranks
