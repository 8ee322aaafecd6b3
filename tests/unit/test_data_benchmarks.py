"""The prepared-data benchmarks (issue #16) still run: each script with --smoke (tiny inputs in a
temporary dir) prints its table and verdict. The numbers are not checked here (benchmarks/RESULTS.md)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO


def smoke(script: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--smoke"], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_data_scaling_smoke() -> None:
    out = smoke("data_scaling.py")
    assert "| size | tokens | raw: time to first batch | raw: peak RSS | prepared: time to first batch" in out
    assert "| 150K |" in out and "| 300K |" in out
    assert "| size | prepare (once): wall |" in out
    assert "verdict: prepared rank from 150K to 300K" in out


def test_prepare_throughput_smoke() -> None:
    pytest.importorskip("datasets")
    out = smoke("prepare_throughput.py")
    assert "| workers | hpcgpu s | hpcgpu tokens/s | datasets s (load + map)" in out
    assert "\n| 1 | " in out
    assert "verdict: 1 worker(s): hpcgpu/datasets throughput" in out
