"""The one training engine: a model under the run plan's strategy and precision, its optimizer step,
and its state in checkpoints. `task: train` (the Trainer) and `ctx.prepare` (the user's own loop)
are both thin layers on it.

- wrap: the strategy the plan chose, in one dispatch (`Engine.wrap`): the bare model for one rank,
  DDP with the distributed.ddp options, or the DeepSpeed engine with the plan's config. FSDP2 shards
  the module before an optimizer exists (`shard_for_plan`, runtime/fsdp_strategy.py), so its wrap is
  the sharded module itself. The only DDP construction in hpcgpu is `wrap_ddp`.
- precision: the plan's (bf16/fp16 autocast, fp32 none) and the GradScaler of fp16 (`Precision`).
- step: backward (scaled, or the DeepSpeed engine's), then clip to train.grad_clip, optimizer step,
  scaler update, zero_grad and the scheduler's step (`optimizer_step`); accumulation and no_sync are
  the caller's loop, which knows its micro batches.
- state: the model and optimizer (torch.distributed.checkpoint, or DeepSpeed's own checkpoint), the
  scheduler and scaler, every RNG, through the CheckpointManager's step-N layout; the caller adds its
  own (step, data position) to the rank state under its own key.

The engine decides nothing the plan decided: strategy, precision and batch are read from the RunPlan;
the spec gives only what the plan does not hold (the DDP options, grad_clip, sync_batchnorm).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from hpcgpu.runtime.checkpoint import CheckpointManager, Payload, complete_checkpoints
from hpcgpu.runtime.deepspeed_strategy import DeepSpeedPayload, DeepSpeedRun
from hpcgpu.runtime.fsdp_strategy import shard_model
from hpcgpu.runtime.plan import RunPlan
from hpcgpu.runtime.rng import rng_state, set_rng_state
from hpcgpu.runtime.strategy import ddp_options, describe_ddp
from hpcgpu.runtime import watchdog
from hpcgpu.runtime.watchdog import beat
from hpcgpu.spec import Spec
from hpcgpu.spec.schema import Fsdp

log = logging.getLogger("hpcgpu")

AMP_DTYPES: dict[str, torch.dtype | None] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
CPU_SYNC_BN = ("sync_batchnorm: CPU ranks keep plain BatchNorm (torch's SyncBatchNorm runs on GPUs only); "
               "each rank normalizes with its own batch's statistics")


# ---------------------------------------------------------------- model helpers (pure)

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


def is_compiled(model: torch.nn.Module) -> bool:
    """torch.compile(model) or model.compile(): DDP around it splits the compiled graph at its buckets.
    torch.compile imports dynamo: where nothing did, no model is compiled, and dynamo (seconds to
    import) stays unloaded."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        return True
    return getattr(model, "_compiled_call_impl", None) is not None


def wrap_ddp(model: torch.nn.Module, device: torch.device, options: dict[str, Any]) -> DistributedDataParallel:
    """The one DDP construction of hpcgpu: this rank's device, the distributed.ddp options."""
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, **options)


def shard_for_plan(module: torch.nn.Module, spec: Spec | None, plan: RunPlan, device: torch.device,
                   compile_blocks: bool = False) -> torch.nn.Module:
    """Under the plan's fsdp: the module sharded in place (before its optimizer is made); else as it is.
    CPU offload is the plan's (recorded at the first start), the other options the spec's."""
    t = plan.training
    if t.strategy != "fsdp":
        return module
    options = dataclasses.replace(spec.distributed.fsdp if spec is not None else Fsdp(), cpu_offload=t.offload_params)
    return shard_model(module, options, plan.precision, device, compile_blocks=compile_blocks)


# ---------------------------------------------------------------- precision

@dataclass(frozen=True)
class Precision:
    """The plan's precision on this device: the autocast dtype (None: fp32, no autocast)."""

    dtype: torch.dtype | None
    device_type: str

    @classmethod
    def of(cls, plan: RunPlan, device: torch.device) -> "Precision":
        return cls(AMP_DTYPES[plan.precision], device.type)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scaler(self, enabled: bool = True) -> torch.amp.GradScaler:
        """fp16's loss scaler (a pass-through otherwise); enabled=False where DeepSpeed scales itself."""
        return torch.amp.GradScaler(self.device_type, enabled=enabled and self.dtype == torch.float16)


# ---------------------------------------------------------------- the engine

