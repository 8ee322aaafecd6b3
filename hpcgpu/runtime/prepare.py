"""`ctx.prepare` and what rests on it: the spec's strategy and precision around the user's own model,
and checkpoints of everything it registered (`ctx.save` / `ctx.resume`).

    model, optimizer = ctx.prepare(model, optimizer, scheduler=scheduler)
    for x, y in loader:
        with ctx.autocast():
            loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        ctx.backward(loss)
        ctx.step()            # clip (train.grad_clip), optimizer step, zero_grad, scheduler step

Strategy (distributed.strategy): DDP with the distributed.ddp options (the train task's own
ddp_options), DeepSpeed through the train task's config generation and conflict checks, or the bare
model for one rank. Precision (train.precision, resolved as for the train task): bf16 autocast on GPUs
that have it, fp16 autocast with a GradScaler, fp32 on CPU. BatchNorm becomes SyncBatchNorm per
distributed.sync_batchnorm.

A checkpoint holds the model and optimizer (torch.distributed.checkpoint, or DeepSpeed's own), the
scheduler and scaler, every RNG (python, numpy, torch, cuda) and the position of every loader made by
ctx.data_loader, in the CheckpointManager's step-N layout.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hpcgpu.contract import EXIT_STOPPED
from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime.checkpoint import Payload, complete_checkpoints
from hpcgpu.runtime.plan import fixed_strategy, resolve_precision
from hpcgpu.runtime.rng import rng_state, set_rng_state
from hpcgpu.runtime.strategy import ddp_options, describe_ddp
from hpcgpu.spec import Spec

if TYPE_CHECKING:
    from hpcgpu.runtime.context import Context

log = logging.getLogger("hpcgpu")

AMP_DTYPES: dict[str, torch.dtype | None] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
CPU_SYNC_BN = ("sync_batchnorm: CPU ranks keep plain BatchNorm (torch's SyncBatchNorm runs on GPUs only); "
               "each rank normalizes with its own batch's statistics")


# ---------------------------------------------------------------- decisions (pure)

def choose_strategy(spec: Spec | None, world: int) -> str:
    """none | ddp | deepspeed: the spec's, in plan words; auto is DDP for several ranks."""
    fixed = fixed_strategy(spec, world) if spec is not None else None
    return fixed or ("ddp" if world > 1 else "none")


def choose_precision(spec: Spec | None, device: torch.device) -> str:
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return resolve_precision(spec.train.precision if spec is not None else "auto", device.type, bf16)


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


def wrap_ddp(model: torch.nn.Module, device: torch.device, options: dict[str, Any]) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, **options)


def deepspeed_config(spec: Spec, world: int, precision: str) -> dict:
    """The train task's DeepSpeed config for a loop of the user's: global batch train.global_batch_size,
    one micro batch of global / world per rank and step (ctx.step steps the optimizer every time),
    ZeRO stage and offload from distributed.deepspeed, the user's JSON merged with the same checks."""
    from hpcgpu.runtime.deepspeed_strategy import generated_config, merged_config
    from hpcgpu.runtime.plan import RunPlan, TrainPlan
    from hpcgpu.spec.derive import batch_split

    ds = spec.distributed.deepspeed
    per_rank, _ = batch_split(spec.train.global_batch_size, world, ranks="world size of this job")
    train = TrainPlan(global_batch=spec.train.global_batch_size, seq_len=0, batch_per_rank=per_rank,
                      micro_batch=per_rank, accum=1, strategy="deepspeed", zero_stage=ds.zero_stage,
                      offload_optimizer=ds.offload_optimizer, offload_params=ds.offload_params)
    plan = RunPlan(task="callable", world_size=world, precision=precision, reason="ctx.prepare", train=train)
    return merged_config(spec, generated_config(spec, plan))


# ---------------------------------------------------------------- the prepared model

