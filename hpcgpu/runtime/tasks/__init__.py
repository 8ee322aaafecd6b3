"""Tasks a job runs: train (built in), command (the user's program), callable (the user's function)."""
from __future__ import annotations

from pathlib import Path

from hpcgpu.errors import HpcgpuError
from hpcgpu.spec import Spec


def run_task(spec: Spec, spec_path: Path) -> int:
    """Run the spec's task in this process (one rank) and return its exit code."""
    if spec.task == "command":
        from hpcgpu.runtime.tasks.command import run_command

        return run_command(spec, spec_path)
    if spec.task == "callable":
        from hpcgpu.runtime.tasks.callable import run_callable

        return run_callable(spec, spec_path)
    if spec.task == "train":
        from hpcgpu.runtime.tasks.train import run_train

        return run_train(spec, spec_path)
    raise HpcgpuError(f"task: {spec.task} is not available yet in this version; use train, command or callable")
