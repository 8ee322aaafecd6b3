"""`hpcgpu doctor --submit`: the checks as a SLURM job over the nodes of an allocation (the local
cluster's two nodes, GPUs without NVML: each node says so), one table back, the all-reduce between
the ranks of both nodes measured."""
from __future__ import annotations

import json


def test_doctor_as_a_job_over_two_nodes_reports_each_node_and_the_all_reduce(slurm):
    done = slurm.hpcgpu("doctor", "--submit", "--nodes", "2", "--gpus", "1", "--quick", "--json",
                        "--runs-dir", str(slurm.tmp / "runs"), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout)
    nodes = {r["where"] for r in rows if r["check"] == "GPUs"}
    assert nodes == {"n1", "n2"} and all("no NVIDIA driver" in r["result"] for r in rows if r["check"] == "GPUs")
    assert {r["where"].split()[0] for r in rows if r["check"] == "runs_dir write speed"} == {"n1", "n2"}
    bus = next(r for r in rows if r["check"] == "all-reduce bus bandwidth")
    assert bus["where"] == "2 ranks" and "GB/s" in bus["result"] and bus["status"] == "ok"
    assert any(r["check"] == "rendezvous" for r in rows)
    assert "COMPLETED" in done.stderr
