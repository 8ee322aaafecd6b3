"""DeepSpeed (ZeRO 0-3, CPU offload) from the spec, on the process group the entrypoint already built.

No ssh, no hostfile, no `deepspeed` launcher: every rank is started by srun / the local executor /
torchrun, and `deepspeed.initialize` joins the existing torch.distributed group.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime.checkpoint import Payload
from hpcgpu.runtime.env import DistEnv
from hpcgpu.runtime.plan import RunPlan
from hpcgpu.runtime.precision import Precision
from hpcgpu.runtime.strategies.base import Strategy
from hpcgpu.spec import Spec

log = logging.getLogger("hpcgpu")

DS_TAG = "deepspeed"  # DeepSpeed's own folder inside step-N/

# keys we derive from the spec; a user JSON may repeat them only with the same value (or "auto")
DERIVED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
           "gradient_clipping", "zero_optimization.stage", "bf16.enabled", "fp16.enabled")


def import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError:
        raise HpcgpuError("distributed.strategy: deepspeed needs the deepspeed package: "
                          "pip install 'hpcgpu[deepspeed]'") from None
    return deepspeed


def generated_config(spec: Spec, plan: RunPlan) -> dict:
    """The DeepSpeed config of the run plan (batch split, ZeRO stage and offload, precision); the
    spec gives only what the plan does not decide (gradient clipping)."""
    t = plan.training
    if t.zero_stage is None:
        raise ValueError(f"the run plan's strategy is {t.how()}, not deepspeed")
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if t.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if t.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # a consolidated model at the end
    cfg: dict[str, Any] = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.accum,
        "gradient_clipping": spec.train.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16"},
        # our torch AdamW (fused on GPU) also under offload: no JIT build of DeepSpeed's CPU Adam
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return cfg


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, recursively; "auto" at any depth keeps what `base` (the spec) derived."""
    out = dict(base)
    for key, value in extra.items():
        if value == "auto":
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def merged_config(spec: Spec, generated: dict) -> dict:
    """The generated config with the user's JSON merged in; a contradiction is an error, not an override."""
    path = spec.distributed.deepspeed.config
    if not path:
        return generated
    try:
        user = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise HpcgpuError(f"distributed.deepspeed.config: {path} not found") from None
    except json.JSONDecodeError as exc:
        raise HpcgpuError(f"distributed.deepspeed.config: {path} is not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(user, dict):
        raise HpcgpuError(f"distributed.deepspeed.config: {path} must hold a JSON object")
    for key in DERIVED:
        theirs, ours = _get(user, key), _get(generated, key)
        if theirs not in (None, "auto") and theirs != ours:
            raise HpcgpuError(f"distributed.deepspeed.config: {path} sets {key}={theirs!r} but the spec gives "
                              f"{ours!r}; change the spec (train.*, distributed.deepspeed.*) or drop the key")
    return _merge(generated, user)


class DeepSpeedRun:
    """DeepSpeed's engine plus what it needs alive (transformers' ZeRO-3 hook) for the life of the run."""

    def __init__(self, config: dict):
        self.deepspeed = import_deepspeed()
        self.config = config
        self.hf_hook: Any = None
        self.wrapped: Any = None
        if torch.distributed.is_initialized():
            # deepspeed.comm adopts our process group (no MPI discovery, no launcher); ZeRO-3's
            # partitioning at model creation reads the world size from it
            self.deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(),
                                            auto_mpi_discovery=False)

    @classmethod
    def for_plan(cls, spec: Spec, plan: RunPlan) -> "DeepSpeedRun":
        """The one place a run's DeepSpeed config is built: the plan's, with the user's JSON merged in."""
        return cls(merged_config(spec, generated_config(spec, plan)))

    @property
    def zero3(self) -> bool:
        return self.config["zero_optimization"]["stage"] == 3

    def before_model(self) -> None:
        """For ZeRO-3, transformers must see the config before the model is built, so that
        from_config/from_pretrained partition parameters at creation (a bare zero.Init around
        from_config gives wrong initial weights)."""
        if self.zero3:
            from transformers.integrations import HfDeepSpeedConfig  # transformers: only where ZeRO-3 needs it

            self.hf_hook = HfDeepSpeedConfig(self.config)

    def initialize(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler) -> Any:
        wrapped, _, _, _ = self.deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                     config=self.config, dist_init_required=False)
        self.wrapped = wrapped
        return wrapped

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full weights for save_pretrained (rank 0 gets them; collective under ZeRO-3); None below
        ZeRO-3, where every rank holds them and save_pretrained reads the model itself."""
        if self.zero3:
            return self.wrapped._zero3_consolidated_16bit_state_dict()
        return None


class DeepSpeedPayload(Payload):
    """DeepSpeed's own checkpoint (module, ZeRO-partitioned optimizer, scheduler) in step-N/deepspeed/."""

    def __init__(self, wrapped: Any):
        self.wrapped = wrapped  # deepspeed.initialize's model (its DeepSpeedEngine)
        self.frozen = any(not p.requires_grad for p in wrapped.module.parameters())

    def write(self, path: Path) -> None:
        # LoRA: the frozen base is not checkpointed (the run loads or builds it again as it started)
        self.wrapped.save_checkpoint(str(path), tag=DS_TAG, save_latest=False, exclude_frozen_parameters=self.frozen)

    def read(self, path: Path) -> None:
        load_path, _ = self.wrapped.load_checkpoint(str(path), tag=DS_TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True, load_module_strict=not self.frozen)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {path / DS_TAG}")


