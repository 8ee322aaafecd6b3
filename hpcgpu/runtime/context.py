"""The context every task gets: rank, device, spec, run dir, and an agreed stop flag.

`hpcgpu.init()` returns it; the built-in tasks use the same API as the user's own code. The user's
own training loop also gets the spec's strategy, precision and checkpoints through it:

    model, optimizer = ctx.prepare(model, optimizer, scheduler=None)   # device, DDP/DeepSpeed, SyncBN
    loader = ctx.data_loader(dataset, batch_size=None, shuffle=True)   # this rank's share, resumable
    step = ctx.resume()                     # 0, or the step of the newest checkpoint (everything restored)
    with ctx.autocast(): loss = ...         # bf16/fp16 where train.precision resolves to it
    ctx.backward(loss); ctx.step()          # scaler- and strategy-aware; zero_grad and scheduler included
    ctx.save(step)                          # model, optimizer, scheduler, RNG, loader positions
    if ctx.should_stop(): return ctx.stop(step)   # checkpoint, requeue under SLURM, exit code 75

runtime/training.py (a model in training under its strategy, also under task: train), runtime/loader.py and the
run's lifecycle (runtime/run.py: start, the one stop, close) hold the work; the methods here only
route to them.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sized

import torch

from hpcgpu.contract import ENV_SPEC, RunPaths
from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime import dist as _dist
from hpcgpu.runtime.checkpoint import CheckpointManager, CheckpointPolicy, reset_cpu_group
from hpcgpu.runtime.env import DistEnv, bind_gpu_group
from hpcgpu.runtime.loader import ResumableLoader, cpus_per_rank, merged_options, per_rank_batch, recommended_options
from hpcgpu.runtime.metrics import MetricsWriter
from hpcgpu.runtime.plan import RunPlan, plan_own_loop
from hpcgpu.runtime.strategies import lone_rank_group, strategy_for
from hpcgpu.runtime.training import Training, sync_batchnorm
from hpcgpu.runtime.agree import StopAgreement
from hpcgpu.runtime.run import Run
from hpcgpu.runtime.stop import StopNote
from hpcgpu.runtime.watchdog import beat
from hpcgpu.spec import Spec, dump_spec, load_spec

log = logging.getLogger("hpcgpu")


@dataclass
class Context:
    env: DistEnv
    spec: Spec | None
    run_dir: Path
    device: torch.device
    plan: RunPlan | None = None  # the task's run plan, set by tasks that make one (train)
    training: Training | None = None  # what ctx.prepare set up
    loaders: list[ResumableLoader] = field(default_factory=list)  # every ctx.data_loader: saved by ctx.save
    loader_states: list[dict[str, int]] = field(default_factory=list)  # resumed, for loaders made after resume
    run: Run = None  # type: ignore[assignment]  # its lifecycle and stop (runtime/run.py); made here if not given
    agreement: StopAgreement = field(init=False)  # when every rank stops (runtime/agree.py)

    def __post_init__(self) -> None:
        if self.run is None:
            self.run = Run(self.spec, self.env, self.run_dir)
        self.agreement = StopAgreement(self.run.signals, self.device)

    @property
    def checkpoint(self) -> Any:
        """The checkpoint manager (None without a spec), closed with the run."""
        return self.run.checkpoint

    @checkpoint.setter
    def checkpoint(self, manager: Any) -> None:
        self.run.checkpoint = manager

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
        """True on every rank once any rank got the preemption signal (collective: call on all ranks,
        at the same step; the one agreement, runtime/agree.py)."""
        return self.agreement.now()

    def barrier(self) -> None:
        _dist.barrier()

    # ------------------------------------------------------------ the user's training loop
    def loop_plan(self) -> RunPlan:
        """The run plan of the user's own loop, made once: ctx.prepare and ctx.data_loader read it."""
        if self.plan is None:
            bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
            self.plan = plan_own_loop(self.spec, self.world_size, device_type=self.device.type, bf16_supported=bf16)
        return self.plan

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: Any = None) -> tuple[Any, Any]:
        """The model on this rank's device under the spec's strategy (DDP with distributed.ddp, fsdp,
        DeepSpeed, or bare for one rank: runtime/strategies/), BatchNorm synced per
        distributed.sync_batchnorm, the precision of train.precision; registered for
        ctx.save/ctx.resume. Returns (model, optimizer) to use from now on: the DDP wrapper or DeepSpeed
        engine, and the optimizer (DeepSpeed's wrapper of it)."""
        if self.training is not None:
            raise HpcgpuError("ctx.prepare was called twice; one model and optimizer per job")
        plan = self.loop_plan()
        setting = self.spec.distributed.sync_batchnorm if self.spec is not None else "auto"
        strategy = strategy_for(plan, self.spec, self.device)
        module = strategy.adopt(sync_batchnorm(model, setting, self.device, self.world_size), optimizer, self.env)
        training = Training(self.spec, plan, self.device, module, optimizer, scheduler, strategy=strategy)
        training.wrap()
        log.info(f"ctx.prepare: {training.describe()} on {self.device} x {self.world_size}, {plan.precision}")
        self.training = training
        return training.model, training.user_optimizer

    def _training(self, what: str) -> Training:
        if self.training is None:
            raise HpcgpuError(f"{what} needs ctx.prepare(model, optimizer) first")
        return self.training

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for the forward pass and loss (a no-op in fp32, which CPU ranks use)."""
        return self._training("ctx.autocast").autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() through the fp16 GradScaler or the DeepSpeed engine."""
        self._training("ctx.backward").backward(loss)

    def step(self) -> None:
        """One optimizer step: gradients clipped to train.grad_clip (0: not clipped), the step (through
        the scaler or DeepSpeed's engine), zero_grad, then the scheduler's step."""
        self._training("ctx.step").optimizer_step()

    def data_loader(self, dataset: Sized, batch_size: int | None = None, *, shuffle: bool = True,
                    drop_last: bool = False, seed: int | None = None, **options: Any) -> ResumableLoader:
        """A DataLoader over this rank's share of a seeded per-epoch order (runtime/loader.py), saved
        and resumed mid-epoch by ctx.save/ctx.resume. batch_size: per rank; None: the run plan's batch
        per rank (train.global_batch_size / world). seed: train.seed. Workers, pin_memory,
        prefetch_factor and persistent_workers follow the recommendation for this machine; keyword
        arguments (any DataLoader's) win over it."""
        spec = self.spec
        if batch_size is None:
            batch_size = per_rank_batch(self.loop_plan())
        cpus = cpus_per_rank(spec.resources.cpus_per_gpu if spec else None, self.env.local_world_size)
        loader = ResumableLoader(dataset, batch_size=batch_size, rank=self.rank, world=self.world_size,
                                 seed=(spec.train.seed if spec else 0) if seed is None else seed, shuffle=shuffle,
                                 drop_last=drop_last,
                                 options=merged_options(recommended_options(cpus, self.device.type == "cuda"), options))
        if self.loader_states:  # ctx.resume ran before this loader was made
            loader.load_state_dict(self.loader_states.pop(0))
        self.loaders.append(loader)
        return loader

    def save(self, step: int, *, blocking: bool | None = None) -> None:
        """Collective: a checkpoint at `step` (checkpoint.async: in the background) of the model,
        optimizer, scheduler, every RNG and every ctx.data_loader's position."""
        training = self._training("ctx.save")
        if self.checkpoint is None:
            raise HpcgpuError("ctx.save needs a spec (checkpoints go to <run dir>/checkpoints); run the job "
                              "through hpcgpu or pass hpcgpu.init(spec)")
        state = {"step": step, "prepared": training.rank_state(),
                 "loaders": [loader.state_dict() for loader in self.loaders]}
        training.save(self.checkpoint, step, state, {"restart_count": self.env.restart_count}, blocking=blocking)
        beat()

    def heartbeat(self) -> None:
        """Progress, for the watchdog (distributed.hang_timeout_s), from a loop that has no ctx.step,
        ctx.data_loader batch or ctx.save for long stretches."""
        beat()

    def resume(self) -> int:
        """Collective: restore the newest complete checkpoint; returns its step, or 0 without one."""
        training = self._training("ctx.resume")
        loaded = training.resume(self.checkpoint, self.rank) if self.checkpoint is not None else None
        if loaded is None:
            return 0
        path, state = loaded
        training.load_rank_state(state["prepared"])
        self._restore_loaders(state["loaders"])
        step = int(state["step"])
        self.checkpoint.last_saved_step = step
        self.metrics.write("resume", step=step, checkpoint=path.name, restart_count=self.env.restart_count)
        log.info(f"resuming at step {step} from {path.name}")
        return step

    def _restore_loaders(self, states: list[dict[str, int]]) -> None:
        """Loaders are matched by the order they were made in; those made after ctx.resume take theirs then."""
        for loader, state in zip(self.loaders, states):
            loader.load_state_dict(state)
        self.loader_states = list(states[len(self.loaders):])

    def stop(self, step: int) -> int:
        """After should_stop(): checkpoint at `step`, requeue under SLURM (rank 0, within
        slurm.max_requeues); returns 75, the exit code of a stopped run, for the entry to return. A
        SIGTERM that was srun ending the step after another rank failed is that crash: raised."""
        if self.spec is None:
            raise HpcgpuError("ctx.stop needs a spec (checkpoints, requeue); run the job through hpcgpu")
        note = StopNote({"step": step}, f"stopped at step {step} with a checkpoint")
        return self.run.stop(note, save=lambda: self.save(step, blocking=True))

    @property
    def metrics(self) -> MetricsWriter:
        """<run dir>/metrics.jsonl (rank 0 writes; elsewhere a no-op): `ctx.metrics.write("train",
        step=..., loss=...)` is what `hpcgpu status` and `hpcgpu report` show."""
        return self.run.metrics

    def close(self, finish_saves: bool = True) -> None:
        """The run closed (once: runtime/run.py), then the process group. finish_saves: wait for a
        background checkpoint (collective); not when leaving on an error."""
        if not self.run.closed:
            self.run.close(finish_saves)
            # the DDP wrapper (its reducer holds the process group) goes with the gc.collect() below
            self.training = None
            self.loaders.clear()
            reset_cpu_group()
            _dist.reset_coordination_group()
            # a DDP model the user's code dropped may still hold the gloo group through its reducer:
            # freed by the group's destructor it can deadlock at exit (see run_train); freed here first
            gc.collect()
            _dist.destroy_process_group()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(finish_saves=exc_type is None)


