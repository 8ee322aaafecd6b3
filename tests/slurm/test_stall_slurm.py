"""A rank that stalls under SLURM (rank 1 asleep while rank 0 saves a checkpoint, two nodes): the job
ends FAILED within the job's timeout and its reason names rank 1, its node and where it sat, not
rank 0 that timed out waiting for it."""
from __future__ import annotations

import json
import re
import time

STALLING = """
import time

import torch


def main(ctx):
    model = torch.nn.Linear(4, 4)
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ctx.save(1)
    if ctx.rank == 1:
        time.sleep(3600)
    ctx.save(2)
    return 0
"""


def test_a_stalled_rank_under_slurm_is_the_failure_with_its_node_and_function(slurm):
    (slurm.tmp / "stalling.py").write_text(STALLING)
    spec = slurm.write_spec({"name": "stall", "task": "callable", "entry": "stalling:main",
                             "resources": {"gpus": 1, "nodes": 2, "cpus_per_gpu": 1, "time": "00:05:00"},
                             "distributed": {"nccl": {"timeout_s": 10}}, "env": {"PYTHONPATH": str(slurm.tmp)}},
                            "stall.yaml")
    t0 = time.monotonic()
    done = slurm.hpcgpu("submit", str(spec), "--wait", check=False)
    assert done.returncode not in (0, 75), done.stdout + done.stderr
    assert time.monotonic() - t0 < 10 + 100
    job_id = re.search(r"^job\s+(\d+)", done.stdout, re.M).group(1)
    view = json.loads(slurm.hpcgpu("status", job_id, "--json").stdout)
    failure = view["failure"]
    assert failure["rank"] == 1 and failure["node"] in ("n1", "n2"), view
    assert "made no progress" in failure["message"] and "main at stalling.py:" in failure["message"], view
