"""The run plan: every setting derived for this job, decided once, recorded, reused on resume.

From (spec, the real world size, the device, the GPU memory agreed over the ranks, the training
data's sequence count) the job decides world size, batch per rank, micro batch, accumulation,
strategy (and ZeRO stage and offload), gradient checkpointing, precision, compile, loader workers
and the step count (train.epochs: epochs x sequences // global batch), with the reason. Below the plan nothing re-derives them and
nothing rewrites the spec: the trainer, the data schedule, the DeepSpeed config and the metrics read
the plan only.

The plan is written to `<run dir>/plan.json` (rank 0, atomically) before the first step and beside
`spec.yaml` in every checkpoint. A resumed job reuses the recorded plan: a requeue onto other GPUs
never switches DDP <-> DeepSpeed nor changes the micro batch. A DDP run resumed at another world size
keeps its global batch, re-split over the new ranks (at_width; `widths` records each). A recorded plan
the new allocation cannot honour (a changed global batch, DeepSpeed at another width) is one clear
error naming both.

One change after the start: an out-of-memory error in the first step with micro_batch_size: auto
halves the micro batch (halved_micro; the global batch stays, through accumulation) and the plan is
rewritten with `oom_halvings` counted up. A resume takes such a plan.json over the older copy in the
newest checkpoint (recorded_plan), so a requeued job does not run out of memory again.

Task-specific settings live in a sub-block (`train`, `infer`), so the top level stays what every task
shares. No torch at import time.

`task: infer` decides its replicas (one per rank in this version: one GPU per model copy), the batch
(rows per forward; auto: 8 on CPU, on a GPU from the memory left beside the weights) and the weights'
dtype once; a resume reuses them, so the batches (and with them every output) stay what they were.
Only the replica count may change on a resume (another allocation): the batches do not depend on it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from hpcgpu.contract import ENV_GPU_MEMORY, PLAN_FILE, RunPaths, complete_checkpoints
from hpcgpu.errors import HpcgpuError, SpecError
from hpcgpu.gpu.estimate import (Strategy, auto_infer_batch, count_params, fmt_bytes, infer_batch_limit, parse_size,
                                 plan_strategy)
from hpcgpu.gpu.recommend import compiled_step, recommend_for_job
from hpcgpu.spec import Spec
from hpcgpu.spec.derive import batch_split, fixed_max_steps

log = logging.getLogger("hpcgpu")

PLAN_VERSION = 1
# ENV_GPU_MEMORY: this rank's GPU memory reading as a size (80G, 40GB, 81559M), in place of the
# device's own: an override for a card that reports more than the job may use, and a test hook
# (on CPU ranks too).
PRECISIONS = ("bf16", "fp16", "fp32")  # the autocast dtype; fp32: no autocast


@dataclass(frozen=True)
class TrainPlan:
    """What `task: train` decided: the batch split, the strategy and the step."""

    global_batch: int
    seq_len: int
    batch_per_rank: int
    micro_batch: int
    accum: int
    strategy: str  # none | ddp | fsdp | deepspeed
    zero_stage: int | None = None  # deepspeed only
    offload_optimizer: bool = False  # deepspeed; fsdp's cpu_offload (both offloads)
    offload_params: bool = False  # deepspeed ZeRO-3; fsdp's cpu_offload
    compile: bool = False  # torch.compile of the DDP step, or of each block under fsdp (DeepSpeed runs eager)
    loader_workers: int = 0
    bytes_per_gpu: int | None = None  # the memory estimate, where GPU memory was gone by
    fits: bool | None = None  # None: not estimated
    max_steps: int = 0  # optimizer steps of the run (0: a plan of an older hpcgpu; filled in on reuse)
    epochs: int | None = None  # train.epochs, where the steps were derived from it
    steps_per_epoch: int | None = None  # sequences // global batch (an epoch's remainder is skipped)
    gradient_checkpointing: bool = False
    fused_loss: bool = False  # train.fused_loss: the loss without logits (runtime/fused_loss.py)
    oom_halvings: int = 0  # times an out-of-memory error in the first step halved the micro batch
    # train.lora: the adapters' settings and the base's identity (runtime/lora.py adapter_settings); None:
    # every weight trains
    adapter: dict[str, Any] | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def how(self) -> str:
        """ddp | none | fsdp (offload) | deepspeed ZeRO-3 offload optimizer."""
        text = self.strategy
        if self.strategy == "fsdp" and self.offload_params:
            text += " offload"
        if self.strategy == "deepspeed":
            text += f" ZeRO-{self.zero_stage}"
            offload = [name for name, on in (("params", self.offload_params), ("optimizer", self.offload_optimizer))
                       if on]
            if offload:
                text += f" offload {'+'.join(offload)}"
        return text


def lora_text(adapter: Mapping[str, Any]) -> str:
    """'LoRA r=16 alpha=32 on all-linear' or 'QLoRA (int4 base) r=16 ...'."""
    q = adapter.get("quantization", "none")
    name = "LoRA" if q == "none" else f"QLoRA ({q} base)"
    targets = adapter["target_modules"]
    return (f"{name} r={adapter['r']} alpha={adapter['alpha']:g} on "
            f"{'every linear layer' if targets == 'auto' else ', '.join(targets)}")


@dataclass(frozen=True)
class InferPlan:
    """What `task: infer` decided: replicas, the batch and what the rows are run with."""

    mode: str  # generate | score
    replicas: int  # data-parallel model copies: one per rank
    gpus_per_replica: int  # GPUs one model copy spans (0 on CPU ranks)
    batch_size: int  # rows per forward; the batches are the same whatever the replica count
    rows: int
    batches: int
    max_tokens: int  # the longest row in tokens (prompt + max_new_tokens; score: the text)
    max_new_tokens: int | None = None  # generate only
    sampling: bool = False  # generate: temperature > 0 (else greedy)
    input_digest: str = ""  # sha256 of the input file: a resume refuses an input that changed since
    bytes_per_row: int | None = None  # the memory estimate of one row, where GPU memory was gone by
    budget_bytes: int | None = None  # the memory the batch was fitted into (smallest over the replicas)
    fits: bool | None = None  # False: not even one row fits the budget (the batch is 1 anyway)
    # the spec's settings each row's output depends on (infer_settings): a resume refuses a change, which
    # would leave outputs.jsonl a mix of two runs; {} in a plan of an older hpcgpu
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    # slots: runtime/slots.py (batch_size is the slot count, batches the queue's chunks); batches: the
    # batch engine (score mode, models the slot engine does not take, and plans of an older hpcgpu)
    engine: str = "batches"

    def how(self) -> str:
        what = self.mode if self.mode == "score" else (
            f"generate ({'sampling' if self.sampling else 'greedy'}, max_new_tokens {self.max_new_tokens})")
        gpus = f" x {self.gpus_per_replica} GPU(s)" if self.gpus_per_replica else " on CPU"
        if self.engine == "slots":
            return (f"{what}, {self.replicas} replica(s){gpus}, {self.batch_size} slots each: {self.rows} rows in "
                    f"{self.batches} chunks")
        return (f"{what}, {self.replicas} replica(s){gpus}, batch {self.batch_size}: {self.rows} rows in "
                f"{self.batches} batches")


@dataclass(frozen=True)
class RunPlan:
    task: str
    world_size: int
    precision: str  # bf16 | fp16 | fp32
    reason: str  # why: for the log and for whoever reads plan.json later
    gpu_memory: int | None = None  # the GPU memory reading it was decided from (smallest over ranks)
    train: TrainPlan | None = None
    infer: InferPlan | None = None
    version: int = PLAN_VERSION
    # task: train resumed at another world size: every width it has run at, in order ([2, 1]); [] if one
    widths: tuple[int, ...] = ()

    @property
    def training(self) -> TrainPlan:
        if self.train is None:
            raise HpcgpuError(f"the run plan is for task: {self.task}, not train")
        return self.train

    @property
    def inference(self) -> InferPlan:
        if self.infer is None:
            raise HpcgpuError(f"the run plan is for task: {self.task}, not infer")
        return self.infer

    def summary(self) -> str:
        parts = [f"{self.world_size} rank(s)", self.precision]
        if self.train is not None:
            t = self.train
            steps = f"{t.max_steps} steps" + (f" ({t.epochs} epochs of {t.steps_per_epoch})" if t.epochs else "")
            parts = [t.how() + (" + gradient checkpointing" if t.gradient_checkpointing else ""),
                     f"global batch {t.global_batch} = micro {t.micro_batch} x accum {t.accum} x "
                     f"{self.world_size} rank(s)", steps, self.precision,
                     "compiled" if t.compile else "not compiled", f"{t.loader_workers} loader workers"] \
                + (["fused loss"] if t.fused_loss else []) + ([lora_text(t.adapter)] if t.adapter else [])
        if self.infer is not None:
            parts = [self.infer.how(), self.precision]
        return ", ".join(parts)

    # -- JSON
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunPlan":
        """The plan of a to_dict() mapping; keys this version does not know are left out."""
        top = _known(cls, data, skip=("train", "infer"))
        if int(top.get("version", 0)) > PLAN_VERSION:
            raise ValueError(f"plan version {top['version']} is newer than this hpcgpu's ({PLAN_VERSION})")
        train, infer = data.get("train"), data.get("infer")
        if "widths" in top:
            top["widths"] = tuple(top["widths"])
        return cls(**top, train=TrainPlan(**_known(TrainPlan, train)) if train is not None else None,
                   infer=InferPlan(**_known(InferPlan, infer)) if infer is not None else None)

    @classmethod
    def from_json(cls, text: str) -> "RunPlan":
        return cls.from_dict(json.loads(text))


def _known(kind: type, data: Mapping[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(kind)} - set(skip)
    return {k: v for k, v in data.items() if k in names}


# ---------------------------------------------------------------- deciding (pure)

def resolve_precision(setting: str, device_type: str, bf16_supported: bool) -> str:
    """train.precision -> the autocast dtype name: auto is bf16 where the GPU supports it, else fp32;
    fp16 autocast on CPU is not useful (fp32)."""
    if setting == "auto":
        return "bf16" if device_type == "cuda" and bf16_supported else "fp32"
    if setting == "fp16" and device_type != "cuda":
        return "fp32"
    return setting


def fixed_strategy(spec: Spec, world: int) -> str | None:
    """The strategy the spec fixes, in plan words for this world size; None for auto."""
    s = spec.distributed.strategy
    if s == "auto":
        return None
    if s == "none" and world > 1:
        raise HpcgpuError(f"distributed.strategy: none cannot run {world} ranks; use ddp")
    if s in ("ddp", "none"):
        return "ddp" if world > 1 else "none"  # a ddp spec scaled down to one GPU: no gradient copy
    return s  # fsdp (at one rank too: its CPU offload serves a lone GPU), deepspeed


def ranks_of_job(spec: Spec, world: int) -> str:
    """Where the job's world size comes from, for the batch error: this job vs the spec's request."""
    asked = spec.world_size
    return f"world size of this job; the spec asks for {asked}" if asked != world else "world size of this job"


def train_steps(spec: Spec, num_sequences: int | None) -> tuple[int, int | None]:
    """(max_steps, steps per epoch): train.max_steps as given, or train.epochs x (sequences // global
    batch), as many global batches as BatchSchedule takes from an epoch before it skips the remainder."""
    t = spec.train
    if t.epochs is None:
        return fixed_max_steps(spec), None
    if num_sequences is None:
        raise ValueError("train_steps: train.epochs needs the training data's sequence count")
    per_epoch = num_sequences // t.global_batch_size
    if per_epoch < 1:
        raise HpcgpuError(f"train.epochs: data.train has {num_sequences} sequences, fewer than one global batch "
                          f"({t.global_batch_size}); use more data or a smaller train.global_batch_size")
    return t.epochs * per_epoch, per_epoch


def plan_train(spec: Spec, world: int, *, device_type: str, gpu_memory: int | None, bf16_supported: bool,
               count_model: Callable[[], tuple[int | None, Any]] | None = None,
               num_sequences: int | None = None, adapter: dict[str, Any] | None = None) -> RunPlan:
    """The plan of a fresh `task: train` job. gpu_memory: the smallest GPU's total bytes over the ranks
    (None on CPU); with it, an `auto` micro batch, strategy or gradient checkpointing comes from the
    memory estimate, for which count_model() gives (parameter count, model config). Without it: the
    CPU rule. num_sequences: data.train's sequence count (needed for train.epochs)."""
    t = spec.train
    ranks = ranks_of_job(spec, world)
    fixed = fixed_strategy(spec, world)
    compiled = compiled_step(spec, on_gpu=device_type == "cuda")
    auto = t.micro_batch_size == "auto" or fixed is None or t.gradient_checkpointing == "auto"
    max_steps, per_epoch = train_steps(spec, num_sequences)
    fused = t.fused_loss
    rec, reason = _recommend(spec, world, device_type, gpu_memory if auto else None, count_model, fixed, compiled)
    if not auto:
        reason = "micro batch and strategy as the spec fixes them"
    strategy = fixed or rec.strategy
    per_rank, accum = batch_split(t.global_batch_size, world, rec.micro_batch, ranks=ranks)
    if strategy == "ddp" and spec.distributed.ddp.static_graph and accum > 1:
        # torch's reducer asserts under no_sync, or, patched, stops reducing (pytorch#143580)
        raise HpcgpuError(f"distributed.ddp.static_graph: true does not work with gradient accumulation "
                          f"(this run accumulates {accum} micro batches); set it to false or give "
                          "train.micro_batch_size = global batch / GPUs")
    stage, off_opt, off_params = zero_settings(spec, strategy, fixed is not None, rec)
    if t.lora is not None and stage == 3:
        raise HpcgpuError("train.lora trains under DDP or DeepSpeed ZeRO-1/2, not ZeRO-3 (the frozen base would be "
                          "partitioned too); set distributed.deepspeed.zero_stage: 2 or distributed.strategy: ddp")
    # QLoRA: a base too big to train in full; its activations are the memory left to save
    qlora_checkpointing = t.lora is not None and spec.model.quantization != "none" \
        and t.gradient_checkpointing == "auto"
    estimated = auto and gpu_memory is not None
    train = TrainPlan(
        global_batch=t.global_batch_size, seq_len=spec.data.seq_len, batch_per_rank=per_rank,
        micro_batch=rec.micro_batch, accum=accum, strategy=strategy, zero_stage=stage,
        offload_optimizer=off_opt, offload_params=off_params, compile=compiled and strategy != "deepspeed",
        loader_workers=rec.workers, bytes_per_gpu=rec.bytes_per_gpu if estimated else None,
        fits=rec.fits if estimated else None, max_steps=max_steps, epochs=t.epochs, steps_per_epoch=per_epoch,
        gradient_checkpointing=rec.checkpointing or qlora_checkpointing, fused_loss=fused, adapter=adapter)
    return RunPlan(task="train", world_size=world, precision=resolve_precision(t.precision, device_type, bf16_supported),
                   reason=reason, gpu_memory=gpu_memory, train=train)


