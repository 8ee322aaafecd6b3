"""Generated sbatch files run on the real local cluster: environment, nodes, quoting, the example."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

# A task: command that writes what each rank sees to <run dir>/env-<rank>.json
DUMP_ENV = [
    "python3", "-c",
    "import os, json; d = os.environ['HPCGPU_RUN_DIR']; "
    "open(os.path.join(d, 'env-%s.json' % os.environ['RANK']), 'w').write(json.dumps(dict(os.environ)))",
]


def dump_spec(slurm, **more) -> Path:
    doc = {"name": "envdump", "task": "command", "command": DUMP_ENV,
           "resources": {"cpus_per_gpu": 1, "time": "00:05:00"}}
    doc.update(more)
    return slurm.write_spec(doc)


def rank_envs(run_dir: Path) -> dict[int, dict[str, str]]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in run_dir.glob("env-*.json")}


def test_two_gpus_one_node(slurm):
    script, run_dir = slurm.render(dump_spec(slurm), "--gpus", "2")
    job = slurm.sbatch(script)
    info = slurm.wait(job, timeout=120)
    assert info["JobState"] == "COMPLETED", slurm.job_output(run_dir, job)
    envs = rank_envs(run_dir)
    assert sorted(envs) == [0, 1]
    for rank, env in envs.items():
        assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == 2  # each task sees the node's 2 GPUs
        assert env["SLURM_NTASKS"] == "2"
        assert env["RANK"] == env["SLURM_PROCID"] == str(rank)
        assert env["LOCAL_RANK"] == env["SLURM_LOCALID"] == str(rank)
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == info["BatchHost"]  # the node it ran on
        assert env["MASTER_PORT"] == str(10000 + int(job) % 20000)  # from the job id, never 29500
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


def test_a_job_started_with_plain_sbatch_is_known_to_status_logs_and_cancel(slurm):
    """The script's own comment sends the user to `hpcgpu logs JOB --rank 1`: a job the registry lacks
    is looked up in SLURM and adopted when its output lies in an hpcgpu run dir."""
    spec = dump_spec(slurm, command=["python3", "-c", "import os, time; print('hello from', os.environ['RANK'], "
                                     "flush=True); time.sleep(60)"])
    script, run_dir = slurm.render(spec, "--gpus", "2")
    job = slurm.sbatch(script)
    slurm.wait_for(lambda: "hello from 1" in slurm.job_output(run_dir, job), timeout=120, what="rank 1's line")
    view = json.loads(slurm.hpcgpu("status", job, "--json").stdout)
    assert view["state"] == "RUNNING" and view["run_dir"] == str(run_dir), view
    assert slurm.hpcgpu("logs", job, "--rank", "1").stdout.splitlines()[-1] == "hello from 1"
    slurm.hpcgpu("cancel", job)
    assert slurm.wait(job, timeout=120)["JobState"] == "CANCELLED"
    missing = slurm.hpcgpu("status", "999999", check=False)
    assert missing.returncode == 2 and "no job '999999'" in missing.stderr


def test_two_nodes_four_ranks(slurm):
    script, run_dir = slurm.render(dump_spec(slurm), "--gpus", "2", "--nodes", "2")
    job = slurm.sbatch(script)
    info = slurm.wait(job, timeout=120)
    assert info["JobState"] == "COMPLETED", slurm.job_output(run_dir, job)
    envs = rank_envs(run_dir)
    assert sorted(envs) == [0, 1, 2, 3]
    nodes = {rank: env["SLURMD_NODENAME"] for rank, env in envs.items()}
    assert {nodes[0], nodes[1]} == {"n1"} and {nodes[2], nodes[3]} == {"n2"}
    addrs = {env["MASTER_ADDR"] for env in envs.values()}
    assert addrs == {"n1"}  # the first host of n[1-2], the same for every rank
    socket.gethostbyname("n1")  # and it resolves
    assert {env["LOCAL_RANK"] for env in envs.values()} == {"0", "1"}
    assert {env["WORLD_SIZE"] for env in envs.values()} == {"4"}


def test_injected_env_value_is_data_not_code(slurm, tmp_path):
    marker = tmp_path / "PWNED"
    nasty = f"$(touch {marker}); `touch {marker}`; echo 'q' \"dq\"\nline2"
    script, run_dir = slurm.render(dump_spec(slurm, env={"NASTY": nasty}), "--gpus", "1")
    job = slurm.sbatch(script)
    info = slurm.wait(job, timeout=120)
    assert info["JobState"] == "COMPLETED", slurm.job_output(run_dir, job)
    assert not marker.exists(), "a spec value was executed by the job's shell"
    assert rank_envs(run_dir)[0]["NASTY"] == nasty  # arrives byte-exact


def test_injected_name_is_refused_before_anything_runs(slurm, tmp_path):
    spec = slurm.write_spec({"name": f"x$(touch {tmp_path}/PWNED)", "task": "command", "command": ["true"]})
    proc = slurm.hpcgpu("sbatch", str(spec), "-o", str(tmp_path / "x.sbatch"), check=False)
    assert proc.returncode == 2
    assert "name" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.sbatch").exists() and not (tmp_path / "PWNED").exists()


def test_example_config_with_four_gpus_runs_to_completion(slurm, tmp_path):
    """The README's promise: `hpcgpu sbatch configs/<example> --gpus 4 -o job.sbatch; sbatch job.sbatch`."""
    example = slurm.repo / "configs" / "tiny-gpt2.yaml"
    script = tmp_path / "job.sbatch"
    out = slurm.hpcgpu("sbatch", str(example), "--gpus", "4", "-o", str(script),
                       "--set", f"runs_dir={tmp_path / 'runs'}", "--set", "train.max_steps=6",
                       "--set", "train.eval_every=0", "--set", "checkpoint.every_steps=3").stdout
    run_dir = Path(out.split("run dir")[1].split()[0])
    job = slurm.sbatch(script)
    info = slurm.wait(job, timeout=300)
    assert info["JobState"] == "COMPLETED", slurm.job_output(run_dir, job)
    steps = [r["step"] for r in slurm.metrics(run_dir) if r["kind"] == "train"]
    assert steps[-1] == 6
    assert (run_dir / "model" / "config.json").exists()
    assert "4 ranks" in slurm.job_output(run_dir, job)
