"""`container:` on the real cluster: 2-rank jobs over both nodes, submitted with `hpcgpu submit` (the
script body `hpcgpu sbatch` writes), run every rank through `apptainer exec` with the job's environment;
a train job is preempted, requeued and resumed inside the container as without one.

`apptainer` is the stand-in of tests/standin_runtime.py (no container runtime can be installed here):
the nodes run on this host and sbatch passes the submitting shell's environment (its default
--export=ALL), so the stand-in's folder first on PATH is what srun's tasks find.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from resumes import assert_resumed
from standin_runtime import calls, write_standin
from hpcgpu.launch.container import HOST_CODE_DIR

pytestmark = pytest.mark.slurm

DUMP_ENV = ["python3", "-c", "import os, json; d = os.environ['HPCGPU_RUN_DIR']; "
            "open(os.path.join(d, 'env-%s.json' % os.environ['RANK']), 'w').write(json.dumps(dict(os.environ)))"]


def standin_path(slurm) -> tuple[str, Path, Path]:
    """PATH with the stand-in apptainer first and the venv's python as the image's -> (PATH, records, image)."""
    bin_dir, records = write_standin(slurm.tmp)
    image = slurm.tmp / "pt.sif"
    image.write_bytes(b"")
    return os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]), records, image


def submitted(out: str) -> tuple[str, Path]:
    job = re.search(r"^job\s+(\d+)", out, re.M).group(1)  # type: ignore[union-attr]
    return job, Path(re.search(r"^run dir\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]


def test_every_rank_runs_inside_the_container_with_the_contract(slurm):
    path, records, image = standin_path(slurm)
    spec = slurm.write_spec({"name": "ctr", "task": "command", "command": DUMP_ENV,
                             "resources": {"cpus_per_gpu": 1, "time": "00:05:00"},
                             "env": {"NCCL_DEBUG": "WARN"},
                             "container": {"image": str(image), "env": {"IN_IMAGE": "yes"}}})
    out = slurm.hpcgpu("submit", str(spec), "--nodes", "2", "--gpus", "1", env={"PATH": path}).stdout
    job, run_dir = submitted(out)
    info = slurm.wait(job, timeout=120)
    assert info["JobState"] == "COMPLETED", slurm.job_output(run_dir, job)

    got = calls(records)
    assert len(got) == 2  # one `apptainer exec` per rank
    for argv, env in got:
        assert argv[:2] == ["exec", "--nv"]  # the job asks for GPUs
        assert argv[argv.index(str(image)) + 1:] == ["python", "-m", "hpcgpu", "run", str(run_dir / "spec.yaml")]
        assert f"PYTHONPATH={HOST_CODE_DIR}" in argv and "IN_IMAGE=yes" in argv
    assert sorted(env["SLURM_NODEID"] for _, env in got) == ["0", "1"]  # one rank on each node

    envs = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in run_dir.glob("env-*.json")}
    assert sorted(envs) == [0, 1]
    for rank, env in envs.items():
        assert env["APPTAINER_CONTAINER"] == str(image) and env["IN_IMAGE"] == "yes"
        assert env["SLURM_JOB_ID"] == job and env["SLURM_PROCID"] == env["RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["SLURM_NTASKS"] == "2"
        assert env["MASTER_ADDR"] == info["BatchHost"] and env["MASTER_PORT"] == str(10000 + int(job) % 20000)
        assert env["CUDA_VISIBLE_DEVICES"] and env["NCCL_DEBUG"] == "WARN"
        assert env["HPCGPU_RUN_DIR"] == str(run_dir)


def test_a_train_job_is_preempted_and_resumed_inside_the_container(slurm):
    path, records, image = standin_path(slurm)
    doc = slurm.tiny_train(max_steps=8)
    doc["container"] = {"image": str(image)}
    spec = slurm.write_spec(doc)
    # rank 1 gets the stop signal at step 3, as from `scancel --signal`; the ranks stop together at step 4
    out = slurm.hpcgpu("submit", str(spec), "--nodes", "2", "--gpus", "1",
                       env={"PATH": path, "HPCGPU_SIGNAL_AT": "3:1"}).stdout
    job, run_dir = submitted(out)
    info = slurm.wait(job, timeout=240)
    log = slurm.job_output(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log

    got = calls(records)  # every rank of both attempts went through `apptainer exec`
    assert sorted((env.get("SLURM_RESTART_COUNT", "0"), env["SLURM_PROCID"]) for _, env in got) == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    for argv, env in got:
        assert argv[argv.index(str(image)) + 1:] == ["python", "-m", "hpcgpu", "run", str(run_dir / "spec.yaml")]
        assert f"HPCGPU_CONTAINER_IMAGE={image}" in argv
        assert env["SLURM_JOB_ID"] == job and env["HPCGPU_RUN_DIR"] == str(run_dir)
        assert env["MASTER_ADDR"] == info["BatchHost"] and env["CUDA_VISIBLE_DEVICES"]

    (stop,) = [r for r in slurm.metrics(run_dir) if r["kind"] == "stop"]
    assert stop["reason"] == "preempted" and stop["step"] == 4
    assert_resumed(run_dir)
    assert sorted(slurm.loss_log(run_dir)) == list(range(1, 9))
    assert (run_dir / "FINISHED").exists() and "requeued job" in log and "Traceback" not in log