def _recommend(spec: Spec, world: int, device_type: str, gpu_memory: int | None,
               count_model: Callable[[], tuple[int | None, Any]] | None, fixed: str | None,
               compiled: bool) -> tuple[Any, str]:
    """gpu/recommend's choice for this job and why: from the memory estimate where gpu_memory is
    given (an auto setting and a GPU reading), else the CPU rule; train.fused_loss is checked on
    the model it would fuse."""
    ranks = ranks_of_job(spec, world)
    fused = spec.train.fused_loss
    counted = count_model() if count_model is not None and device_type == "cuda" and fused else None
    if fused:
        check_fused_loss(device_type, model_type_of(counted[1]) if counted else None, fixed == "deepspeed")
    if gpu_memory is None:
        rec = recommend_for_job(spec, None, None, None, world, ranks=ranks)  # checks the split too
        return rec, rec.reason
    if count_model is None:
        raise ValueError("plan_train: count_model is needed to fit the model into GPU memory")
    n_params, config = counted or count_model()
    rec = recommend_for_job(spec, n_params, config, gpu_memory, world, compiled=compiled, ranks=ranks,
                            fused_loss=fused)
    if fused and rec.strategy == "deepspeed" and fixed is None:  # the estimate chose DeepSpeed after all
        check_fused_loss(device_type, model_type_of(config), True)
    return rec, rec.reason