@dataclass
class Prepared:
    """What ctx.prepare set up; the user holds `model` and `optimizer`, checkpoints use the rest."""

    module: torch.nn.Module  # the user's model (BatchNorm synced where asked): what is saved
    model: Any  # what the user calls: DDP, the DeepSpeed engine, or the module itself
    optimizer: Any
    scheduler: Any
    strategy: str
    precision: str
    device: torch.device
    grad_clip: float = 0.0
    scaler: Any = None
    engine: Any = None  # DeepSpeed's

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return AMP_DTYPES[self.precision]

    def autocast(self) -> contextlib.AbstractContextManager:
        # also under DeepSpeed, whose bf16/fp16 modes cast the weights but not the user's float
        # inputs (an image batch): autocast casts them at each op
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            self.scaler.scale(loss).backward()

    def step(self) -> None:
        if self.engine is not None:
            self.engine.step()  # clips, steps the optimizer and scheduler, zeroes the gradients
            return
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    # -- checkpoints
    def payload(self) -> Payload | dict[str, Any]:
        if self.engine is not None:
            from hpcgpu.runtime.deepspeed_strategy import DeepSpeedPayload

            return DeepSpeedPayload(self.engine)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.sync_buffers()
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def sync_buffers(self) -> None:
        """Collective: rank 0's buffers on every rank. BatchNorm's running statistics differ by rank
        when the batch statistics are not synced (CPU ranks), while DCP writes one copy of a tensor
        every rank holds, from any rank; DDP itself copies rank 0's at the next forward, so rank 0's
        are the ones the run goes on with, and the ones a resume must load."""
        import torch.distributed as dist

        if self.strategy == "ddp" and getattr(self.model, "broadcast_buffers", False):
            for buffer in self.module.buffers():
                dist.broadcast(buffer, src=0)

    def load_payload(self, payload: Payload | dict[str, Any]) -> None:
        if self.engine is None:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(self.module, self.optimizer, model_state_dict=payload["model"],
                           optim_state_dict=payload["optim"])

    def forget_primed_state(self) -> None:
        """get_state_dict primed an empty optimizer with a zero-lr step: start clean when nothing loaded."""
        if self.engine is None:
            self.optimizer.state.clear()

    def rank_state(self) -> dict[str, Any]:
        if self.engine is not None:
            return {}  # the engine's checkpoint holds its scheduler and loss scale
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": self.scaler.state_dict()}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if self.engine is not None:
            return
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def prepare(ctx: Context, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None
            ) -> Prepared:
    if ctx.prepared is not None:
        raise HpcgpuError("ctx.prepare was called twice; one model and optimizer per job")
    spec, device, world = ctx.spec, ctx.device, ctx.world_size
    strategy = choose_strategy(spec, world)
    precision = choose_precision(spec, device)
    setting = spec.distributed.sync_batchnorm if spec is not None else "auto"
    module = sync_batchnorm(model, setting, device, world)
    grad_clip = spec.train.grad_clip if spec is not None else 0.0
    if strategy == "deepspeed":
        return prepare_deepspeed(ctx, module, optimizer, scheduler, precision)
    module = module.to(device)  # in place: the optimizer's parameters stay the module's
    options = ddp_options(spec, compiled=is_compiled(module)) if strategy == "ddp" else None
    wrapped = wrap_ddp(module, device, options) if options is not None else module
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    log.info(describe(strategy, precision, device, world, spec, options))
    return Prepared(module, wrapped, optimizer, scheduler, strategy, precision, device, grad_clip, scaler)


def prepare_deepspeed(ctx: Context, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                      precision: str) -> Prepared:
    from hpcgpu.runtime.deepspeed_strategy import DeepSpeedRun

    assert ctx.spec is not None  # deepspeed is only ever the spec's choice
    if ctx.device.type == "cpu":  # CPU ranks are meant: DeepSpeed would warn it "was unable to detect" a GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run = DeepSpeedRun(deepspeed_config(ctx.spec, ctx.world_size, precision))
    engine = run.initialize(module, optimizer, scheduler)
    log.info(describe("deepspeed", precision, ctx.device, ctx.world_size, ctx.spec))
    return Prepared(module, engine, engine.optimizer, scheduler, "deepspeed", precision, ctx.device,
                    ctx.spec.train.grad_clip, engine=engine)


