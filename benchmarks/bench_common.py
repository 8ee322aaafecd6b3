"""What the benchmark drivers share (infer_throughput.py, train_vs_loops.py, profile_step.py): the GPUs
as nvidia-smi names them (the parent process never touches CUDA: a process of ours on a GPU would make
hpcgpu's busy check warn about it), median and spread, the rotating order of interleaved rounds, and
the work dir."""
from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator


def nvidia_smi_names() -> list[str] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()] if proc.returncode == 0 else None


def gpu_name(args: argparse.Namespace) -> str:
    if args.cpu:
        return "CPU"
    names = nvidia_smi_names()
    return f"{len(names)} x {names[0]}" if names else "GPU (nvidia-smi not found)"


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def rotated(names: list[str], k: int) -> list[str]:
    k %= max(1, len(names))
    return names[k:] + names[:k]


@contextlib.contextmanager
def work_dir(given: Path | None, prefix: str) -> Iterator[Path]:
    """--work: that dir, made and kept; none given: a temporary dir, removed at the end."""
    if given is not None:
        work = given.resolve()
        work.mkdir(parents=True, exist_ok=True)
        yield work
        return
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
