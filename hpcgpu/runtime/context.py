"""The context every task gets: rank, device, spec, run dir, and an agreed stop flag.

`hpcgpu.init()` returns it; the built-in tasks use the same API as the user's own code.
"""
from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpcgpu.contract import ENV_SPEC, RunPaths
from hpcgpu.runtime import dist as _dist
from hpcgpu.runtime.checkpoint import CheckpointManager, CheckpointPolicy, reset_cpu_group
from hpcgpu.runtime.diagnostics import print_startup_line
from hpcgpu.runtime.env import DistEnv, bind_gpu_group
from hpcgpu.runtime.logsetup import setup_logging
from hpcgpu.runtime.preempt import StopFlag, stop_signals
from hpcgpu.spec import Spec, dump_spec, load_spec

if TYPE_CHECKING:
    from hpcgpu.runtime.plan import RunPlan

log = logging.getLogger("hpcgpu")


@dataclass
class Context:
    env: DistEnv
    spec: Spec | None
    run_dir: Path
    device: torch.device
    checkpoint: Any = None  # a checkpoint manager, set by tasks that checkpoint
    plan: RunPlan | None = None  # the task's run plan, set by tasks that make one (train)
    stop_flag: StopFlag = field(default_factory=StopFlag)
    _closed: bool = False

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.is_main

    def should_stop(self) -> bool:
        """True on every rank once any rank got the preemption signal (collective: call on all ranks)."""
        return _dist.any_rank([self.stop_flag.is_set], _dist.coordination_group(self.device))[0]

    def barrier(self) -> None:
        _dist.barrier()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.stop_flag.restore()
            reset_cpu_group()
            _dist.reset_coordination_group()
            # a DDP model the user's code dropped may still hold the gloo group through its reducer:
            # freed by the group's destructor it can deadlock at exit (see run_train); freed here first
            gc.collect()
            _dist.destroy_process_group()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve_spec(spec: Spec | str | os.PathLike | None) -> tuple[Spec | None, Path | None]:
    if isinstance(spec, Spec):
        return spec, None
    path = spec if spec is not None else os.environ.get(ENV_SPEC)
    if not path:
        return None, None
    return load_spec(path), Path(path).resolve()


def init(spec: Spec | str | os.PathLike | None = None, paths: RunPaths | None = None,
         alone_group: bool | None = None) -> Context:
    """Detect the environment, bind the device, start the process group, install the stop flag.

    paths: the run dir `hpcgpu run` decided; user code calling hpcgpu.init() leaves it out.
    alone_group: whether a job of one rank gets a (one-rank) process group, which DeepSpeed needs even
    alone. None: when the spec says distributed.strategy: deepspeed (the user's own code); the train
    task passes False and starts it after its run plan chose DeepSpeed (strategy: auto may)."""
    spec_obj, spec_path = _resolve_spec(spec)
    env = bind_gpu_group(DistEnv.from_environ(gpus_per_task=spec_obj.gpus_per_task if spec_obj else 1))
    setup_logging(env)
    print_startup_line(env)
    device = _dist.select_device(env)
    if alone_group is None:
        alone_group = spec_obj is not None and spec_obj.distributed.strategy == "deepspeed"
    _dist.init_process_group(env, spec_obj, device, alone=alone_group)
    run_dir = (paths or RunPaths.in_job(spec_path)).run_dir
    ctx = Context(env=env, spec=spec_obj, run_dir=run_dir, device=device)
    if spec_obj is not None:
        ctx.checkpoint = make_checkpoint_manager(spec_obj, run_dir, env)
    ctx.stop_flag.install(stop_signals(spec_obj))
    return ctx


def make_checkpoint_manager(spec: Spec, run_dir: Path, env: DistEnv) -> CheckpointManager:
    c = spec.checkpoint
    policy = CheckpointPolicy(every_steps=c.every_steps, every_minutes=c.every_minutes, keep=c.keep,
                              async_save=c.async_)
    return CheckpointManager(RunPaths(run_dir).checkpoints, policy, env.rank, env.world_size, dump_spec(spec))
