"""`hpcgpu doctor` on GPUs: every GPU's NVML rows, a matmul TFLOP/s and host->GPU GB/s, and with 2+
GPUs the all-reduce bus bandwidth between them; nothing failed on a healthy machine."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch


def test_doctor_measures_each_gpu_and_the_all_reduce_between_them(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "hpcgpu", "doctor", "--json", "--runs-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout)
    matmul = [r for r in rows if r["check"] == "matmul bf16"]
    assert len(matmul) == torch.cuda.device_count() and all("TFLOP/s" in r["result"] for r in matmul)
    assert all("GB/s" in r["result"] for r in rows if r["check"] == "host -> GPU copy")
    if torch.cuda.device_count() > 1:
        bus = next(r for r in rows if r["check"] == "all-reduce bus bandwidth")
        # over NCCL between the GPUs, not gloo between CPU processes (what it measured where
        # CUDA_VISIBLE_DEVICES was unset, #33's first GPU run)
        assert "GB/s" in bus["result"] and "gloo" not in bus["result"] and "NVLink" in bus["result"], bus
