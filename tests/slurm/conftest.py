"""Fixtures for tests against the real local SLURM cluster (tests/slurm/cluster.sh).

The cluster is started here if it is not up (and stopped again at the end if this session started
it), so `pytest tests/slurm` works on its own; scripts/test.sh starts it once for the whole suite.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpcgpu.report.run import read_jsonl

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"
EVAL_TEXT = REPO / "configs" / "data" / "pydocs-eval.txt"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


def cluster_up() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(state in out.stdout for state in ("idle", "mix", "alloc"))


@pytest.fixture(scope="session")
def cluster() -> Any:
    started = False
    if not cluster_up():
        subprocess.run(["bash", str(CLUSTER), "start"], check=True, timeout=600)
        started = True
    yield
    if started:
        subprocess.run(["bash", str(CLUSTER), "stop"], timeout=120)


class Slurm:
    """Small helpers over the real scheduler commands (tests reach them through the `slurm` fixture)."""

    metrics = staticmethod(lambda run_dir: _metrics(run_dir))
    loss_log = staticmethod(lambda run_dir: _loss_log(run_dir))
    job_output = staticmethod(lambda run_dir, job_id: _job_output(run_dir, job_id))
    tiny_train = staticmethod(lambda max_steps=40, **train: _tiny_train(max_steps, **train))
    eval_text = EVAL_TEXT
    repo = REPO

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.registry = tmp / "jobs.db"  # each test its own job registry

    def env(self, **more: str) -> dict[str, str]:
        return {**os.environ, "HPCGPU_REGISTRY": str(self.registry), **more}

    def hpcgpu(self, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "hpcgpu", *args], capture_output=True, text=True,
                              timeout=120, env=self.env(**(env or {})))
        if check and proc.returncode != 0:
            raise AssertionError(f"hpcgpu {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def write_spec(self, doc: dict, name: str = "spec.yaml") -> Path:
        doc = dict(doc)
        doc.setdefault("runs_dir", str(self.tmp / "runs"))
        path = self.tmp / name
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def render(self, spec: Path, *args: str) -> tuple[Path, Path]:
        """hpcgpu sbatch -> (script, run dir)."""
        script = self.tmp / f"{spec.stem}.sbatch"
        out = self.hpcgpu("sbatch", str(spec), "-o", str(script), *args).stdout
        run_dir = Path(re.search(r"run dir\s+(\S+)", out).group(1))  # type: ignore[union-attr]
        return script, run_dir

    def sbatch(self, script: Path) -> str:
        proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             timeout=30).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float = 240, states: set[str] = TERMINAL) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        subprocess.run(["scancel", job_id])
        raise AssertionError(f"job {job_id} did not reach {states} in {timeout}s: {info}")

    def submit(self, spec: Path, *args: str) -> tuple[str, Path, float]:
        """hpcgpu submit (to this cluster) -> (job id, run dir, seconds it took to return)."""
        t0 = time.perf_counter()
        out = self.hpcgpu("submit", str(spec), *args).stdout
        seconds = time.perf_counter() - t0
        job_id = re.search(r"^job\s+(\d+)", out, re.M).group(1)  # type: ignore[union-attr]
        run_dir = Path(re.search(r"^run dir\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
        return job_id, run_dir, seconds

    def status(self, job: str) -> dict[str, Any]:
        return json.loads(self.hpcgpu("status", job, "--json").stdout)

    def wait_status(self, job: str, timeout: float = 240, states: set[str] = TERMINAL) -> tuple[dict, list[str]]:
        """Poll `hpcgpu status JOB --json` until its state is in `states` -> (last view, states seen)."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        view: dict[str, Any] = {}
        while time.monotonic() < deadline:
            view = self.status(job)
            if not seen or seen[-1] != view["state"]:
                seen.append(view["state"])
            if view["state"] in states:
                return view, seen
            time.sleep(0.5)
        subprocess.run(["scancel", job.split("_")[0]])
        raise AssertionError(f"job {job} did not reach {states} in {timeout}s: {view}")

    def wait_for(self, predicate: Any, timeout: float = 120, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def _loss_log(run_dir: Path) -> dict[int, float]:
    """step -> loss, the last record of each step winning (a resumed run may log a step twice)."""
    return {r["step"]: r["loss"] for r in _metrics(run_dir) if r["kind"] == "train"}


def _job_output(run_dir: Path, job_id: str) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob(f"slurm-{job_id}.*")))


@pytest.fixture
def slurm(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Slurm:
    # run dirs must be readable by the job on every "node": one host, so any local path works
    return Slurm(tmp_path_factory.mktemp("slurm"))


def _tiny_train(max_steps: int = 40, **train: Any) -> dict:
    return {
        "name": "tiny",
        "task": "train",
        "resources": {"gpus": 2, "cpus_per_gpu": 1, "time": "00:10:00"},
        "model": {"config": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32,
                             "n_positions": 64, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}},
        "data": {"train": str(EVAL_TEXT), "seq_len": 64},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": max_steps, "lr": 1e-3,
                  "warmup_steps": 2, "log_every": 1, **train},
    }
