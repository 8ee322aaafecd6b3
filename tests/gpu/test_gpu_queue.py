"""CUDA only: `hpcgpu queue` spreads jobs over the real GPUs of the machine, one job per GPU at a time.

Which GPU each job really used comes from its own gpu.jsonl (NVML indices sampled by the job).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "configs" / "data" / "pydocs.txt"


def job(name: str) -> dict:
    return {"name": name, "task": "train", "resources": {"gpus": 1, "cpus_per_gpu": 2},
            "model": {"config": {"model_type": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 256, "n_positions": 256,
                                 "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}},
            "data": {"train": str(TEXT), "seq_len": 256},
            "train": {"global_batch_size": 16, "micro_batch_size": 8, "max_steps": 150, "log_every": 10,
                      "compile": False},
            "monitor": {"interval_s": 0.2}}


@pytest.mark.two_gpus
def test_queue_runs_one_job_per_gpu_at_a_time(tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"runs_dir": str(tmp_path / "runs"), **job("q")}))
    lines = [f"job.yaml --set name=q{i}" for i in range(3)]
    (tmp_path / "jobs.queue").write_text("\n".join(lines) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "HPCGPU_NVML_RECORDED")}
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "queue", str(tmp_path / "jobs.queue"), "--gpus", "0,1"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    used, spans = {}, {}
    for i in range(3):
        (run_dir,) = (tmp_path / "runs" / f"q{i}").iterdir()
        samples = [json.loads(line) for line in (run_dir / "gpu.jsonl").read_text().splitlines()]
        used[i] = {s["gpu"] for s in samples}
        spans[i] = (samples[0]["time"], samples[-1]["time"])
    assert all(len(g) == 1 and g <= {0, 1} for g in used.values()), used  # each job on exactly one GPU
    overlapping = [(a, b) for a in range(3) for b in range(a + 1, 3)
                   if spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]]
    assert overlapping, spans  # two GPUs, three jobs: two of them ran side by side
    assert all(used[a] != used[b] for a, b in overlapping), (used, overlapping)
    print(f"\nqueue over GPUs 0,1: {used}; side by side: {overlapping}")
