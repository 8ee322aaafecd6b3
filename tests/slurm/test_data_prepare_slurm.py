"""`hpcgpu data prepare SPEC --submit` on the real local cluster: a CPU job (no GPU asked for) that
tokenizes the spec's data into prepared datasets, through the same submission path and registry."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

TINY = {"config": {"model_type": "gpt2", "vocab_size": 256, "n_layer": 1, "n_embd": 32, "n_head": 2}}


def test_prepare_runs_as_a_cpu_job_and_writes_the_prepared_data(slurm):
    text = slurm.tmp / "train.txt"
    text.write_bytes((slurm.repo / "configs" / "data" / "pydocs.txt").read_bytes()[:50_000])
    spec = slurm.write_spec({"name": "prep", "task": "train", "model": TINY, "resources": {"gpus": 2, "cpus_per_gpu": 1,
                                                                            "time": "00:05:00"},
                             "data": {"train": str(text), "eval": str(slurm.eval_text), "seq_len": 64}})
    out = slurm.tmp / "prepared"
    done = slurm.hpcgpu("data", "prepare", str(spec), "--submit", "-o", str(out)).stdout
    job = re.search(r"^job\s+(\d+)", done, re.M).group(1)  # type: ignore[union-attr]
    run_dir = Path(re.search(r"^run dir\s+(\S+)", done, re.M).group(1))  # type: ignore[union-attr]
    view, _ = slurm.wait_status(job, timeout=180)
    assert view["state"] == "COMPLETED", slurm.job_output(run_dir, job)

    info = slurm.job(job)
    assert "gres" not in info.get("TresPerNode", "") and info["NumTasks"] == "1", info
    assert info["NumCPUs"] == "2", info  # the cores of one of the spec's nodes: 2 GPUs x 1 CPU
    manifest = json.loads((out / "train" / "manifest.json").read_text())
    assert manifest["num_tokens"] == 50_000 and manifest["dtype"] == "uint16"  # bytes as tokens
    assert (out / "eval" / "manifest.json").exists()


def test_submit_needs_a_spec_and_its_data(slurm):
    proc = slurm.hpcgpu("data", "prepare", "--input", "x.txt", "-o", "y", "--submit", check=False)
    assert proc.returncode == 2 and "--submit goes with SPEC" in proc.stderr
    spec = slurm.write_spec({"name": "prep", "model": TINY, "data": {"train": str(slurm.tmp / "missing.txt")}})
    proc = slurm.hpcgpu("data", "prepare", str(spec), "--submit", check=False)
    assert proc.returncode == 2 and "missing.txt" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