def describe(strategy: str, precision: str, device: torch.device, world: int, spec: Spec | None,
             options: dict[str, Any] | None = None) -> str:
    how = strategy
    if strategy == "ddp" and options is not None:
        how += f" ({describe_ddp(options)})"
    if strategy == "deepspeed" and spec is not None:
        how += f" ZeRO-{spec.distributed.deepspeed.zero_stage}"
    return f"ctx.prepare: {how} on {device} x {world}, {precision}"


def prepared_of(ctx: Context, what: str) -> Prepared:
    if ctx.prepared is None:
        raise HpcgpuError(f"{what} needs ctx.prepare(model, optimizer) first")
    return ctx.prepared


# ---------------------------------------------------------------- save / resume / stop

def save(ctx: Context, step: int, blocking: bool | None = None) -> None:
    """Collective: a checkpoint at `step` of everything ctx.prepare and ctx.data_loader registered."""
    p = prepared_of(ctx, "ctx.save")
    if ctx.checkpoint is None:
        raise HpcgpuError("ctx.save needs a spec (checkpoints go to <run dir>/checkpoints); run the job "
                          "through hpcgpu or pass hpcgpu.init(spec)")
    rank_state = {"step": step, "prepared": p.rank_state(), "rng": rng_state(ctx.device),
                  "loaders": [loader.state_dict() for loader in ctx.loaders]}
    ctx.checkpoint.save(step, p.payload(), rank_state, {"restart_count": ctx.env.restart_count},
                        blocking=blocking)


def resume(ctx: Context) -> int:
    """Collective: load the newest complete checkpoint; the step it was saved at, or 0 without one."""
    p = prepared_of(ctx, "ctx.resume")
    if ctx.checkpoint is None or not complete_checkpoints(ctx.checkpoint.root):
        return 0
    payload = p.payload()
    loaded = ctx.checkpoint.load_latest(payload)
    if loaded is None:
        p.forget_primed_state()
        return 0
    path, state = loaded
    p.load_payload(payload)
    p.load_rank_state(state["prepared"])
    if Path(path, f"rank-{ctx.rank}.pt").exists():  # another world size: positions agree, RNG streams do not
        set_rng_state(state["rng"], ctx.device)
    restore_loaders(ctx, state["loaders"])
    step = int(state["step"])
    ctx.checkpoint.last_saved_step = step
    ctx.metrics.write("resume", step=step, checkpoint=path.name, restart_count=ctx.env.restart_count)
    log.info(f"resuming at step {step} from {path.name}")
    return step


def restore_loaders(ctx: Context, states: list[dict[str, int]]) -> None:
    """Loaders are matched by the order they were made in; those made after ctx.resume take theirs then."""
    for loader, state in zip(ctx.loaders, states):
        loader.load_state_dict(state)
    ctx.loader_states = list(states[len(ctx.loaders):])


def stop(ctx: Context, step: int) -> int:
    """After an agreed stop: checkpoint at `step`, say why, requeue under SLURM (rank 0, within
    slurm.max_requeues) and give the exit code of a stopped run (75). A SIGTERM that was srun ending
    the step after another rank failed is that crash, not a stop: raised, never requeued."""
    from hpcgpu.runtime.requeue import TornDown, describe_stop, requeue, stop_reason, torn_down_by

    spec = ctx.spec
    if spec is None:
        raise HpcgpuError("ctx.stop needs a spec (checkpoints, requeue); run the job through hpcgpu")
    save(ctx, step, blocking=True)
    why = torn_down_by(spec, ctx.env, ctx.stop_flag.signum, ctx.run_dir)
    if why is not None:
        raise TornDown(why, 128 + signal.SIGTERM)
    reason = stop_reason(spec, ctx.env)
    ctx.metrics.write("stop", step=step, reason=reason, restart_count=ctx.env.restart_count)
    log.info(f"{describe_stop(reason)}: stopped at step {step} with a checkpoint")
    requeue(ctx.env, spec, reason)
    return EXIT_STOPPED