class Engine:
    """One model, its optimizer and scheduler under the plan's strategy and precision.

    module: the model as built (what is saved); model: what is called (DDP, the DeepSpeed engine, or
    the module or what the caller put around it). own_loop: hpcgpu's train loop drives it, which
    allows DDP's gradients as bucket views and, under DeepSpeed, runs without autocast (its inputs are
    token ids; the user's loop may feed float inputs, which autocast casts at each op)."""

    def __init__(self, spec: Spec | None, plan: RunPlan, device: torch.device, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any = None, *, ds: DeepSpeedRun | None = None,
                 own_loop: bool = False):
        self.spec, self.plan, self.device = spec, plan, device
        self.strategy = plan.training.strategy
        self.module, self.optimizer, self.scheduler, self.ds = module, optimizer, scheduler, ds
        self.grad_clip = spec.train.grad_clip if spec is not None else 0.0
        self.params = [p for p in module.parameters() if p.requires_grad]  # once: parameters() walks every module
        # LoRA: checkpoints hold what changes (the adapters, their optimizer state), not the frozen base,
        # which the run builds or loads again as it started (its identity is in the plan)
        frozen = plan.training.adapter is not None
        self.save_options = StateDictOptions(ignore_frozen_params=frozen)
        self.load_options = StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)
        # torch leaves a frozen weight in under its second name (a head tied to the embeddings): dropped too
        self.frozen_names = {name for name, p in module.named_parameters(remove_duplicate=False)
                             if not p.requires_grad} if frozen else set()
        self.precision = Precision.of(plan, device)
        self.amp = self.precision if ds is None or not own_loop else Precision(None, device.type)
        self.scaler = self.precision.scaler(enabled=ds is None)
        self.own_loop = own_loop
        self.ddp_options: dict[str, Any] | None = None
        self.model: Any = module

    def wrap(self, around: torch.nn.Module | None = None) -> Any:
        """Put the plan's strategy around the module (or `around`: the module inside the caller's
        wrappers, e.g. compiled); the result is `model`, what the loop calls."""
        target = self.module if around is None else around
        if self.strategy == "deepspeed":
            assert self.ds is not None, "a DeepSpeed plan needs its DeepSpeedRun"
            self.model = self.ds.initialize(self.module, self.optimizer, self.scheduler)
        elif self.strategy == "ddp":
            self.ddp_options = ddp_options(self.spec, own_loop=self.own_loop, compiled=is_compiled(target))
            self.model = wrap_ddp(target, self.device, self.ddp_options)
        else:  # one rank, or fsdp: sharded already (shard_for_plan)
            self.model = target
        return self.model

    @property
    def user_optimizer(self) -> Any:
        """The optimizer to hold: DeepSpeed's wrapper of it under DeepSpeed."""
        return self.model.optimizer if self.ds is not None else self.optimizer

    def describe(self) -> str:
        """The strategy for a log line: ddp (buckets 25 MiB, ...), deepspeed ZeRO-N, none."""
        how = self.strategy
        if self.ddp_options is not None:
            how += f" ({describe_ddp(self.ddp_options)})"
        if self.strategy == "deepspeed":
            how += f" ZeRO-{self.plan.training.zero_stage}"
        if self.strategy == "fsdp" and self.plan.training.offload_params:
            how += " (CPU offload)"
        return how

    # -- one step
    def autocast(self) -> contextlib.AbstractContextManager:
        return self.amp.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        if self.ds is not None:
            self.model.backward(loss)  # scaled by 1/accumulation inside the engine
        else:
            self.scaler.scale(loss).backward()

    def optimizer_step(self) -> None:
        """Clip, step, update the scale, zero the gradients, step the scheduler (DeepSpeed's engine
        does all of it, at its accumulation boundary)."""
        beat()
        if self.ds is not None:
            self.model.step()
            return
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    # -- checkpoint state
    def payload(self) -> Payload | dict[str, Any]:
        """The model and optimizer for the CheckpointManager (collective)."""
        if self.ds is not None:
            return DeepSpeedPayload(self.model)
        self.sync_buffers()
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=self.save_options)
        if self.save_options.ignore_frozen_params:
            model_sd = {k: v for k, v in model_sd.items() if k not in self.frozen_names}
        return {"model": model_sd, "optim": optim_sd}

    def sync_buffers(self) -> None:
        """Collective: rank 0's buffers on every rank. BatchNorm's running statistics differ by rank
        when the batch statistics are not synced (CPU ranks), while DCP writes one copy of a tensor
        every rank holds, from any rank; DDP itself copies rank 0's at the next forward, so rank 0's
        are the ones the run goes on with, and the ones a resume must load."""
        if self.strategy == "ddp" and getattr(self.model, "broadcast_buffers", False):
            for buffer in self.module.buffers():
                dist.broadcast(buffer, src=0)

    def load_payload(self, payload: Payload | dict[str, Any]) -> None:
        if self.ds is None:  # DeepSpeed's engine loaded itself in the read
            set_state_dict(self.module, self.optimizer, model_state_dict=payload["model"],
                           optim_state_dict=payload["optim"], options=self.load_options)

    def load_model(self, payload: Payload | dict[str, Any]) -> None:
        """Only the weights of a loaded payload (the best model at the end of a run)."""
        if self.ds is None:
            set_model_state_dict(self.module, payload["model"], options=self.load_options)

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
            if self.ds is None:
                self.optimizer.state.clear()  # get_state_dict primed it with a zero-lr step; start clean
            return None
        path, state = loaded
        self.load_payload(payload)
        if state.get("rng") and Path(path, f"rank-{rank}.pt").exists():
            set_rng_state(state["rng"], self.device)
        return path, state


def deepspeed_on_cpu(device: torch.device) -> None:
    """CPU ranks are meant: DeepSpeed (the strategy, or imported by transformers) would otherwise warn
    that it "was unable to detect" a GPU."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