def deepspeed_on_cpu(device: torch.device) -> None:
    """CPU ranks are meant: DeepSpeed (the strategy, or imported by transformers) would otherwise warn
    that it "was unable to detect" a GPU."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


class DeepSpeed(Strategy):
    """DeepSpeed's engine wraps the module as built (no loss wrapper: plan.py allows neither the fused
    loss nor compile with it), steps at its own accumulation boundary, scales fp16 itself, and under
    hpcgpu's own loop casts itself (its inputs are token ids; the user's loop may feed float inputs,
    which autocast casts at each op)."""

    name = "deepspeed"
    lone_rank_group = True
    accumulates_itself = True
    run: DeepSpeedRun

    def before_model(self) -> None:
        assert self.spec is not None  # deepspeed is only ever the spec's choice
        self.run = DeepSpeedRun.for_plan(self.spec, self.plan)
        self.run.before_model()  # ZeRO-3 partitions the model as it is built

    def build_device(self) -> torch.device | None:
        return None if self.run.zero3 else super().build_device()  # ZeRO-3 places it itself

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # DeepSpeed's engine moves it

    def adopt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> torch.nn.Module:
        assert self.spec is not None  # deepspeed is only ever the spec's choice
        deepspeed_on_cpu(self.device)
        self.run = DeepSpeedRun.for_plan(self.spec, self.plan)
        return module

    def wrap(self, target: torch.nn.Module) -> Any:
        assert self.module is not None
        self.model = self.run.initialize(self.module, self.optimizer, self.scheduler)
        return self.model

    def user_optimizer(self) -> Any:
        return self.model.optimizer  # the engine's wrapper of it

    def describe(self) -> str:
        return f"{self.name} ZeRO-{self.plan.training.zero_stage}"

    def loop_precision(self, precision: Precision) -> Precision:
        return Precision(None, precision.device_type) if self.own_loop else precision

    def scaler(self, precision: Precision) -> torch.amp.GradScaler:
        return precision.scaler(enabled=False)

    def guards_first_step(self) -> bool:
        return False  # its collectives run inside forward and backward

    def backward(self, loss: torch.Tensor, scaler: torch.amp.GradScaler) -> None:
        self.model.backward(loss)  # scaled by 1/accumulation inside the engine

    def step(self, scaler: torch.amp.GradScaler, params: list[torch.nn.Parameter], grad_clip: float) -> None:
        self.model.step()  # clips, steps optimizer and scheduler at its accumulation boundary

    def payload(self) -> Payload | dict[str, Any]:
        return DeepSpeedPayload(self.model)

    def load_payload(self, payload: Payload | dict[str, Any]) -> None:
        """DeepSpeed's engine loaded itself in the read."""

    def load_model(self, payload: Payload | dict[str, Any]) -> None:
        """DeepSpeed's engine loaded itself in the read."""

    def nothing_loaded(self) -> None:
        """DeepSpeed's own checkpoint primed nothing."""

    def final_state_dict(self, lora: bool) -> dict[str, torch.Tensor] | None:
        # ZeRO-2 holds whole weights in every rank: only ZeRO-3 (never with LoRA) needs them gathered
        return None if lora else self.run.consolidated_state_dict()  # collective
