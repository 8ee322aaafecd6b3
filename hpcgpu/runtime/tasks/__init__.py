"""Tasks a job runs: train (built in), command (the user's program), callable (the user's function)."""
from __future__ import annotations

import os
from pathlib import Path

from hpcgpu.errors import HpcgpuError
from hpcgpu.spec import Spec


def _dispatch(spec: Spec, spec_path: Path) -> int:
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


def run_task(spec: Spec, spec_path: Path) -> int:
    """Run the spec's task in this process (one rank) and return its exit code.

    A crash (an exception, or a command failing on its own) is requeued only when the spec asks for
    retries (slurm.max_retries), at most that often; a stop after a preemption signal is handled by
    the task itself and never counts as a crash.
    """
    from hpcgpu.launch.exitcodes import EXIT_STOPPED
    from hpcgpu.runtime.env import DistEnv
    from hpcgpu.runtime.requeue import requeue_after_crash

    run_dir = Path(os.environ.get("HPCGPU_RUN_DIR") or spec_path.parent)
    try:
        code = _dispatch(spec, spec_path)
    except HpcgpuError:
        raise  # the user's input is wrong: a retry would fail the same way
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            requeue_after_crash(DistEnv.from_environ(), spec, run_dir)
        raise
    if code not in (0, EXIT_STOPPED):
        requeue_after_crash(DistEnv.from_environ(), spec, run_dir)
    return code