def zero_settings(spec: Spec, strategy: str, fixed: bool, rec: Any) -> tuple[int | None, bool, bool]:
    """(ZeRO stage, offload optimizer, offload params) of the plan's strategy: none but for DeepSpeed
    and fsdp (cpu_offload: both); DeepSpeed's as the spec writes them where it fixes DeepSpeed, else
    those the recommendation came with."""
    if strategy == "fsdp":
        off = spec.distributed.fsdp.cpu_offload
        return None, off, off
    if strategy != "deepspeed":
        return None, False, False
    if fixed:
        return spec_deepspeed(spec)
    return rec.zero_stage, rec.offload != "none", rec.offload == "params+optimizer"


def spec_deepspeed(spec: Spec) -> tuple[int, bool, bool]:
    """(ZeRO stage, offload optimizer, offload params) as distributed.deepspeed writes them."""
    ds = spec.distributed.deepspeed
    return ds.zero_stage, ds.offload_optimizer, ds.offload_params


def memory_strategy(t: TrainPlan, spec: Spec) -> Strategy:
    """The memory model's row (gpu/estimate.py) of the plan's strategy, for the out-of-memory errors."""
    return plan_strategy(t.zero_stage, t.offload_optimizer, t.offload_params, t.gradient_checkpointing,
                         fsdp=t.strategy == "fsdp", reshard_after_forward=spec.distributed.fsdp.reshard_after_forward)


