"""`task: command`: the user's own program, one per rank, with the torchrun variables exported."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType
from typing import Callable

from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.monitor import GpuMonitor
from hpcgpu.contract import ENV_CHECKPOINT_DIR, ENV_PENDING_SIGNAL, ENV_RUN_DIR, ENV_SPEC, RunPaths
from hpcgpu.gpu.nvml import gpu_count
from hpcgpu.runtime.diagnostics import print_startup_line
from hpcgpu.runtime.early import early_signal, release_others
from hpcgpu.runtime.env import DistEnv
from hpcgpu.runtime.logsetup import setup_logging
from hpcgpu.procs import child_dies_with_me
from hpcgpu.runtime.preempt import stop_signals
from hpcgpu.runtime.stop import StopNote, stop_job
from hpcgpu.spec import Spec
from hpcgpu.spec.derive import nccl_env


def command_env(spec: Spec, spec_path: Path, paths: RunPaths, env: DistEnv) -> dict[str, str]:
    out = dict(os.environ)
    for key, value in nccl_env(spec).items():
        out.setdefault(key, value)
    out.update(env.torchrun_vars())
    if not ranks_have_gpus(out):
        # accelerate-based scripts (the HF Trainer, run_clm_no_trainer.py) would otherwise train one
        # model per rank on CPU, all writing the same output dir, without a word
        out.setdefault("ACCELERATE_USE_CPU", "true")
    out.update(spec.env)
    threads = str(thread_cap(out, spec, env))
    for name in THREAD_VARS:  # unless the user set them: OpenMP and MKL take every core otherwise
        out.setdefault(name, threads)
    out.pop(ENV_PENDING_SIGNAL, None)  # taken by this wrapper, not the program's business
    out[ENV_SPEC] = str(spec_path)
    out[ENV_RUN_DIR] = str(paths.run_dir)
    # where a preemptible program should write its checkpoints (documented in the README)
    out.setdefault(ENV_CHECKPOINT_DIR, str(paths.checkpoints))
    return out


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def thread_cap(environ: dict[str, str], spec: Spec, env: DistEnv) -> int:
    """A command rank's CPU threads, as hpcgpu's own ranks take them (runtime/dist.py set_cpu_threads):
    the cores srun gives the task (SLURM_CPUS_PER_TASK, else the spec's), at most this node's cores
    shared among its ranks: two local ranks of nanoGPT ran 4-5x slower with torch's every-core default."""
    given = environ.get("SLURM_CPUS_PER_TASK", "")
    cpus = int(given) if given.isdigit() else spec.resources.cpus_per_gpu * spec.gpus_per_task
    share = (os.cpu_count() or 1) // max(1, env.local_world_size)
    return max(1, min(cpus, share))


def ranks_have_gpus(environ: dict[str, str]) -> bool:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return False
    return gpu_count() > 0


def run_command(spec: Spec, spec_path: Path, paths: RunPaths) -> int:
    env = DistEnv.from_environ()
    setup_logging(env)
    print_startup_line(env)
    stops = stop_signals(spec)
    received: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if proc is not None:
            proc.send_signal(signum)  # the program decides how to checkpoint and stop

    previous = {s: signal.signal(s, forward) for s in stops}
    release_others(stops)
    try:
        if early_signal(stops) is not None or received:
            return stop_before_start(spec, env, paths.run_dir)
        proc = start_program(spec, spec_path, paths, env)
        if received:
            proc.send_signal(received[0])  # it came in the instant the program was being started
        # local rank 0 of each node samples the node's GPUs while the program runs, as for train
        with GpuMonitor(paths.run_dir, env.local_rank, spec.monitor.interval_s, node_rank=env.node_rank,
                        enabled=spec.monitor.enabled):
            code = proc.wait()
        if code < 0 and -code in stops and not received:
            wait_for_our_copy(received)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = 128 - code if code < 0 else code  # killed by signal N -> 128+N, as a shell reports it
    if not received:
        return code
    # the program was told to stop (preemption/timeout): rank 0 requeues, capped; a program that
    # checkpointed resumes from HPCGPU_CHECKPOINT_DIR next time
    note = StopNote({}, f"the program exited with code {code} after the stop signal")
    return stop_job(spec, env, paths.run_dir, received[0], note, torn_down_code=code, say=rank0_prints(env))


def start_program(spec: Spec, spec_path: Path, paths: RunPaths, env: DistEnv) -> subprocess.Popen:
    argv = list(spec.command or [])
    try:
        program_env = command_env(spec, spec_path, paths, env)
        # through a shim that dies with this wrapper: no program outlives a killed launcher
        return subprocess.Popen(child_dies_with_me(argv, program_env), env=program_env)
    except FileNotFoundError:
        raise HpcgpuError(f"command: program {argv[0]!r} not found on PATH") from None
    except PermissionError:
        raise HpcgpuError(f"command: program {argv[0]!r} is not executable") from None


def rank0_prints(env: DistEnv) -> Callable[[str], None]:
    """The stop line of the command task: printed among the program's output, once per job, by rank 0
    (the one that knows the reason: it asks the controller)."""
    def say(text: str) -> None:
        if env.is_main:
            print(f"hpcgpu: {text}", flush=True)

    return say


OUR_COPY_WAIT_S = 2.0


def wait_for_our_copy(received: list[int]) -> None:
    """The program died of a stop signal we have not seen: SLURM signals every process of the step
    (preemption, `scontrol requeue`, scancel), and the program may die of its copy before ours
    arrives. Without this wait the exit would read as the program crashing on its own."""
    deadline = time.monotonic() + OUR_COPY_WAIT_S
    while not received and time.monotonic() < deadline:
        time.sleep(0.02)


def stop_before_start(spec: Spec, env: DistEnv, run_dir: Path) -> int:
    """A stop signal came while the rank was starting: nothing ran, so nothing is lost by leaving (and
    nothing failed: no torn-down check)."""
    note = StopNote({}, "the stop signal came before the program started; not starting it")
    return stop_job(spec, env, run_dir, None, note, say=rank0_prints(env))
