"""CUDA only: task: infer with one model copy per GPU — bf16 on the card, 2 replicas give the 1-replica
outputs, a stopped run resumes to the same outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")

two_gpus = pytest.mark.two_gpus

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
MODEL = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 128, "n_positions": 128, "vocab_size": 256,
         "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.5}


def run(tmp: Path, name: str, gpus: int, env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    rows = tmp / "prompts.jsonl"
    if not rows.exists():
        rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": " ".join(WORDS[(i * 5 + k) % 12]
                                                                           for k in range(1 + i % 9))}) + "\n"
                                for i in range(64)))
    spec = {"name": name, "task": "infer", "runs_dir": str(tmp / "runs"), "resources": {"gpus": gpus},
            "model": {"config": MODEL}, "infer": {"input": str(rows), "max_new_tokens": 16, "batch_size": 8}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    return proc, next((tmp / "runs" / name).iterdir())


@two_gpus
def test_two_replicas_on_two_gpus_give_the_one_gpu_outputs_and_resume_exactly(tmp_path):
    one, one_dir = run(tmp_path, "one", 1)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    plan = json.loads((one_dir / "plan.json").read_text())
    assert plan["precision"] == "bf16" and plan["infer"]["replicas"] == 1
    two, two_dir = run(tmp_path, "two", 2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert (two_dir / "outputs.jsonl").read_text() == (one_dir / "outputs.jsonl").read_text()
    stopped, dir3 = run(tmp_path, "stopped", 2, env={"HPCGPU_SIGNAL_AT": "2:1"})
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    resumed, again = run(tmp_path, "stopped", 2)
    assert resumed.returncode == 0 and again == dir3, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert (dir3 / "outputs.jsonl").read_text() == (one_dir / "outputs.jsonl").read_text()
