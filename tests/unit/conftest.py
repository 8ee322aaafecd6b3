"""Helpers for the unit tests that start real jobs: tiny specs, `hpcgpu submit --executor local`,
run directories, metrics and the rank processes of a run.

A conftest.py here shadows tests/conftest.py for `from conftest import ...` (pytest imports both as
module `conftest`), so the root conftest's plain names (CONFIGS, GOLDEN, ...) are re-exported below.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml


def _reexport_root_conftest() -> None:
    root = Path(__file__).resolve().parent.parent / "conftest.py"
    if not root.exists():
        return
    spec = importlib.util.spec_from_file_location("_hpcgpu_tests_root_conftest", root)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, value in vars(module).items():
        is_fixture = hasattr(value, "_fixture_function_marker") or hasattr(value, "_pytestfixturefunction")
        if not name.startswith("_") and not is_fixture and name not in globals():
            globals()[name] = value


_reexport_root_conftest()

REPO = Path(__file__).resolve().parent.parent.parent
EVAL_TEXT = REPO / "configs" / "data" / "pydocs-eval.txt"

TINY_GPT2 = {
    "model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 256,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0,
}


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def write_spec_file(folder: Path, spec: dict, filename: str | None = None) -> Path:
    """Write `spec` (runs_dir defaults to <folder>/runs) as YAML; returns its path."""
    spec = {"runs_dir": str(folder / "runs"), **spec}
    path = folder / (filename or f"{spec['name']}.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def train_spec(name: str, **extra: Any) -> dict:
    """A tiny GPT-2 on 2 CPU ranks, global batch 8, micro 2, fp32, one core per rank."""
    base = {
        "name": name,
        "task": "train",
        "resources": {"gpus": 2, "cpus_per_gpu": 1},
        "model": {"config": dict(TINY_GPT2)},
        "data": {"train": str(EVAL_TEXT), "seq_len": 64},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 12, "lr": 3.0e-3,
                  "warmup_steps": 2, "seed": 1, "log_every": 1, "precision": "fp32", "compile": False},
    }
    return merge(base, extra)


def job_env(**extra: str) -> dict[str, str]:
    """The environment a user's shell would give `hpcgpu submit`: no SLURM/torchrun variables, no GPUs."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "HPCGPU_")) and k not in
           ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks, even on a machine with GPUs
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def submit_cmd(spec_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hpcgpu", "submit", str(spec_path), "--executor", "local", *args]


def submit(spec_path: Path, *args: str, timeout: float = 120, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
    return subprocess.run(submit_cmd(spec_path, *args), capture_output=True, text=True, timeout=timeout,
                          env=env or job_env(), cwd=spec_path.parent)


def submit_all(jobs: dict[str, tuple[Path, tuple[str, ...]]], timeout: float = 180
               ) -> dict[str, subprocess.CompletedProcess]:
    """Run several `submit`s at once (the machine has few cores; most of a tiny run is start-up).

    jobs: key -> (spec path, extra args). Output goes to files next to each spec, not pipes.
    """
    procs = {}
    for key, (path, args) in jobs.items():
        out, err = open(path.with_suffix(f".{key}.out"), "w"), open(path.with_suffix(f".{key}.err"), "w")
        proc = subprocess.Popen(submit_cmd(path, *args), stdout=out, stderr=err, text=True, env=job_env(),
                                cwd=path.parent, start_new_session=True)
        procs[key] = (proc, out, err)
    deadline = time.monotonic() + timeout
    results = {}
    try:
        for key, (proc, out, err) in procs.items():
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            out.close()
            err.close()
            results[key] = subprocess.CompletedProcess(proc.args, code, Path(out.name).read_text(),
                                                       Path(err.name).read_text())
    finally:
        for key, (proc, out, err) in procs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                kill_leftovers(str(jobs[key][0].parent))
    return results


def run_dirs(runs: Path, name: str) -> list[Path]:
    return sorted(p for p in (runs / name).glob("*") if p.is_dir())


def only_run_dir(runs: Path, name: str) -> Path:
    dirs = run_dirs(runs, name)
    assert len(dirs) == 1, f"expected one run dir of {name} under {runs}, found {dirs}"
    return dirs[0]


def train_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    assert path.exists(), f"no metrics.jsonl in {run_dir}"
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "train":
            out.append(rec)
    return out


def step_losses(run_dir: Path) -> dict[int, float]:
    """Each logged step's loss, by step."""
    return {r["step"]: r["loss"] for r in train_records(run_dir)}


def rank_processes(marker: str) -> list[psutil.Process]:
    """Live `hpcgpu run` processes whose spec path contains `marker` (a tmp folder of one test)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = proc.info.get("cmdline") or []
        if proc.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        if "hpcgpu" in cmd and "run" in cmd and any(marker in part for part in cmd):
            found.append(proc)
    return found


def wait_for(predicate, timeout: float, interval: float = 0.1):  # type: ignore[no-untyped-def]
    """Poll until predicate() is truthy; returns its value, or None after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def kill_leftovers(marker: str) -> None:
    """Clean-up after a failed test: SIGKILL the rank processes this test started (by pid)."""
    for proc in rank_processes(marker):
        try:
            proc.kill()
        except psutil.Error:
            pass


import pytest  # noqa: E402  (the fixture below is an addition to the helpers above)


@pytest.fixture(autouse=True, scope="session")
def _private_data_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Raw data files the tests train on are prepared into a cache of the tests' own, never the user's
    ~/.cache/hpcgpu/data. XDG_CACHE_HOME (not HPCGPU_DATA_CACHE) because job_env() drops HPCGPU_*."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    os.environ.pop("HPCGPU_DATA_CACHE", None)
