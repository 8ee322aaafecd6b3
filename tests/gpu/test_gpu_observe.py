"""CUDA only: a user's own program (task: command) is observed like the built-in tasks: its start-up
line names the GPU it got, and gpu.jsonl holds that GPU's samples while the program kept it busy."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")

BUSY = ("import torch, time\n"
        "x = torch.randn(4096, 4096, device='cuda')\n"
        "end = time.time() + 3\n"
        "while time.time() < end:\n"
        "    x = (x @ x).tanh()\n"
        "torch.cuda.synchronize()\n")


def run_on_gpu_0(spec: dict, tmp_path: Path) -> Path:
    """`hpcgpu submit --executor local` of `spec` on GPU 0 -> its run dir (the job must succeed)."""
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local", "--new"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / spec["name"]).iterdir()
    return run_dir


def test_a_command_task_gets_its_gpu_monitored(tmp_path: Path) -> None:
    spec = {"name": "own", "task": "command", "runs_dir": str(tmp_path / "runs"),
            "resources": {"gpus": 1, "cpus_per_gpu": 2}, "monitor": {"interval_s": 0.2},
            "command": [sys.executable, "-c", BUSY]}
    run_dir = run_on_gpu_0(spec, tmp_path)
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"| GPU 0: {torch.cuda.get_device_name(0)}" in log and "| NCCL " in log
    samples = [json.loads(line) for line in (run_dir / "gpu.jsonl").read_text().splitlines()]
    assert {s["gpu"] for s in samples} == {0} and len(samples) >= 5
    assert max(s["util"] for s in samples) > 50  # the program's matmuls, seen by the wrapper's sampler
    assert "gpu monitor: gpu 0: util mean" in log


def test_the_trackers_receive_the_gpu_samples_of_a_train_job(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    text = Path(__file__).resolve().parents[2] / "configs" / "data" / "pydocs.txt"
    spec = {"name": "tracked", "task": "train", "runs_dir": str(tmp_path / "runs"),
            "resources": {"gpus": 1, "cpus_per_gpu": 2}, "monitor": {"interval_s": 0.2},
            "model": {"config": {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 256,
                                 "n_positions": 256, "vocab_size": 256}},
            "data": {"train": str(text), "seq_len": 256},
            "train": {"global_batch_size": 16, "max_steps": 40, "log_every": 5, "compile": False},
            "track": {"tensorboard": True}}
    run_dir = run_on_gpu_0(spec, tmp_path)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/loss" in tags and "gpu/0/util" in tags and "gpu/0/mem_used_gib" in tags, tags
    assert max(e.value for e in events.Scalars("gpu/0/mem_used_gib")) > 0
