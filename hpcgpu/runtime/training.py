"""One model in training: its strategy, precision, optimizer step and checkpointed state. `task: train`
(the Trainer) and `ctx.prepare` (the user's own loop) both hold one.

- strategy: the plan's, as an object (runtime/strategies/: none, ddp, fsdp, deepspeed), asked for
  everything that differs between them: the wrap, backward, step, the model and optimizer payload.
- precision: the plan's (bf16/fp16 autocast, fp32 none) and the GradScaler of fp16 (runtime/precision.py),
  as the strategy runs them.
- step: backward, then clip to train.grad_clip, optimizer step, scaler update, zero_grad and the
  scheduler's step (`optimizer_step`); accumulation is the caller's loop, which knows its micro batches.
- state: the strategy's payload (the model and optimizer), the scheduler and scaler, every RNG, through
  the CheckpointManager's step-N layout; the caller adds its own (step, data position) to the rank
  state under its own key.

Nothing here decides what the plan decided: strategy, precision and batch are read from the RunPlan;
the spec gives only what the plan does not hold (grad_clip, sync_batchnorm, the strategy's options).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hpcgpu.contract import complete_checkpoints
from hpcgpu.runtime import watchdog
from hpcgpu.runtime.checkpoint import CheckpointManager, Payload
from hpcgpu.runtime.plan import RunPlan
from hpcgpu.runtime.precision import Precision
from hpcgpu.runtime.rng import rng_state, set_rng_state
from hpcgpu.runtime.strategies.base import Strategy
from hpcgpu.runtime.watchdog import beat
from hpcgpu.spec import Spec

log = logging.getLogger("hpcgpu")

CPU_SYNC_BN = ("sync_batchnorm: CPU ranks keep plain BatchNorm (torch's SyncBatchNorm runs on GPUs only); "
               "each rank normalizes with its own batch's statistics")


def has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in model.modules())


def sync_batchnorm(model: torch.nn.Module, setting: bool | str, device: torch.device,
                   world: int) -> torch.nn.Module:
    """SyncBatchNorm where distributed.sync_batchnorm asks (auto: BatchNorm layers and several ranks)
    and the ranks are GPUs; on CPU ranks the model is kept and one line says so. The converted
    layers share the original parameters, so an optimizer made before stays valid."""
    if setting is False or world < 2 or not has_batchnorm(model):
        return model  # nothing to synchronize
    if device.type != "cuda":
        log.info(CPU_SYNC_BN)
        return model
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


class Training:
    """One model, its optimizer and scheduler under the plan's strategy and precision.

    module: the model as built (what is saved); model: what is called (DDP, the DeepSpeed engine, or
    the module or what the caller put around it). own_loop: hpcgpu's train loop drives it (the
    strategy may then take shortcuts the user's code might not allow)."""

    def __init__(self, spec: Spec | None, plan: RunPlan, device: torch.device, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any = None, *, strategy: Strategy,
                 own_loop: bool = False):
        self.spec, self.plan, self.device, self.strategy = spec, plan, device, strategy
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.grad_clip = spec.train.grad_clip if spec is not None else 0.0
        self.params = [p for p in module.parameters() if p.requires_grad]  # once: parameters() walks every module
        strategy.bind(module, optimizer, scheduler, own_loop)
        self.precision = Precision.of(plan, device)
        self.amp = strategy.loop_precision(self.precision)
        self.scaler = strategy.scaler(self.precision)
        self.model: Any = module

    def wrap(self, around: torch.nn.Module | None = None) -> Any:
        """Put the plan's strategy around the module (or `around`: the module inside the caller's
        wrappers, e.g. compiled); the result is `model`, what the loop calls."""
        self.model = self.strategy.wrap(self.module if around is None else around)
        return self.model

    @property
    def user_optimizer(self) -> Any:
        """The optimizer to hold: DeepSpeed's wrapper of it under DeepSpeed."""
        return self.strategy.user_optimizer()

    def describe(self) -> str:
        return self.strategy.describe()

    # -- one step
    def autocast(self) -> contextlib.AbstractContextManager:
        return self.amp.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        self.strategy.backward(loss, self.scaler)

    def optimizer_step(self) -> None:
        """Clip, step, update the scale, zero the gradients, step the scheduler (DeepSpeed's engine
        does all of it, at its accumulation boundary)."""
        beat()
        self.strategy.step(self.scaler, self.params, self.grad_clip)

    # -- checkpoint state
    def payload(self) -> Payload | dict[str, Any]:
        """The model and optimizer for the CheckpointManager (collective)."""
        return self.strategy.payload()

    def load_model(self, payload: Payload | dict[str, Any]) -> None:
        """Only the weights of a loaded payload (the best model at the end of a run)."""
        self.strategy.load_model(payload)

    def rank_state(self) -> dict[str, Any]:
        """The scheduler and scaler, for the caller's rank state (keys as checkpoints always held)."""
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": self.scaler.state_dict()}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):  # a disabled scaler saves {}
            self.scaler.load_state_dict(state["scaler"])

    def save(self, ckpt: CheckpointManager, step: int, state: dict[str, Any], meta: dict[str, Any],
             blocking: bool | None = None) -> None:
        """Collective: a step-N checkpoint of the payload and `state` (the caller's) with every RNG."""
        with watchdog.slow():
            ckpt.save(step, self.payload(), {**state, "rng": rng_state(self.device)}, meta, blocking=blocking)

    def save_best(self, ckpt: CheckpointManager, state: dict[str, Any], meta: dict[str, Any]) -> None:
        with watchdog.slow():
            ckpt.save_best(self.payload(), {**state, "rng": rng_state(self.device)}, meta)

    def resume(self, ckpt: CheckpointManager, rank: int) -> tuple[Path, dict[str, Any]] | None:
        """Collective: the newest complete checkpoint's model and optimizer loaded, and the RNG where
        this rank has its own file (at another world size positions agree, RNG streams do not);
        returns its path and rank state, for the caller's own part, or None without one."""
        if not complete_checkpoints(ckpt.root):
            return None
        payload = self.payload()
        with watchdog.slow():
            loaded = ckpt.load_latest(payload)
        if loaded is None:
            self.strategy.nothing_loaded()
            return None
        path, state = loaded
        self.strategy.load_payload(payload)
        if state.get("rng") and Path(path, f"rank-{rank}.pt").exists():
            set_rng_state(state["rng"], self.device)
        return path, state
