"""pytorch/examples' DDP tutorial `multinode.py` (tests/unit/fixtures/frameworks/multinode: the fetched
script, commit pinned, with its CPU patch stated in its header) as `task: command` through
`hpcgpu submit` on the real cluster, 1 node x 2 tasks: one distributed job of 2 (issue 34).

The same two proofs as tests/unit/test_frameworks_scripts.py: the script's own lines (a
DistributedSampler over a group of 2 halves its steps), and that file's observer (a sitecustomize.py
the program never sees) all-gathering each rank's RANK/WORLD_SIZE/group view and its DDP weights.
"""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "unit" / "fixtures" / "frameworks" / "multinode"
UNIT_TEST = REPO / "tests" / "unit" / "test_frameworks_scripts.py"
EPOCHS, BATCH = 2, 64


def observer_source() -> str:
    """OBSERVER of the unit test module, read without importing it (its `from conftest import` is
    tests/unit's conftest, not this folder's)."""
    for node in ast.parse(UNIT_TEST.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "OBSERVER":
            return ast.literal_eval(node.value)
    raise AssertionError(f"no OBSERVER in {UNIT_TEST}")


def test_ddp_tutorial_multinode_runs_as_one_job_on_one_node_two_tasks(slurm):
    folder = slurm.tmp / "project"  # the user's folder: the job starts where `hpcgpu submit` ran
    folder.mkdir()
    for path in FIXTURE.glob("*.py"):
        shutil.copy(path, folder / path.name)
    (folder / "observer").mkdir()
    (folder / "observer" / "sitecustomize.py").write_text(observer_source())
    spec = slurm.write_spec({
        "name": "multinode", "task": "command",
        "command": [sys.executable, "multinode.py", str(EPOCHS), "1", f"--batch_size={BATCH}"],
        "resources": {"nodes": 1, "gpus": 2, "cpus_per_gpu": 1, "time": "00:05:00"},
        "env": {"PYTHONPATH": str(folder / "observer"), "FRAMEWORK_OBSERVE_OUT": str(folder)},
    }, "multinode.yaml")
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(spec)], capture_output=True, text=True,
                          timeout=120, cwd=folder, env=slurm.env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"^job\s+(\d+)", proc.stdout, re.M).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"^run dir\s+(\S+)", proc.stdout, re.M).group(1))  # type: ignore[union-attr]

    view, _ = slurm.wait_status(job, timeout=180)
    out = slurm.job_output(run_dir, job)
    assert view["state"] == "COMPLETED" and view["exit_code"] == 0, out
    assert view["nodes"] == "n1", view
    # srun's label is the task, [GPU<RANK>] the script's: each task its own RANK, and the sampler over
    # the group gave each 2048 / 2 samples
    lines = re.findall(rf"^\s*(\d+): \[GPU(\d+)\] Epoch (\d+) \| Batchsize: {BATCH} \| Steps: (\d+)$", out, re.M)
    steps = str(2048 // 2 // BATCH)
    assert sorted(lines) == sorted((str(r), str(r), str(e), steps) for r in range(2) for e in range(EPOCHS)), out
    assert (folder / "snapshot.pt").exists()  # written by rank 0 in the folder the job started in

    seen = {rank: json.loads((folder / f"observed-{rank}.json").read_text()) for rank in range(2)}
    for rank, got in seen.items():
        me = got["me"]
        assert (me["env_rank"], me["rank"], me["env_world_size"], me["world_size"], me["ddp_models"]) == (
            rank, rank, 2, 2, 1), me
        assert got["group"] == [seen[0]["me"], seen[1]["me"]], got  # one group: both ranks in each all-gather
    assert seen[0]["me"]["weights"] == seen[1]["me"]["weights"]  # DDP averaged what each rank learned