def plan_own_loop(spec: Spec | None, world: int, *, device_type: str, bf16_supported: bool) -> RunPlan:
    """The plan of the user's own loop (ctx.prepare, ctx.data_loader): strategy and precision as for
    task: train, and one micro batch of the rank's share per optimizer step (ctx.step steps every
    time). Nothing estimated or compiled: the model is the user's. batch_per_rank 0: no share (no
    spec, or a global batch the ranks cannot split, which only DeepSpeed and a default batch need)."""
    precision = resolve_precision(spec.train.precision if spec is not None else "auto", device_type, bf16_supported)
    strategy = (fixed_strategy(spec, world) if spec is not None else None) or ("ddp" if world > 1 else "none")
    reason, per_rank = "the user's own loop (ctx.prepare)", 0
    if spec is not None:
        try:
            per_rank, _ = batch_split(spec.train.global_batch_size, world, ranks=ranks_of_job(spec, world))
        except HpcgpuError as exc:
            if strategy == "deepspeed":
                raise
            reason += f"; no batch per rank: {exc}"
    stage, off_opt, off_params = (None, False, False) if spec is None else \
        zero_settings(spec, strategy, True, None)
    train = TrainPlan(global_batch=spec.train.global_batch_size if spec is not None else 0, seq_len=0,
                      batch_per_rank=per_rank, micro_batch=per_rank, accum=1, strategy=strategy, zero_stage=stage,
                      offload_optimizer=off_opt, offload_params=off_params)
    return RunPlan(task="callable", world_size=world, precision=precision, reason=reason, train=train)


