"""A rank that stalls under NCCL ends the job FAILED within its timeout, naming the stalled rank and where it
was, not the healthy rank that waited for it (#33). The GPU side of tests/unit/test_stall.py: a
task: callable on 2 GPUs through the local executor, rank 1 asleep (the stall) while rank 0 waits for it
in an NCCL collective (dist.barrier on the default, NCCL, group).

Two orders of the two limits, both a user's choice:
- nccl: the process group's timeout (distributed.nccl.timeout_s) ends the wait first. torch's NCCL
  watchdog times the collective out and the NCCL flight recorder dumps its last collectives into
  <run dir>/nccl-trace/rank_*: where it did, the reason names that folder.
- watchdog: hpcgpu's progress watchdog (distributed.hang_timeout_s) ends it first, as with the defaults
  (a derived hang limit of 5+ minutes, a process-group timeout of 10).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from hpcgpu.contract import RunPaths, first_failure  # noqa: E402  (after the skips: a machine without torch)

REPO = Path(__file__).resolve().parents[2]

STALLING = '''
import time

import torch
import torch.distributed as dist


def main(ctx):
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ctx.prepare(model, optimizer)  # DDP over NCCL
    for _ in range(3):
        ctx.backward(model(torch.ones(4, 16, device=ctx.device)).sum())
        ctx.step()
    if ctx.rank == 1:
        time.sleep(3600)  # stalled, outside any collective
    time.sleep(1)
    ctx.heartbeat()  # rank 0 goes on (its next batch) and then waits for rank 1
    dist.barrier()  # NCCL: rank 1 never comes
    return 0
'''
STALL_LINE = STALLING.splitlines().index("        time.sleep(3600)  # stalled, outside any collective") + 1

# (distributed.nccl.timeout_s, distributed.hang_timeout_s): the smaller one is to end the job, the other
# is far enough out that a job ended by it instead misses the time limit below
LIMITS = {"nccl": (20, 150), "watchdog": (150, 10)}
SLACK_S = 60  # the job ends within this of the limit that ends it, counted from the stall


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCGPU_")) and k not in
           ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    # NVLink multicast stays off (shared machines: benchmarks/gpu_session.sh sets these too)
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}.items():
        env.setdefault(key, value)
    return env


def rank_processes(marker: str) -> list:
    """Live `hpcgpu run` processes whose spec path is under `marker` (this test's tmp folder)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = proc.info.get("cmdline") or []
        if proc.info.get("status") != psutil.STATUS_ZOMBIE and "hpcgpu" in cmd and "run" in cmd \
                and any(marker in part for part in cmd):
            found.append(proc)
    return found


def log_tails(run_dir: Path | None) -> str:
    if run_dir is None:
        return ""
    return "".join(f"\n--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
                   for p in sorted((run_dir / "logs").glob("rank-*.log")))


@pytest.mark.two_gpus
@pytest.mark.parametrize("first", sorted(LIMITS))
def test_a_rank_stalled_under_nccl_is_named_within_the_timeout(tmp_path: Path, first: str) -> None:
    nccl_timeout_s, hang_timeout_s = LIMITS[first]
    limit_s = min(nccl_timeout_s, hang_timeout_s)
    name = f"gpustall-{first}"
    (tmp_path / "stalling.py").write_text(STALLING)
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "task": "callable", "entry": "stalling:main", "runs_dir": str(tmp_path / "runs"),
        "resources": {"gpus": 2, "cpus_per_gpu": 2},
        "distributed": {"nccl": {"timeout_s": nccl_timeout_s}, "hang_timeout_s": hang_timeout_s},
    }, sort_keys=False))
    proc = subprocess.Popen([sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", "--new"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env(),
                            cwd=tmp_path, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(nccl_timeout_s, hang_timeout_s) + 150)  # start-up included
    finally:
        if proc.poll() is None:
            proc.kill()
            out, _ = proc.communicate()
        for leftover in rank_processes(str(tmp_path)):
            leftover.kill()
    ended = time.time()
    print(f"\n[{first}] the job's output, its end:\n" + out[-2500:])
    runs = [p for p in (tmp_path / "runs" / name).glob("*") if p.is_dir()]
    run_dir = runs[0] if len(runs) == 1 else None
    assert run_dir is not None, (runs, out[-3000:])
    assert proc.returncode not in (0, 75), out[-3000:]  # a failure, not a finish or a preemption
    assert not rank_processes(str(tmp_path)), "a rank outlived the job"

    # the stalled rank is the failure, with where it stalled; rank 0, which waited for it, is not
    failure = first_failure(run_dir)
    print(f"[{first}] failure: {failure}")
    assert failure is not None, out[-3000:] + log_tails(run_dir)
    assert failure.rank == 1, (failure, log_tails(run_dir))
    assert "made no progress" in failure.message, failure
    assert f"main at stalling.py:{STALL_LINE}" in failure.message, failure
    # failure.time is rank 1's last progress: the stall began then
    took = ended - failure.time
    print(f"[{first}] the job ended {took:.0f} s after the stall (limit {limit_s} s)")
    assert took < limit_s + SLACK_S, (took, limit_s)

    dumps = sorted(p.name for p in RunPaths(run_dir).nccl_traces.glob("rank_*"))
    print(f"[{first}] NCCL flight recorder dumps: {dumps}")
    if first == "nccl":
        assert "rank 0 timed out waiting" in failure.message, failure
    if dumps:  # where NCCL's flight recorder dumped, the reason says where
        assert f"NCCL flight recorder dumps in {RunPaths(run_dir).nccl_traces}" in failure.message, failure

    listed = json.loads(subprocess.run([sys.executable, "-m", "hpcgpu", "list", "--json"], capture_output=True,
                                       text=True, timeout=60, env=job_env(), check=True).stdout)
    job = next(j for j in listed if j["name"] == name)
    print(f"[{first}] hpcgpu list: {job['state']}: {job.get('reason')}")
    assert job["state"] == "FAILED" and job["failure"]["rank"] == 1, job
    assert "made no progress" in job["failure"]["message"], job
