"""`task: command`: the user's own program, one per rank, with the torchrun variables exported."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from types import FrameType

from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime.env import DistEnv
from hpcgpu.launch.exitcodes import EXIT_STOPPED
from hpcgpu.runtime.preempt import stop_signals
from hpcgpu.runtime.requeue import requeue, stop_reason
from hpcgpu.spec import Spec
from hpcgpu.spec.derive import nccl_env


def command_env(spec: Spec, spec_path: Path, env: DistEnv) -> dict[str, str]:
    out = dict(os.environ)
    for key, value in nccl_env(spec).items():
        out.setdefault(key, value)
    out.update(env.torchrun_vars())
    out.update(spec.env)
    out["HPCGPU_SPEC"] = str(spec_path)
    out.setdefault("HPCGPU_RUN_DIR", str(spec_path.parent))
    # where a preemptible program should write its checkpoints (documented in the README)
    out.setdefault("HPCGPU_CHECKPOINT_DIR", str(Path(out["HPCGPU_RUN_DIR"]) / "checkpoints"))
    return out


def run_command(spec: Spec, spec_path: Path) -> int:
    env = DistEnv.from_environ()
    argv = list(spec.command or [])
    try:
        proc = subprocess.Popen(argv, env=command_env(spec, spec_path, env))
    except FileNotFoundError:
        raise HpcgpuError(f"command: program {argv[0]!r} not found on PATH") from None
    except PermissionError:
        raise HpcgpuError(f"command: program {argv[0]!r} is not executable") from None

    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        proc.send_signal(signum)  # the program decides how to checkpoint and stop

    previous = {s: signal.signal(s, forward) for s in stop_signals(spec)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = 128 - code if code < 0 else code  # killed by signal N -> 128+N, as a shell reports it
    if received:
        # the program was told to stop (preemption/timeout): rank 0 requeues, capped, then its code
        # passes through; a program that checkpointed resumes from HPCGPU_CHECKPOINT_DIR next time
        reason = stop_reason(spec, env)
        print(f"hpcgpu: {reason}: the program exited with code {code} after the stop signal", flush=True)
        requeue(env, spec, reason)
        return EXIT_STOPPED
    return code