# model types whose logits are exactly lm_head(base_model(...).last_hidden_state): no logit scaling or
# soft-capping (Gemma 2, Granite, Cohere), no auxiliary loss (mixtures of experts)
FUSABLE_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2")


def model_type_of(config: Any) -> str | None:
    return config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)


def check_fused_loss(device_type: str, model_type: str | None, deepspeed: bool) -> None:
    """train.fused_loss: true can run here, or one clear error. It needs a GPU (Liger's kernels are
    Triton), liger-kernel installed, a head it can fuse, and DDP or one GPU (ZeRO-3 gathers the head's
    weight only inside the head's own forward, which the fused loss skips)."""
    problem = None
    if deepspeed:
        problem = "runs under DDP or on one GPU, not under DeepSpeed"
    elif device_type != "cuda":
        problem = "needs GPU ranks (Liger's kernels are Triton)"
    elif model_type not in FUSABLE_MODEL_TYPES:
        problem = (f"cannot fuse the head of model type {model_type!r} (fusable: {', '.join(FUSABLE_MODEL_TYPES)}: "
                   "a plain linear head, no logit scaling or soft-capping)")
    elif importlib.util.find_spec("liger_kernel") is None:
        problem = "needs liger-kernel (pip install 'hpcgpu[fused]')"
    if problem is not None:
        raise HpcgpuError(f"train.fused_loss: true {problem}; set it to false")


def check_recorded(plan: RunPlan, source: Path, spec: Spec, world: int) -> None:
    """A recorded plan can be reused by this job, or one clear error naming both sides."""
    def refuse(what: str, recorded: Any, now: Any, fix: str) -> HpcgpuError:
        return HpcgpuError(f"the recorded plan ({source}) has {what} {recorded} but {now}; the run must resume "
                           f"as it started: {fix}, or start a fresh run (submit --new)")

    if plan.task != spec.task:
        raise refuse("task:", plan.task, f"the spec says task: {spec.task}", f"use task: {plan.task}")
    if plan.infer is not None:  # the replica count may change: the batches do not depend on it
        _check_recorded_infer(plan.infer, spec, refuse)
        return
    if plan.world_size != world and (plan.train is None or plan.train.strategy == "deepspeed"):
        # DDP's state is the same on every rank and the data position is global: it resumes at any width
        raise refuse("world size", plan.world_size, f"this job has {world} rank(s)",
                     f"give it {plan.world_size} GPUs (resources.nodes x resources.gpus; a DeepSpeed run's "
                     "partitioned checkpoint resumes only at the width it was saved at)")
    if plan.train is None:
        return
    t = plan.train
    if t.global_batch != spec.train.global_batch_size:
        raise refuse("train.global_batch_size", t.global_batch,
                     f"the spec now says {spec.train.global_batch_size}", f"set it back to {t.global_batch}")
    if t.seq_len != spec.data.seq_len:
        raise refuse("data.seq_len", t.seq_len, f"the spec now says {spec.data.seq_len}",
                     f"set it back to {t.seq_len}")
    mb = spec.train.micro_batch_size
    if mb != "auto" and mb != t.micro_batch:
        raise refuse("micro batch", t.micro_batch, f"the spec now fixes train.micro_batch_size: {mb}",
                     f"use {t.micro_batch} or auto")
    _check_recorded_steps(t, spec, refuse)
    gc = spec.train.gradient_checkpointing
    if gc != "auto" and gc != t.gradient_checkpointing:
        raise refuse("train.gradient_checkpointing", str(t.gradient_checkpointing).lower(),
                     f"the spec now fixes {str(gc).lower()}", "use auto or the recorded setting")
    if spec.train.fused_loss != t.fused_loss:  # the micro batch was sized for it
        raise refuse("train.fused_loss", str(t.fused_loss).lower(),
                     f"the spec now says {str(not t.fused_loss).lower()}", "use the recorded setting")
    _check_recorded_strategy(t, spec, world, refuse)


def _check_recorded_strategy(t: TrainPlan, spec: Spec, world: int, refuse: Callable[..., HpcgpuError]) -> None:
    """A strategy the spec now fixes must be the recorded one (DeepSpeed: with its stage and offload;
    fsdp: with its offload)."""
    fixed = fixed_strategy(spec, world)
    if fixed is None:
        return
    stage, off_opt, off_params = zero_settings(spec, fixed, True, None)
    now = dataclasses.replace(t, strategy=fixed, zero_stage=stage, offload_optimizer=off_opt, offload_params=off_params)
    if now.how() != dataclasses.replace(t, strategy=width_strategy(t.strategy, world)).how():
        raise refuse("strategy", t.how(), f"the spec now fixes {now.how()}", f"use distributed.strategy: auto or {t.how()}")


