"""The one interface of a training strategy: how a model is spread over the ranks.

A strategy is made once per model from the run plan (`strategy_for`, in this package's __init__) and
asked for everything that differs between strategies, so that the train task, `ctx.prepare` and the
training (runtime/training.py) never ask which one runs. The order of the calls:

    before_model -> build_device / place (the train task's model) or adopt (ctx.prepare's) -> shard
    -> (the optimizer is made) -> bind -> wrap -> backward / step per micro batch and step
    -> payload, load_payload, load_model (checkpoints) -> final_state_dict (the model saved at the end)

This base class is plain torch on one rank: the model on the device, no wrapper, the optimizer
stepped through the GradScaler, the model and optimizer checkpointed by torch.distributed.checkpoint.
A strategy overrides only what it does differently.
"""
from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from hpcgpu.runtime.checkpoint import Payload
from hpcgpu.runtime.env import DistEnv
from hpcgpu.runtime.plan import RunPlan
from hpcgpu.runtime.precision import Precision
from hpcgpu.spec import Spec


class Strategy:
    """A model under one of distributed.strategy's choices; the registry's key is `name`."""

    name: ClassVar[str]
    lone_rank_group: ClassVar[bool] = False  # a job of one rank needs a (one-rank) process group all the same
    # the strategy accumulates micro batches itself and steps at its own boundary: the loop calls
    # backward and step for every micro batch, with the loss undivided
    accumulates_itself: ClassVar[bool] = False

    def __init__(self, plan: RunPlan, spec: Spec | None, device: torch.device):
        self.plan, self.spec, self.device = plan, spec, device
        self.module: torch.nn.Module | None = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.own_loop = False
        self.model: Any = None  # what wrap returned: what the loop calls

    # -- the model, before its optimizer exists
    def before_model(self) -> None:
        """Called before the train task builds its model."""

    def build_device(self) -> torch.device | None:
        """Where the train task's model is created (None: on the CPU, then placed)."""
        return self.device if self.device.type == "cuda" else None

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module on this rank's device; in place, so that an optimizer made before stays valid."""
        return module.to(self.device)

    def shard(self, module: torch.nn.Module, compile_blocks: bool = False) -> torch.nn.Module:
        """The module as the optimizer must see it (sharded where the strategy shards)."""
        return module

    def adopt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> torch.nn.Module:
        """ctx.prepare: the user's module, with its optimizer already made, made ready to bind."""
        return self.place(module)

    def compiled(self, model: torch.nn.Module, mode: str) -> torch.nn.Module:
        """The train task's model compiled as the plan asks (whole, unless the strategy compiled its parts)."""
        return torch.compile(model, mode=mode)  # type: ignore[return-value]

    # -- the model with its optimizer
    def bind(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             own_loop: bool) -> None:
        """The module, optimizer and scheduler this strategy runs; own_loop: hpcgpu's train loop drives
        them, not the user's code. LoRA: checkpoints hold what changes (the adapters, their optimizer
        state), not the frozen base, which the run builds or loads again as it started."""
        self.module, self.optimizer, self.scheduler, self.own_loop = module, optimizer, scheduler, own_loop
        self.model = module
        frozen = self.plan.training.adapter is not None
        self.save_options = StateDictOptions(ignore_frozen_params=frozen)
        self.load_options = StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)
        # torch leaves a frozen weight in under its second name (a head tied to the embeddings): dropped too
        self.frozen_names = {name for name, p in module.named_parameters(remove_duplicate=False)
                             if not p.requires_grad} if frozen else set()

    def wrap(self, target: torch.nn.Module) -> Any:
        """What the loop calls, around `target` (the bound module, or it inside the caller's wrappers)."""
        self.model = target
        return target

    def user_optimizer(self) -> Any:
        """The optimizer the caller holds from now on."""
        return self.optimizer

    def describe(self) -> str:
        """The strategy for ctx.prepare's log line: ddp (buckets 25 MiB, ...), deepspeed ZeRO-N, none."""
        return self.name

    def options_note(self) -> str:
        """What the train task's start line adds about this strategy's options ('' for none)."""
        return ""

    # -- precision
    def loop_precision(self, precision: Precision) -> Precision:
        """The autocast the loop runs under."""
        return precision

    def scaler(self, precision: Precision) -> torch.amp.GradScaler:
        return precision.scaler()

    # -- one step
    def guards_first_step(self) -> bool:
        """Whether the first step may run without communication, so that the ranks agree on an
        out-of-memory error before any collective (tasks/train.py's module docstring)."""
        return True

    def without_reduction(self) -> contextlib.AbstractContextManager:
        """Around a micro batch that is not the step's last: no gradient reduction yet."""
        return contextlib.nullcontext()

    def local_only(self) -> contextlib.AbstractContextManager:
        """Around the guarded first step's forwards and backwards: no collective at all."""
        return contextlib.nullcontext()

    def reduce_gradients(self, params: list[torch.nn.Parameter], world: int) -> None:
        """The gradient reduction local_only held back."""

    def backward(self, loss: torch.Tensor, scaler: torch.amp.GradScaler) -> None:
        scaler.scale(loss).backward()

    def step(self, scaler: torch.amp.GradScaler, params: list[torch.nn.Parameter], grad_clip: float) -> None:
        """Clip, step, update the scale, zero the gradients, step the scheduler."""
        if grad_clip > 0:
            scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    # -- checkpoint state
    def payload(self) -> Payload | dict[str, Any]:
        """The model and optimizer for the CheckpointManager (collective)."""
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=self.save_options)
        if self.save_options.ignore_frozen_params:
            model_sd = {k: v for k, v in model_sd.items() if k not in self.frozen_names}
        return {"model": model_sd, "optim": optim_sd}

    def load_payload(self, payload: Payload | dict[str, Any]) -> None:
        """The model and optimizer from a payload the CheckpointManager read."""
        set_state_dict(self.module, self.optimizer, model_state_dict=payload["model"],
                       optim_state_dict=payload["optim"], options=self.load_options)

    def load_model(self, payload: Payload | dict[str, Any]) -> None:
        """Only the weights of a loaded payload (the best model at the end of a run)."""
        set_model_state_dict(self.module, payload["model"], options=self.load_options)

    def nothing_loaded(self) -> None:
        """No checkpoint could be read into the payload: get_state_dict primed the optimizer with a
        zero-lr step; start clean."""
        self.optimizer.state.clear()

    def final_state_dict(self, lora: bool) -> dict[str, torch.Tensor] | None:
        """The whole weights for save_pretrained (collective where they are spread); None: the module's own."""
        return None
