"""One start-up line per rank, the same for every task: where the rank runs and what it sees.

    12:00:01 [rank 1] rank 1/4 (local 1) on gpu07 | CUDA_VISIBLE_DEVICES=0,1 | GPU 1: NVIDIA H100 80GB HBM3,
        79.6 GiB | torch 2.11.0+cu130 | NCCL 2.27.5

torch-free (the command task's wrapper prints it too): versions come from the installed packages'
metadata, GPUs from NVML. When a job hangs or is slow, this is the line that shows a rank bound to the
wrong GPU or a node with another torch.
"""
from __future__ import annotations

import os
import re
import sys
import time
from importlib import metadata

from hpcgpu.contract import node_name
from hpcgpu.gpu.busy import select
from hpcgpu.gpu.source import default_source
from hpcgpu.runtime.env import DistEnv

GiB = 1024 ** 3


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def nccl_version() -> str:
    """The NCCL torch loads: the nvidia-nccl-cuXX wheel pip's torch depends on; n/a without one."""
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if re.fullmatch(r"nvidia-nccl-cu\d+", name):
            return dist.version
    return "n/a"


def visible_gpus() -> str:
    """'GPU 1: NVIDIA H100 80GB HBM3, 79.6 GiB; ...' for the GPUs this rank can use, 'none' or 'no NVML'."""
    try:
        source = default_source()
        if not source.available():
            return "no NVML (no NVIDIA driver or GPU)"
        chosen, _ = select(source.read(processes=False), None, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except Exception as exc:  # a diagnostic line must never stop the job
        return f"not read ({type(exc).__name__}: {exc})"
    if not chosen:
        return "none"
    return "; ".join(f"GPU {r.index}: {r.name}, {r.memory_total / GiB:.1f} GiB" for r in chosen)


def startup_line(env: DistEnv) -> str:
    host = node_name()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"rank {env.rank}/{env.world_size} (local {env.local_rank}) on {host} | "
            f"CUDA_VISIBLE_DEVICES={visible if visible is not None else '(unset)'} | {visible_gpus()} | "
            f"torch {package_version('torch') or 'not installed'} | NCCL {nccl_version()}")


def print_startup_line(env: DistEnv) -> None:
    """Every rank prints its own (the logger shows INFO from rank 0 only)."""
    prefix = f"[rank {env.rank}] " if env.world_size > 1 else ""
    print(f"{time.strftime('%H:%M:%S')} {prefix}{startup_line(env)}", file=sys.stdout, flush=True)
