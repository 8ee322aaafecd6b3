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


def test_a_command_task_gets_its_gpu_monitored(tmp_path: Path) -> None:
    spec = {"name": "own", "task": "command", "runs_dir": str(tmp_path / "runs"),
            "resources": {"gpus": 1, "cpus_per_gpu": 2}, "monitor": {"interval_s": 0.2},
            "command": [sys.executable, "-c", BUSY]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local", "--new"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "own").iterdir()
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"| GPU 0: {torch.cuda.get_device_name(0)}" in log and "| NCCL " in log
    samples = [json.loads(line) for line in (run_dir / "gpu.jsonl").read_text().splitlines()]
    assert {s["gpu"] for s in samples} == {0} and len(samples) >= 5
    assert max(s["util"] for s in samples) > 50  # the program's matmuls, seen by the wrapper's sampler
    assert "gpu monitor: gpu 0: util mean" in log
