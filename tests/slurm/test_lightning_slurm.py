"""Lightning scripts, unchanged, as `task: command` jobs on the real cluster: one distributed job of the
allocation's shape (an unchanged `Trainer()` takes it from PL_TRAINER_*), and a preempted run that
resumes from Lightning's own requeue checkpoint, at the step it saved, with one requeue."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

FIXTURES = Path(__file__).resolve().parents[1] / "unit" / "fixtures" / "frameworks" / "lightning"


def sbatch_in(folder: Path, script: Path) -> str:
    proc = subprocess.run(["sbatch", "--parsable", f"--chdir={folder}", str(script)], capture_output=True,
                          text=True, timeout=30, check=True)
    return proc.stdout.strip().split(";")[0]


def lightning_spec(name: str, script: str, out: Path, nodes: int, **more: object) -> dict:
    return {"name": name, "task": "command", "command": [sys.executable, str(FIXTURES / script)],
            "resources": {"nodes": nodes, "gpus": 2 // nodes, "cpus_per_gpu": 1, "time": "00:05:00"},
            "env": {"OUT": str(out), "PYTHONPATH": str(FIXTURES)}, **more}


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_bug_report_model_runs_as_one_job_of_the_allocation(slurm, nodes: int) -> None:
    spec = slurm.write_spec(lightning_spec(f"plbug{nodes}", "bug_report_model.py", slurm.tmp, nodes))
    script, run_dir = slurm.render(spec)
    job = sbatch_in(slurm.tmp, script)  # the script writes lightning_logs/ into its working directory
    info = slurm.wait(job, timeout=180)
    out = slurm.job_output(run_dir, job)
    assert info["JobState"] == "COMPLETED", out
    # Lightning's own words, one per rank: both joined one group of 2, over `nodes` nodes
    assert "0: Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in out, out
    assert "1: Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out, out
    assert "did not form one job" not in out


def test_a_preempted_lightning_job_resumes_from_its_checkpoint_with_one_requeue(slurm) -> None:
    """slurm.signal USR1 (Lightning's requeue signal): its handler runs once, saves hpc_ckpt_1.ckpt in
    the run dir and requeues the job; hpcgpu reports the requeue (not a failure) and requeues nothing
    itself; the next run loads hpc_ckpt_1.ckpt, starts at the step it saved, and completes.

    One rank: Lightning's handler saves behind a barrier, and with two ranks a signal that finds one of
    them inside the gradient all-reduce hangs both (its own race, docs/frameworks.md); alone, a rank has
    no all-reduce and no barrier partner, so the drill never meets the race. Forming one group of two
    ranks is the bug-report test's above."""
    doc = lightning_spec("plpre", "preemptible.py", slurm.tmp, 1, slurm={"signal": "B:USR1@60"})
    doc["resources"]["gpus"] = 1
    doc["env"].update(EPOCHS="2", STEP_S="0.2")  # 64 steps: 2 epochs of 64 rows, batch 2
    script, run_dir = slurm.render(slurm.write_spec(doc))
    job = sbatch_in(slurm.tmp, script)
    steps_done = slurm.tmp / "rank0-step"  # written by the script's step callback
    slurm.wait_for(lambda: steps_done.exists() and int(steps_done.read_text() or 0) >= 5, timeout=120,
                   what="5 steps (Lightning's handler set)")
    assert "SLURM auto-requeueing enabled" in slurm.job_output(run_dir, job)
    # what SLURM does at B:USR1@60: the batch script alone is signalled; srun relays it to the step
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    info = slurm.wait(job, timeout=240, states={"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    out = slurm.job_output(run_dir, job)
    assert "the program is still running" not in out, f"Lightning's handler hung, hpcgpu ended it:\n{out}"
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    assert slurm.status(job)["state"] == "COMPLETED"
    # Lightning handled the signal once, saved its hpc checkpoint and requeued the job itself
    assert out.count("Handling auto-requeue signal") == 1, out
    assert [p.name for p in run_dir.glob("hpc_ckpt_*.ckpt")] == ["hpc_ckpt_1.ckpt"], out
    assert "requeued from outside" in out and "requeued job" not in out, out
    assert not list(slurm.tmp.glob("rank*-run0.json")), "the first run was to be stopped before its end"
    # the requeued run loaded that checkpoint and started at the step it saved
    hpc_ckpt = (run_dir / "hpc_ckpt_1.ckpt").resolve()
    saved = torch_load(hpc_ckpt)["global_step"]
    (again,) = [json.loads(p.read_text()) for p in slurm.tmp.glob("rank*-run1.json")]
    assert again["ckpt_path"] and Path(again["ckpt_path"]).resolve() == hpc_ckpt, (again, out)
    assert 5 <= saved == again["start_step"] < again["end_step"] == 64, (saved, again)
    restored = [x for x in out.splitlines() if "Restoring states from the checkpoint path at" in x]
    assert len(restored) == 1 and restored[0].endswith("hpc_ckpt_1.ckpt"), out  # Lightning's own line


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)
