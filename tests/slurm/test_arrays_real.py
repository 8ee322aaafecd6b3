"""A sweep larger than the cluster's MaxArraySize, on the real cluster (tests/slurm/cluster.sh sets
MaxArraySize=4: array indices 0-3): `hpcgpu submit` splits it into several arrays over one task index,
and every task runs its own point and completes."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from joblog import program_lines

pytestmark = pytest.mark.slurm

PRINT_SEED = ("import os, re; d = os.environ['HPCGPU_RUN_DIR']; "
              "print('value', re.search(r'seed: (\\d+)', open(os.path.join(d, 'spec.yaml')).read()).group(1))")


def max_array_size() -> int:
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    return int(re.search(r"^MaxArraySize\s*=\s*(\d+)", config, re.M).group(1))  # type: ignore[union-attr]


def test_a_sweep_larger_than_max_array_size_is_split_and_every_task_runs(slurm):
    assert max_array_size() == 4, "an older cluster: `bash tests/slurm/cluster.sh start` brings its config up to date"
    seeds = [10, 11, 12, 13, 14]  # 5 points: an array of 4 (indices 0-3) and one of 1
    spec = slurm.write_spec({"name": "split", "task": "command", "command": [sys.executable, "-c", PRINT_SEED],
                             "resources": {"gpus": 1, "cpus_per_gpu": 1, "time": "00:05:00"}}, "split.yaml")
    out = slurm.hpcgpu("submit", str(spec), "--sweep", "train.seed=" + ",".join(map(str, seeds))).stdout
    arrays = re.findall(r"^job\s+(\d+) \(array of (\d+) tasks\)", out, re.M)
    assert [int(n) for _, n in arrays] == [4, 1], out
    (first, _), (second, _) = arrays
    # SLURM holds them as two arrays of the sizes asked for
    assert slurm.job(f"{first}_3").get("ArrayTaskId") == "3" and slurm.job(f"{second}_0").get("ArrayTaskId") == "0"

    tasks = []
    for job in (first, second):
        view, _ = slurm.wait_status(job, timeout=120)
        assert view["state"] == "COMPLETED", view
        tasks += view["tasks"]
    assert [t["id"] for t in tasks] == [f"{first}_{i}" for i in range(4)] + [f"{second}_0"]
    assert [t["state"] for t in tasks] == ["COMPLETED"] * 5
    run_dirs = [Path(t["run_dir"]) for t in tasks]
    assert [d.name for d in run_dirs] == ["0", "1", "2", "3", "4"] and len({d.parent for d in run_dirs}) == 1
    # one task index for both arrays: the second array's task 0 is the sweep's point 4
    index = (run_dirs[0].parent / "tasks.txt").read_text().splitlines()
    assert index == [str(d / "spec.yaml") for d in run_dirs]
    for task, run_dir, seed in zip(tasks, run_dirs, seeds):
        assert task["values"] == {"train.seed": seed}
        assert program_lines(slurm.hpcgpu("logs", task["id"]).stdout) == [f"0: value {seed}"], task  # its own point
        assert (run_dir / f"slurm-{task['id']}.out").exists()