def _resolve_spec(spec: Spec | str | os.PathLike | None) -> tuple[Spec | None, Path | None]:
    if isinstance(spec, Spec):
        return spec, None
    path = spec if spec is not None else os.environ.get(ENV_SPEC)
    if not path:
        return None, None
    return load_spec(path), Path(path).resolve()


def init(spec: Spec | str | os.PathLike | None = None, paths: RunPaths | None = None,
         alone_group: bool | None = None) -> Context:
    """Start the run (runtime/run.py): the environment, the device, the process group, the watchdog,
    the checkpoint manager, the stop signals.

    paths: the run dir `hpcgpu run` decided; user code calling hpcgpu.init() leaves it out.
    alone_group: whether a job of one rank gets a (one-rank) process group, which DeepSpeed and fsdp
    need even alone. None: when the spec's distributed.strategy needs one (the user's own code;
    runtime/strategies/ lone_rank_group); the train task passes False and starts it after its run plan
    chose such a strategy (strategy: auto may)."""
    spec_obj, spec_path = _resolve_spec(spec)
    env = bind_gpu_group(DistEnv.from_environ(gpus_per_task=spec_obj.gpus_per_task if spec_obj else 1,
                                              own_group=spec_obj is not None and spec_obj.own_gpu_group))
    run_dir = (paths or RunPaths.in_job(spec_path)).run_dir
    run = Run.begin(spec_obj, run_dir, env)
    device = _dist.select_device(env)
    if alone_group is None:
        alone_group = spec_obj is not None and lone_rank_group(spec_obj.distributed.strategy)
    _dist.init_process_group(env, spec_obj, device, alone=alone_group, trace_dir=RunPaths(run_dir).nccl_traces)
    _dist.set_cpu_threads(device)
    run.watch()
    if spec_obj is not None:
        run.checkpoint = make_checkpoint_manager(spec_obj, run_dir, env)
    run.catch_signals()
    return Context(env=env, spec=spec_obj, run_dir=run_dir, device=device, run=run)


def make_checkpoint_manager(spec: Spec, run_dir: Path, env: DistEnv) -> CheckpointManager:
    c = spec.checkpoint
    policy = CheckpointPolicy(every_steps=c.every_steps, every_minutes=c.every_minutes, keep=c.keep,
                              async_save=c.async_)
    return CheckpointManager(RunPaths(run_dir).checkpoints, policy, env.rank, env.world_size, dump_spec(spec))