def _check_recorded_steps(t: TrainPlan, spec: Spec, refuse: Callable[..., HpcgpuError]) -> None:
    """The step count is the plan's once decided; a spec that now says another is refused."""
    s = spec.train
    if not t.max_steps:  # a plan of an older hpcgpu: settle_plan fills it in from the spec
        return
    if s.epochs is not None and s.epochs != t.epochs:
        raise refuse("train.epochs", t.epochs, f"the spec now says {s.epochs}", f"set it back to {t.epochs}")
    if s.epochs is None and fixed_max_steps(spec) != t.max_steps:
        raise refuse("max_steps", t.max_steps, f"the spec now says {fixed_max_steps(spec)}",
                     f"set train.max_steps back to {t.max_steps}")


def halved_micro(plan: RunPlan, why: str) -> RunPlan | None:
    """The plan after an out-of-memory error at its micro batch: the largest micro batch that divides
    the batch per rank and is at most half of it, the accumulation making up the global batch; None
    where the micro batch is 1 already."""
    t = plan.training
    smaller = [m for m in range(1, t.micro_batch // 2 + 1) if t.batch_per_rank % m == 0]
    if not smaller:
        return None
    micro = max(smaller)
    train = dataclasses.replace(t, micro_batch=micro, accum=t.batch_per_rank // micro, oom_halvings=t.oom_halvings + 1)
    return dataclasses.replace(plan, train=train,
                               reason=f"{plan.reason}; {why}: micro batch {t.micro_batch} -> {micro}")


def is_oom_successor(newer: RunPlan, older: RunPlan) -> bool:
    """`newer` is `older` after out-of-memory fallbacks (only the micro batch, accumulation and reason
    differ, and it was halved more often): resuming older's checkpoint under it is the same training."""
    if newer.train is None or older.train is None or newer.train.oom_halvings <= older.train.oom_halvings:
        return False
    same = dataclasses.replace(newer.train, micro_batch=older.train.micro_batch, accum=older.train.accum,
                               oom_halvings=older.train.oom_halvings)
    return dataclasses.replace(newer, train=same, reason=older.reason) == older


# ---------------------------------------------------------------- task: infer (pure)

INFER_CPU_BATCH = 8  # rows a batch on CPU ranks (batch_size: auto)
PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DTYPE_OF_PRECISION = {p: d for d, p in PRECISION_OF_DTYPE.items()}


def infer_precision(model_dtype: str, device_type: str, bf16_supported: bool) -> str:
    """model.dtype -> the weights' dtype as plan words: auto is bf16 on a GPU that supports it, else fp32."""
    if model_dtype == "auto":
        return "bf16" if device_type == "cuda" and bf16_supported else "fp32"
    return PRECISION_OF_DTYPE[model_dtype]


def plan_infer(spec: Spec, world: int, *, device_type: str, precision: str, rows: int, max_tokens: int,
               input_digest: str = "", budget_bytes: int | None = None,
               bytes_per_row: int | None = None, engine: str = "batches") -> RunPlan:
    """The plan of a fresh `task: infer` job. budget_bytes: the GPU memory the rows of a batch may use
    on one GPU of a replica (the smallest over the replicas' GPUs; None on CPU), bytes_per_row: one
    row's share of it (gpu/estimate.py rows_room and row_bytes_per_gpu: the memory model
    `hpcgpu estimate` shows).

    batch_size: auto is 8 on CPU; on a GPU gpu/estimate.py auto_infer_batch: the largest power of two
    that fits, capped. engine: slots (batch_size is the slots of each replica) or batches. The outputs
    never depend on the batch, the slots or the replica count."""
    inf = spec.infer
    mode = inf.mode
    fits = None
    if inf.batch_size != "auto":
        batch, reason = int(inf.batch_size), "batch size as the spec fixes it"
    elif budget_bytes is None or not bytes_per_row:
        batch, reason = INFER_CPU_BATCH, f"no GPU memory reading: {INFER_CPU_BATCH} rows a batch"
    else:
        fit = max(0, budget_bytes) // bytes_per_row
        fits = fit >= 1
        batch = auto_infer_batch(fit, mode, rows, engine, world)
        limit = infer_batch_limit(mode, rows, engine, world)[1]
        reason = (f"{fmt_bytes(budget_bytes)} free beside the weights, about {fmt_bytes(bytes_per_row)} a row "
                  f"({max_tokens} tokens at most): {batch} rows a batch (the largest power of two that fits, "
                  f"{limit})")
        if not fits:
            reason = (f"not even one row of {max_tokens} tokens fits the {fmt_bytes(budget_bytes)} free beside the "
                      f"weights (about {fmt_bytes(bytes_per_row)} a row): 1 row a batch; it may run out of memory")
    # the slot engine takes rows from the queue in chunks of a quarter of its slots
    batches = -(-rows // chunk_rows(batch, engine))
    on_gpu = device_type == "cuda"
    infer = InferPlan(mode=mode, replicas=world, gpus_per_replica=spec.gpus_per_task if on_gpu else 0,
                      batch_size=batch, rows=rows, batches=batches, max_tokens=max_tokens,
                      max_new_tokens=inf.max_new_tokens if mode == "generate" else None,
                      sampling=mode == "generate" and inf.temperature > 0, input_digest=input_digest,
                      bytes_per_row=bytes_per_row if budget_bytes is not None else None,
                      budget_bytes=budget_bytes, fits=fits, settings=infer_settings(spec), engine=engine)
    return RunPlan(task="infer", world_size=world, precision=precision, reason=reason, gpu_memory=budget_bytes,
                   infer=infer)


def chunk_rows(batch: int, engine: str) -> int:
    """Rows a replica takes from the queue at a time: a batch, or a quarter of the slots (slots refill
    as rows end; small chunks even out the replicas' ends)."""
    return max(1, batch // 4) if engine == "slots" else batch


def infer_settings(spec: Spec) -> dict[str, Any]:
    """The spec's keys that change a row's output, as plan.json records them: the model and how it is
    loaded, and for sampled generation its draw (greedy ignores top_p, top_k and seed)."""
    m, inf = spec.model, spec.infer
    out: dict[str, Any] = {"model.name_or_path": m.name_or_path, "model.config": m.config, "model.dtype": m.dtype,
                           "model.quantization": m.quantization}
    if inf.mode == "generate":
        out["infer.stop"] = list(inf.stop)
        if inf.temperature > 0:
            out.update({"infer.temperature": inf.temperature, "infer.top_p": inf.top_p, "infer.top_k": inf.top_k,
                        "infer.seed": inf.seed})
    return json.loads(json.dumps(out))  # as plan.json will hold it


def _check_recorded_infer(p: InferPlan, spec: Spec, refuse: Callable[..., HpcgpuError]) -> None:
    inf = spec.infer
    if p.mode != inf.mode:
        raise refuse("infer.mode", p.mode, f"the spec now says {inf.mode}", f"set it back to {p.mode}")
    if inf.batch_size != "auto" and inf.batch_size != p.batch_size:
        raise refuse("batch size", p.batch_size, f"the spec now fixes infer.batch_size: {inf.batch_size}",
                     f"use {p.batch_size} or auto")
    if p.mode == "generate" and p.max_new_tokens != inf.max_new_tokens:
        raise refuse("infer.max_new_tokens", p.max_new_tokens, f"the spec now says {inf.max_new_tokens}",
                     f"set it back to {p.max_new_tokens}")
    if p.mode == "generate" and p.sampling != (inf.temperature > 0):
        was, now = ("sampling", "greedy") if p.sampling else ("greedy", "sampling")
        raise refuse("generation", was, f"the spec's infer.temperature now asks for {now}",
                     "set infer.temperature back")
    now = infer_settings(spec)
    for key, recorded in p.settings.items():
        if now.get(key) != recorded:
            shown = json.dumps(recorded)
            raise refuse(key, shown, f"the spec now says {json.dumps(now.get(key))}", f"set it back to {shown}")


def with_replicas(plan: RunPlan, world: int) -> RunPlan:
    """A recorded infer plan for a job of `world` replicas: only the replica count changes."""
    if plan.infer is None or plan.world_size == world:
        return plan
    return dataclasses.replace(plan, world_size=world, infer=dataclasses.replace(plan.infer, replicas=world))


# ---------------------------------------------------------------- files

def read_plan(path: Path) -> RunPlan:
    try:
        return RunPlan.from_json(path.read_text())
    except (ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
        raise HpcgpuError(f"{path}: not a readable run plan ({exc}); remove it to decide the plan afresh "
                          "(only where no checkpoint depends on it)") from None


def recorded_plan(paths: RunPaths) -> tuple[RunPlan, Path] | None:
    """The plan this run recorded, if any: the newest complete checkpoint's (the state a resume loads
    was trained under it), else `<run dir>/plan.json` (a start that stopped before its first save)."""
    done = complete_checkpoints(paths.checkpoints)
    found = [(read_plan(path), path) for path in ([done[-1] / PLAN_FILE] if done else []) + [paths.plan]
             if path.is_file()]
    if not found:
        return None
    if len(found) == 2 and is_oom_successor(found[1][0], found[0][0]):
        return found[1]  # the micro batch was halved after that checkpoint: do not run out of memory again
    return found[0]


def write_plan(path: Path, plan: RunPlan) -> None:
    """Atomically (a reader never sees half a plan); left alone when it holds this plan already."""
    text = plan.to_json()
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------- in the job

def gpu_memory_reading(device: Any, environ: Mapping[str, str] | None = None) -> int | None:
    """This rank's GPU memory in bytes: HPCGPU_GPU_MEMORY if set, else the device's total; None on CPU."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_GPU_MEMORY)
    if text:
        try:
            return parse_size(text)
        except HpcgpuError:
            raise HpcgpuError(f"{ENV_GPU_MEMORY}={text!r} is not a size like 80G, 40GB or 81559M") from None
    if getattr(device, "type", None) == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


def width_strategy(strategy: str, world: int) -> str:
    """A recorded ddp/none plan's strategy at another world size (one rank needs no gradient copy)."""
    if strategy in ("ddp", "none"):
        return "ddp" if world > 1 else "none"
    return strategy


def at_width(plan: RunPlan, world: int) -> RunPlan:
    """A recorded DDP train plan at another world size: the same global batch (and with it the same data
    position, step count and loss curve), split over `world` ranks at the recorded micro batch, or the
    largest that divides the new share. One line where the global batch does not divide."""
    t = plan.training
    try:
        per_rank, _ = batch_split(t.global_batch, world, None, ranks="world size of this job")
    except SpecError as exc:
        raise HpcgpuError(f"{exc.path}: {exc.message}: the run started at {plan.world_size} rank(s) and goes on only "
                          "at a width that divides its global batch") from None
    micro = max(m for m in range(1, min(t.micro_batch, per_rank) + 1) if per_rank % m == 0)
    train = dataclasses.replace(t, batch_per_rank=per_rank, micro_batch=micro, accum=per_rank // micro,
                                strategy=width_strategy(t.strategy, world))
    widths = tuple(plan.widths) or (plan.world_size,)
    return dataclasses.replace(plan, world_size=world, train=train, widths=widths + (world,))


def check_same_base(plan: RunPlan, source: Path, spec: Spec) -> None:
    """Adapters resume only on the base they were trained on: the recorded identity of the base (a
    folder's config and weight files, or model.config and its seed) must be the base's now."""
    adapter = plan.train.adapter if plan.train is not None else None
    if adapter is None:
        return
    from hpcgpu.runtime.lora import base_identity  # reads the model folder: in the job only

    now = base_identity(spec)
    if now != adapter["base"]:
        was = adapter["base"]
        what = was.get("name_or_path") or "model.config"
        raise HpcgpuError(f"model.name_or_path: the LoRA base {what}: its files changed since the run started "
                          f"(digest {was.get('sha256') or was.get('config_sha256')}, now "
                          f"{now.get('sha256') or now.get('config_sha256')}); adapters resume only on their own "
                          f"base: restore it, or start a fresh run (submit --new); plan {source}")


def settle_plan(spec: Spec, paths: RunPaths, world: int, device: Any, num_sequences: int | None = None) -> RunPlan:
    """The plan of this job, decided once: the recorded one on a resume (checked against this job),
    else a fresh one. Every rank reads the same files and the agreed (smallest) GPU memory, so every
    rank settles on the same plan. Collective where the GPU memory is agreed. num_sequences: the
    training data's sequence count (train.epochs)."""
    recorded = recorded_plan(paths)
    if recorded is not None:
        plan, source = recorded
        check_recorded(plan, source, spec, world)
        check_same_base(plan, source, spec)
        if plan.train is not None and plan.world_size != world:
            before = plan.world_size
            plan = at_width(plan, world)
            log.info(f"the run started at {before} rank(s) and goes on at {world}, the global batch unchanged")
        if plan.train is not None and not plan.train.max_steps:  # recorded by an older hpcgpu
            steps, per_epoch = train_steps(spec, num_sequences)
            plan = dataclasses.replace(plan, train=dataclasses.replace(
                plan.train, max_steps=steps, epochs=spec.train.epochs, steps_per_epoch=per_epoch))
        log.info(f"reusing the recorded plan from {source}: {plan.summary()} (decided at the first start: "
                 f"{plan.reason})")
        return plan
    if spec.task != "train":  # task: infer settles its own (runtime/tasks/infer.py: it needs the model first)
        raise HpcgpuError(f"task: {spec.task} has no run plan in this version")
    # torch (and runtime/dist with it) only here, in the job: the host imports this module for plans
    import torch

    from hpcgpu.runtime.dist import agreed_min

    reading = gpu_memory_reading(device)
    # the smallest card decides: ranks on mixed GPUs must choose the same micro batch and strategy
    agreed = agreed_min(reading, device) if reading is not None else None
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()

    def count_model() -> tuple[int | None, Any]:
        return count_params(spec)  # meta device: no weights

    from hpcgpu.runtime.lora import adapter_settings

    plan = plan_train(spec, world, device_type=device.type, gpu_memory=agreed, bf16_supported=bf16,
                      count_model=count_model, num_sequences=num_sequences, adapter=adapter_settings(spec))
    (log.warning if plan.training.fits is False else log.info)(f"run plan: {plan.summary()}; {plan.reason}")
    return plan
