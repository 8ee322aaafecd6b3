"""`task: train`: a Hugging Face causal LM, DDP on GPUs or CPU ranks, logged like nanoGPT.

The global batch (sequences per optimizer step) is fixed by the spec; micro batch x accumulation x
world size always equals it, so a 1-rank and a 2-rank run follow the same loss curve. How it is split,
the strategy, gradient checkpointing, precision, compile and the step count (train.epochs) are the run
plan's (runtime/plan.py), settled once per start and reused on resume: everything here reads the plan.

Out of memory in the first step. The first optimizer step of every start (DDP or one rank; not
DeepSpeed, not DDP static_graph) is guarded: each rank runs forward and backward of all its micro
batches with DDP's gradient all-reduce held back (no_sync), then the ranks agree over the gloo
coordination group whether any of them ran out of memory, and only then reduce the gradients (as DDP
would: divided by the world size, summed) and step. So no rank ever waits in an NCCL collective for a
rank that failed: an in-process retry is safe, with no job restart and no launcher involved. On an
agreed out-of-memory error, with micro_batch_size: auto, every rank halves the micro batch (the
accumulation keeps the global batch), the new plan is written to plan.json (and into the following
checkpoints) and the step is retried on the same sequences with the RNG state it started with; with a
fixed micro batch it is one error line naming the memory estimate (exit 2). Later steps are not
guarded: after the first step every buffer (optimizer states, DDP buckets, compiled graphs) exists,
and the shapes do not change. HPCGPU_OOM_AT_MICRO=N (a test and drill hook, like HPCGPU_SIGNAL_AT)
raises torch.cuda.OutOfMemoryError in the training forward of any micro batch larger than N.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from hpcgpu.contract import RunPaths, folder_written_whole, is_finished
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu import estimate as memory_estimate
from hpcgpu.runtime.collector import StepCollector
from hpcgpu.runtime.context import Context, init
from hpcgpu.runtime.data import (
    Batch, BatchSchedule, Blocks, TokenBlocks, causal_lm_loss, causal_lm_loss_sum, eval_batches, load_blocks,
    load_tokenizer)
from hpcgpu.runtime.dist import Agreed, any_rank, coordination_group, init_process_group
from hpcgpu.runtime.fused_loss import FusedLossLM, liger_sum_loss
from hpcgpu.runtime.metrics import MetricsWriter
from hpcgpu.runtime.lora import add_adapters, prepare_quantized, trainable_count, write_merged
from hpcgpu.runtime.model import build_model, load_quantized
from hpcgpu.runtime.plan import RunPlan, halved_micro, lora_text, memory_strategy, settle_plan, write_plan
from hpcgpu.runtime.profile import StepProfiler
from hpcgpu.runtime.requeue import mark_finished
from hpcgpu.runtime.rng import rng_state, set_rng_state
from hpcgpu.runtime.startup import StartupClock
from hpcgpu.runtime.steplog import StepLog
from hpcgpu.runtime.stop import StopNote, inject_signal
from hpcgpu.runtime.strategies import lone_rank_group, strategy_for
from hpcgpu.runtime.strategies.deepspeed import deepspeed_on_cpu
from hpcgpu.runtime.track import open_tracking
from hpcgpu.runtime.training import Training
from hpcgpu.runtime import watchdog
from hpcgpu.runtime.watchdog import beat
from hpcgpu.spec import Spec

log = logging.getLogger("hpcgpu")

ENV_OOM_AT_MICRO = "HPCGPU_OOM_AT_MICRO"  # drill: a training forward of more sequences runs out of memory


# ---------------------------------------------------------------- data on the device

DEVICE_TOKENS_MAX_BYTES = 1 << 30


def place_tokens(blocks: Blocks, device: torch.device) -> Blocks | torch.Tensor:
    """Keep the token blocks on the GPU (as int64) when they are small: no host-to-device copy in the
    step. Larger sets stay memory-mapped and each batch is read from the file. Example blocks (chat,
    prompt_completion) are assembled per batch on the host."""
    if isinstance(blocks, TokenBlocks) and device.type == "cuda" and blocks.int64_bytes <= DEVICE_TOKENS_MAX_BYTES:
        return blocks.tensor().to(device)
    return blocks


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # from pinned memory: a copy from pageable memory makes the host wait for every kernel queued
    # before it, so the GPU would idle each step while the host queued the next one
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def batch_to(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, dict):  # chat/prompt_completion: input_ids, labels, attention_mask
        return {key: to_device(value, device) for key, value in batch.items()}
    return to_device(batch, device)


def fetch_batch(blocks: Blocks | torch.Tensor, idx: torch.Tensor, device: torch.device) -> Batch:
    if isinstance(blocks, torch.Tensor):  # placed on the GPU: only the indices travel
        return blocks[to_device(idx, device)]
    return batch_to(blocks.take(idx), device)


def batch_fields(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels, attention_mask): a text batch is the ids, which are the labels too."""
    if isinstance(batch, torch.Tensor):
        return batch, batch, None
    return batch["input_ids"], batch["labels"], batch["attention_mask"]


# ---------------------------------------------------------------- model

def logits_loss(compiled: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss from the model's logits (runtime/data.py causal_lm_loss): compiled with the
    step, as a graph of its own. Not the model's own loss (labels= in its forward): compiled into the
    model's graph, that one ran 2% slower (GPT-2 124M, micro 16, one H100: 44.39 vs 43.50 ms/step,
    benchmarks/loop_minimal.py with and without --name-loss)."""
    return torch.compile(causal_lm_loss) if compiled else causal_lm_loss


def model_loss(out: Any, labels: torch.Tensor, loss_of_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               aux_coef: float) -> torch.Tensor:
    """The loss Hugging Face computes when given labels, from a forward without them: the labelled
    tokens' mean cross entropy, plus a mixture-of-experts model's router load-balancing loss times
    config.router_aux_loss_coef where the model returns one (output_router_logits)."""
    loss = loss_of_logits(out.logits, labels)
    aux = getattr(out, "aux_loss", None)
    if aux is not None and aux_coef:
        loss = loss + aux_coef * aux.to(loss.device)
    return loss


def count_params(model: torch.nn.Module) -> int:
    """Parameters, also when ZeRO-3 has partitioned them away (ds_numel is the full size)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def flops_per_token(model: torch.nn.Module, seq_len: int, n: int | None = None) -> float:
    """Training FLOPs per token: 6N plus attention (PaLM appendix B, as nanoGPT counts it)."""
    cfg = getattr(model, "config", None)
    n = count_params(model) if n is None else n
    layers = getattr(cfg, "num_hidden_layers", 0) or 0
    heads = getattr(cfg, "num_attention_heads", 0) or 0
    hidden = getattr(cfg, "hidden_size", 0) or 0
    head_dim = hidden // heads if heads else 0
    return 6 * n + 12 * layers * heads * head_dim * seq_len


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face's per-layer checkpointing, non-reentrant: it works under DDP (also with no_sync
    and unused parameters) and under torch.compile, which the reentrant form does not."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise HpcgpuError(f"train.gradient_checkpointing: the {kind} model of transformers does not support "
                          "gradient checkpointing; set it to false")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "config"):
        model.config.use_cache = False  # a KV cache is useless in training and warns under checkpointing


def oom_drill(limit: int) -> Callable[..., None]:
    """A forward pre-hook for HPCGPU_OOM_AT_MICRO: the training forward of more than `limit` sequences
    raises the error CUDA raises when an allocation fails (evaluation is left alone)."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        batch = kwargs.get("input_ids", args[0] if args else None)
        if module.training and batch is not None and batch.shape[0] > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({ENV_OOM_AT_MICRO}={limit}: a drill)")

    return hook


def lr_lambda(spec: Spec, max_steps: int):  # type: ignore[no-untyped-def]
    t = spec.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, max_steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: torch.nn.Module, spec: Spec, device: torch.device,
                    offload: bool = False) -> torch.optim.Optimizer:
    def ndim(p: torch.Tensor) -> int:
        return len(getattr(p, "ds_shape", p.shape))  # ZeRO-3 leaves empty placeholders in the module

    decay = [p for p in model.parameters() if p.requires_grad and ndim(p) >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and ndim(p) < 2]
    # an empty group (LoRA's adapters are all matrices) is left out: DeepSpeed drops it, and the
    # scheduler made over both groups would then step one group too many
    groups = [g for g in ({"params": decay, "weight_decay": spec.train.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    fused = device.type == "cuda" and not offload  # offloaded optimizer states live on the CPU
    return torch.optim.AdamW(groups, lr=spec.train.lr, betas=(0.9, 0.95), fused=fused)


# ---------------------------------------------------------------- the trainer

@dataclass(frozen=True)
class TrainData:
    """The tokenizer and the seq_len blocks of data.train and data.eval, read before the run plan is
    settled: train.epochs needs the sequence count."""

    tokenizer: Any
    train: Blocks
    eval: Blocks | None


def load_train_data(spec: Spec) -> TrainData:
    d = spec.data
    tokenizer = load_tokenizer(spec.model.name_or_path)
    train = load_blocks(d.train or "", tokenizer, d.seq_len, d.text_field, d.cache_dir, d.format, d.packing)
    evals = load_blocks(d.eval, tokenizer, d.seq_len, d.text_field, d.cache_dir, d.format,
                        d.packing) if d.eval else None
    return TrainData(tokenizer, train, evals)


def seed_rank(seed: int, rank: int) -> None:
    """Dropout (and any other draw of the step) differs by rank, reproducibly."""
    torch.manual_seed(seed + 1 + rank)
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)


class Trainer:
    """The train task on a Training (runtime/training.py: the strategy, precision, optimizer step and
    checkpoint state, as ctx.prepare has them): what only this loop does (the model built from the
    spec, fused and compiled loss, accumulation without gradient reduction, the first step's
    out-of-memory guard), the data schedule, step, tokens and early stopping; Stateful for checkpoints.
    It never asks which strategy runs: the strategy object (runtime/strategies/) answers."""

    def __init__(self, ctx: Context, spec: Spec, plan: RunPlan, data: TrainData):
        self.ctx, self.spec, self.plan = ctx, spec, plan
        p = self.tp = plan.training
        self.world = plan.world_size
        self.device = ctx.device
        self.max_steps = p.max_steps
        self.micro, self.accum = p.micro_batch, p.accum
        self.tokenizer, self.train_blocks, self.eval_blocks = data.tokenizer, data.train, data.eval
        self.schedule = self._schedule()
        self.strategy = strategy_for(plan, spec, self.device)
        self.strategy.before_model()  # ZeRO-3 partitions the model as it is built
        self.raw_model: Any = self._build_model()
        self.train_blocks = place_tokens(self.train_blocks, self.device)
        self.n_params = count_params(self.raw_model)
        self.n_trainable = trainable_count(self.raw_model)
        self.flops_per_token = flops_per_token(self.raw_model, spec.data.seq_len, self.n_params)
        if p.adapter:  # a frozen weight needs no weight gradient: 4N (forward, input gradients) + the adapters'
            self.flops_per_token -= 2 * (self.n_params - self.n_trainable)
        # fsdp: sharded before the optimizer is made, each block compiled where the plan compiles
        self.raw_model = self.strategy.shard(self.raw_model, compile_blocks=p.compile)
        self.training = self._build_training()
        self.optimizer, self.scheduler = self.training.optimizer, self.training.scheduler
        self.cuda_graphs = p.compile and spec.train.compile_mode in ("reduce-overhead", "max-autotune")
        self.logits_loss = logits_loss(p.compile)
        self.aux_loss_coef = float(getattr(self.raw_model.config, "router_aux_loss_coef", 0.0) or 0.0)
        self.model: Any = self.training.wrap(self._loss_model())
        self.step = self.start_step = self.tokens_seen = 0
        self.last_lr = spec.train.lr
        self.early = spec.train.early_stopping
        self.best_eval: float | None = None  # early stopping: the best eval loss so far, its step, and
        self.best_step: int | None = None  # how many evals since then did not improve on it
        self.evals_without_improvement = 0
        # the first step of this start is guarded against running out of memory (module docstring)
        self.guard_next_step = self.strategy.guards_first_step()
        self.on_new_plan: Callable[..., None] | None = None  # records a plan changed in the job (plan_recorder)
        seed_rank(spec.train.seed, ctx.rank)

    def _schedule(self) -> BatchSchedule:
        p = self.tp
        return BatchSchedule(len(self.train_blocks), self.spec.train.seed, self.ctx.rank,
                             global_batch=p.global_batch, per_rank=p.batch_per_rank, micro=p.micro_batch)

    def _build_model(self) -> Any:
        """The model on this rank's device (ZeRO-3 places it itself), checkpointed and drilled as asked."""
        quantized = self.spec.model.quantization != "none"
        if quantized:  # QLoRA: the frozen base in 4/8 bits on this rank's GPU
            model = prepare_quantized(load_quantized(self.spec, self.device, self.plan.precision))
        else:
            model = self.strategy.place(build_model(self.spec, self.spec.train.seed, self.strategy.build_device()))
        if self.tp.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if self.spec.train.lora is not None:
            model = add_adapters(model, self.spec.train.lora, self.spec.train.fused_loss)
        # from_pretrained (model.name_or_path, QLoRA's base) returns a model in eval mode, and peft's
        # PeftModel around it is a new module in training mode: train_step's raw_model.training check would
        # never switch the base's layers, and Hugging Face's layers checkpoint (and drop out) only in training
        model.train()
        self._add_oom_drill(model)
        self._check_vocab(model)
        return model

    def _build_training(self) -> Training:
        offload = self.tp.offload_optimizer  # DeepSpeed's or fsdp's: the optimizer steps on the CPU
        optimizer = build_optimizer(self.raw_model, self.spec, self.device, offload=offload)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.spec, self.max_steps))
        return Training(self.spec, self.plan, self.device, self.raw_model, optimizer, scheduler,
                        strategy=self.strategy, own_loop=True)

    def _loss_model(self) -> torch.nn.Module:
        """What the strategy wraps: the model, with the fused loss around it where asked, compiled where
        planned (DeepSpeed's engine wraps the model as built: the plan allows it neither)."""
        model: torch.nn.Module = self.raw_model
        if self.tp.fused_loss:
            model = FusedLossLM(model, liger_sum_loss())
        if self.tp.compile:
            model = self.strategy.compiled(model, self.spec.train.compile_mode)
        return model

    @staticmethod
    def _add_oom_drill(model: torch.nn.Module) -> None:
        limit = os.environ.get(ENV_OOM_AT_MICRO, "")
        if limit.isdigit():
            model.register_forward_pre_hook(oom_drill(int(limit)), with_kwargs=True)

    def _check_vocab(self, model: Any) -> None:
        vocab = getattr(model.config, "vocab_size", None)
        # the largest id the prepared data holds, from its manifest: the tokens are not scanned
        tops = [b.max_token_id for b in (self.train_blocks, self.eval_blocks) if b is not None]
        top = max((t for t in tops if t is not None), default=-1)
        if vocab is not None and top >= vocab:
            raise HpcgpuError(f"model vocab_size {vocab} is too small for the tokenizer (token id {top}); "
                              "use vocab_size >= 256 for the byte-level tokenizer")

    def use_plan(self, plan: RunPlan) -> None:
        """Take a plan changed in the job (a halved micro batch): the split and the schedule follow it;
        the data position is kept."""
        self.plan, self.tp = plan, plan.training
        self.micro, self.accum = self.tp.micro_batch, self.tp.accum
        position = self.schedule.state_dict()
        self.schedule = self._schedule()
        self.schedule.load_state_dict(position)
        if self.on_new_plan is not None:
            self.on_new_plan(plan)

    # -- Stateful
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "data": self.schedule.state_dict(),
                **self.training.rank_state(),  # scheduler, scaler
                "early_stopping": {"best_eval": self.best_eval, "best_step": self.best_step,
                                   "evals_without_improvement": self.evals_without_improvement}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.schedule.load_state_dict(state["data"])
        self.training.load_rank_state(state)
        early = state.get("early_stopping") or {}  # absent from checkpoints of an older hpcgpu
        self.best_eval, self.best_step = early.get("best_eval"), early.get("best_step")
        self.evals_without_improvement = int(early.get("evals_without_improvement", 0))

    # -- early stopping
    def judge_eval(self, loss: float) -> bool:
        """Count an eval for early stopping; True when it is the best so far (by more than min_delta)."""
        assert self.early is not None
        if self.best_eval is None or loss < self.best_eval - self.early.min_delta:
            self.best_eval, self.best_step, self.evals_without_improvement = loss, self.step, 0
            return True
        self.evals_without_improvement += 1
        return False

    @property
    def patience_spent(self) -> bool:
        return self.early is not None and self.evals_without_improvement >= self.early.patience

    # -- one optimizer step
    def _micro_loss(self, idx: torch.Tensor) -> torch.Tensor:
        ids, labels, mask = batch_fields(fetch_batch(self.train_blocks, idx, self.device))
        with self.training.autocast():
            if self.tp.fused_loss:  # the wrapper returns the loss itself (runtime/fused_loss.py)
                return self.model(ids, labels, mask)
            out = self.model(input_ids=ids, attention_mask=mask)
            return model_loss(out, labels, self.logits_loss, self.aux_loss_coef)

    def _loss_share(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        """A micro batch's loss as its share of the step's mean over `n` (without accumulation there is
        no division by 1 to launch)."""
        loss = self._micro_loss(idx)
        if self.cuda_graphs:  # the graph's output buffer is overwritten by the next micro batch's replay
            loss = loss.clone()
        return loss / n if n > 1 else loss

    def train_step(self) -> torch.Tensor:
        """One optimizer step over the global batch; returns this rank's mean micro-batch loss."""
        if not self.raw_model.training:  # after an eval; not every step: it walks every module
            self.model.train()
        self.last_lr = float(self.scheduler.get_last_lr()[0])  # the lr this step uses, for the log
        micro_batches = self.schedule.next_micro_batches()
        if self.cuda_graphs:  # a new step: the graphs' outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        if self.strategy.accumulates_itself:
            total = self._self_accumulating_step(micro_batches)
        elif self.guard_next_step:
            total = self._guarded_step(torch.cat(micro_batches))
            self.guard_next_step = False
        else:
            total = self._accumulated_step(micro_batches)
        self.step += 1
        self.tokens_seen += self.tp.tokens_per_step
        return total

    def _accumulated_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """The micro batches' gradients summed, reduced over the ranks with the last one, then one step."""
        n = len(micro_batches)
        total: torch.Tensor | None = None  # the first share itself: no zeros to fill and add to
        for i, idx in enumerate(micro_batches):
            sync = contextlib.nullcontext() if i == n - 1 else self.strategy.without_reduction()
            with sync:
                loss = self._loss_share(idx, n)
                self.training.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        self.training.optimizer_step()
        assert total is not None  # a step has at least one micro batch
        return total

    def _guarded_step(self, rows: torch.Tensor) -> torch.Tensor:
        """The first step of a start: forward and backward without communication, an agreed
        out-of-memory flag, then the gradient all-reduce and the optimizer step (module docstring).
        `rows`: this rank's sequences of the global batch, the same on a retry."""
        rng = rng_state(self.device)
        group = coordination_group(self.device)
        while True:
            total, oom = self._local_backward(rows.split(self.micro))
            flags = any_rank([oom and r == self.ctx.rank for r in range(self.world)], group)
            if not any(flags):
                break
            self._after_oom([r for r, f in enumerate(flags) if f])
            set_rng_state(rng, self.device)  # the retry draws what the failed attempt drew
        self.strategy.reduce_gradients(self.training.params, self.world)
        stepped = self._optimizer_step_or_oom()
        failed = any_rank([not stepped and r == self.ctx.rank for r in range(self.world)], group)
        if any(failed):
            raise HpcgpuError(self._states_do_not_fit([r for r, f in enumerate(failed) if f]))
        return total

    def _local_backward(self, micro_batches: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, bool]:
        """Forward and backward of every micro batch with no collective (the gradient reduction held
        back); True on an out-of-memory error (the step's tensors are freed before returning)."""
        total = torch.zeros((), device=self.device)
        try:
            with self.strategy.local_only():
                for idx in micro_batches:
                    loss = self._loss_share(idx, len(micro_batches))
                    self.training.backward(loss)
                    total += loss.detach()
        except torch.cuda.OutOfMemoryError as exc:
            log.warning(f"rank {self.ctx.rank}: out of memory at micro batch {self.micro} in the first step: "
                        f"{str(exc).splitlines()[0][:200]}")
            return total, True  # the traceback and with it the step's activations go with this frame
        return total, False

    def _after_oom(self, ranks: list[int]) -> None:
        """Free what the failed attempt left; with an auto micro batch take the halved plan, else one
        error naming the estimate."""
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        where = f"rank(s) {', '.join(map(str, ranks))}"
        if self.spec.train.micro_batch_size != "auto":
            raise HpcgpuError(f"train.micro_batch_size: {self.micro} does not fit in GPU memory (out of memory "
                              f"in the first step on {where}); {estimate_text(self.spec, self.plan)}; use "
                              "micro_batch_size: auto (halved until it fits), a smaller one, "
                              "train.gradient_checkpointing: true or distributed.strategy: deepspeed")
        why = f"out of memory in the first step on {where}"
        new = halved_micro(self.plan, why)
        if new is None:
            raise HpcgpuError(f"not even micro batch 1 fits in GPU memory ({why}); "
                              f"{estimate_text(self.spec, self.plan)}; use train.gradient_checkpointing: true, "
                              "distributed.strategy: deepspeed (ZeRO, offload) or a smaller data.seq_len")
        old = self.micro
        self.use_plan(new)
        if self.ctx.is_main:
            log.warning(f"{why} at micro batch {old}: micro batch {self.micro} x accum {self.accum} now "
                        f"(global batch {self.tp.global_batch} kept), recorded in plan.json; retrying step "
                        f"{self.step + 1} on the same sequences")

    def _optimizer_step_or_oom(self) -> bool:
        """The first optimizer step creates the optimizer states: False where they do not fit."""
        try:
            self.training.optimizer_step()
        except torch.cuda.OutOfMemoryError:
            return False
        return True

    def _states_do_not_fit(self, ranks: list[int]) -> str:
        return (f"out of memory in the first optimizer step on rank(s) {', '.join(map(str, ranks))}: the model "
                f"states (weights, gradients, optimizer) do not fit; {estimate_text(self.spec, self.plan)}; use "
                "distributed.strategy: deepspeed (ZeRO shards them, offload moves them to host memory)")

    def _self_accumulating_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """DeepSpeed's engine accumulates, reduces, clips and steps (optimizer and scheduler) on the last one.
        Its collectives run inside forward and backward, so an out-of-memory error cannot be agreed on
        first: in the first step it is one error line on the failing rank (the launcher stops the
        others), with an auto micro batch after recording the halved one for the next start."""
        total = torch.zeros((), device=self.device)
        try:
            for idx in micro_batches:
                loss = self._micro_loss(idx)
                self.training.backward(loss)
                self.training.optimizer_step()  # DeepSpeed steps at its accumulation boundary
                total += loss.detach().float() / len(micro_batches)
        except torch.cuda.OutOfMemoryError:
            if self.step != self.start_step:
                raise
            raise HpcgpuError(self._deepspeed_oom_text()) from None
        return total

    def _deepspeed_oom_text(self) -> str:
        what = (f"out of memory in the first step on rank {self.ctx.rank} at micro batch {self.micro} under "
                f"DeepSpeed; {estimate_text(self.spec, self.plan)}")
        new = halved_micro(self.plan, f"out of memory in the first step on rank {self.ctx.rank}") \
            if self.spec.train.micro_batch_size == "auto" else None
        if new is None:
            return what + "; use a smaller train.micro_batch_size or train.gradient_checkpointing: true"
        if self.on_new_plan is not None:
            self.on_new_plan(new, False)  # this rank writes it: rank 0 may be waiting in a collective
        return what + (f"; micro batch {new.training.micro_batch} is recorded in plan.json: run the same command "
                       "again to resume with it")

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """The eval set's mean cross entropy per labelled token, over train.eval_batches global batches
        of it: the same number at every rank count and micro batch (a MoE router's loss left out)."""
        if self.eval_blocks is None:
            return None
        self.model.eval()
        # summed loss and labelled tokens, in float64: one all-reduce, then one division
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        sequences = self.spec.train.eval_batches * self.tp.global_batch
        for batch in eval_batches(self.eval_blocks, self.micro, sequences, self.ctx.rank, self.world):
            beat()
            ids, labels, mask = batch_fields(batch_to(batch, self.device))
            with self.training.autocast():  # the step's forward, uncompiled as the raw model is
                out = self.raw_model(input_ids=ids, attention_mask=mask)
                total, count = causal_lm_loss_sum(out.logits, labels)
            sums += torch.stack([total.double(), count.double()])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        total, count = sums.tolist()
        return total / count if count else None


def estimate_text(spec: Spec, plan: RunPlan) -> str:
    """What `hpcgpu estimate` says of this plan's strategy and micro batch, for the out-of-memory errors."""
    m = memory_estimate
    t = plan.training
    n_params, config = m.count_params(spec)
    d = m.dims_from_config(config, t.seq_len, n_params, t.compile, t.fused_loss)
    st = memory_strategy(t, spec)
    lora = m.spec_lora_dims(spec, config) if spec.train.lora is not None else None  # the adapters' own figures
    e = m.estimate(d, st, t.micro_batch, plan.world_size, lora)
    text = (f"`hpcgpu estimate` puts {st.name} at micro batch {t.micro_batch} at {m.fmt_bytes(e.total)} per GPU "
            f"(activations {m.fmt_bytes(e.activations)})")
    if plan.gpu_memory:
        top = m.max_micro_batch(d, st, plan.world_size, plan.gpu_memory, lora)
        text += f" of {m.fmt_bytes(m.usable_bytes(plan.gpu_memory))} usable, the largest micro batch that fits {top}"
    return text


# ---------------------------------------------------------------- checkpoints

def save_checkpoint(ctx: Context, tr: Trainer, blocking: bool | None = None) -> None:
    tr.training.save(ctx.checkpoint, tr.step, {"trainer": tr.state_dict()},
                   {"tokens": tr.tokens_seen, "restart_count": ctx.env.restart_count}, blocking=blocking)


def resume(ctx: Context, tr: Trainer, metrics: MetricsWriter) -> bool:
    """Load the newest complete checkpoint, if any. Collective."""
    loaded = tr.training.resume(ctx.checkpoint, ctx.rank)
    if loaded is None:
        return False
    path, rank_state = loaded
    tr.load_state_dict(rank_state["trainer"])
    ctx.checkpoint.last_saved_step = tr.step
    metrics.write("resume", step=tr.step, checkpoint=path.name, restart_count=ctx.env.restart_count)
    log.info(f"resuming at step {tr.step} ({tr.tokens_seen:,} tokens seen) from {path.name}")
    return True


# ---------------------------------------------------------------- the loop

def progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)


def describe(tr: Trainer) -> str:
    n, p = tr.n_params, tr.tp
    steps = f"{p.max_steps} steps" + (f" = {p.epochs} epochs x {p.steps_per_epoch}" if p.epochs else "")
    trained = f" ({tr.n_trainable / 1e6:.3f}M trained: {lora_text(p.adapter)})" if p.adapter else ""
    return (f"model {n / 1e6:.2f}M params{trained} on {tr.device} x {tr.world} ({p.strategy}); global batch "
            f"{p.global_batch} = micro {p.micro_batch} x accum {p.accum} x {tr.world} ranks; "
            f"seq_len {p.seq_len}; {tr.plan.precision}; {len(tr.train_blocks)} train sequences; {steps}"
            + ("; gradient checkpointing" if p.gradient_checkpointing else "")
            + ("; fused loss (Liger)" if p.fused_loss else "")
            + tr.strategy.options_note())


def train_loop(ctx: Context, tr: Trainer, metrics: MetricsWriter, clock: StartupClock | None = None) -> str:
    """Run until the plan's max_steps, an agreed stop or early stopping; returns 'finished', 'stopped'
    or 'early_stopped' (a finish too). `clock`: the start-up phases, recorded once the first step is done."""
    loop = StepLoop.open(ctx, tr, metrics, clock)
    crashed = False
    try:
        while tr.step < tr.max_steps:
            outcome = loop.step()
            if outcome is not None:
                return outcome
    except BaseException:
        crashed = True
        ctx.agreement.abandon()
        raise
    finally:
        loop.close(crashed)
    ctx.checkpoint.finish_pending()
    _eval(ctx, tr, metrics)
    return "finished"


@dataclass
class StepLoop:
    """What the train loop runs around each step: the step log, the agreement (the stop and the
    checkpoint flags), the profiler, the garbage collector's schedule and the progress bar."""

    ctx: Context
    tr: Trainer
    metrics: MetricsWriter
    clock: StartupClock | None
    bar: Any
    steplog: StepLog
    profiler: StepProfiler
    collector: StepCollector

    @classmethod
    def open(cls, ctx: Context, tr: Trainer, metrics: MetricsWriter, clock: StartupClock | None) -> "StepLoop":
        bar = progress(tr.max_steps, tr.step, ctx.is_main and sys.stdout.isatty())
        profiler = StepProfiler(tr.spec.train.profile, RunPaths(ctx.run_dir).profile, ctx.rank, ctx.device,
                                first_step=tr.step, max_steps=tr.max_steps)
        collector = StepCollector(tr.spec.train.gc_every)
        collector.start()
        return cls(ctx, tr, metrics, clock, bar, StepLog(tr, metrics, bar), profiler, collector)

    def step(self) -> str | None:
        """One optimizer step and what follows it; 'stopped' or 'early_stopped' to end the loop."""
        ctx, tr, t, ckpt = self.ctx, self.tr, self.tr.spec.train, self.ctx.checkpoint
        loss_t = tr.train_step()
        self.collector.after_step(tr.step)
        if self.clock is not None:
            self.clock.first_step_done(ctx.device, self.metrics, tr.step)
        self.profiler.after_step(tr.step)
        inject_signal(ctx.spec, ctx.rank, tr.step, armed=tr.step != tr.start_step)  # not where it resumed
        # every rank's flags, agreed one step late (runtime/agree.py): nothing here waits for the GPU or
        # for another rank, so the launch queue stays full. At 2 GPUs the loop is nearly host-bound, so
        # any wait would leave the GPU idle until the host got ahead again: a logged step's loss is
        # averaged and copied to the host asynchronously, and written by a later step's poll() once the
        # GPU got there (StepLog); only step 1, the last step, eval and checkpoints wait
        agreed = ctx.agreement.at_step([ckpt.due_by_time(), not ckpt.pending_done()], tr.step)
        stop, time_due, async_busy = agreed.flags
        time_due = time_due and posted_after(agreed, ckpt.last_saved_step)  # else that save reset it
        last = tr.step == tr.max_steps
        if tr.step % t.log_every == 0 or tr.step == 1 or last:
            self.steplog.log(loss_t)
        else:
            self.steplog.poll()  # the logged steps the GPU has finished since
        if self.bar is not None:
            self.bar.update(1)
        if ckpt.pending and not async_busy and posted_after(agreed, ckpt.pending_step):
            with self.steplog.not_step_time():
                ckpt.finish_pending()  # every rank's async write ended: mark it complete now
        return self.after_step(stop, time_due, last)

    def after_step(self, stop: bool, time_due: bool, last: bool) -> str | None:
        """The eval, early stopping, the stop and the checkpoint due after this step."""
        ctx, tr, ckpt, t = self.ctx, self.tr, self.ctx.checkpoint, self.tr.spec.train
        eval_due = bool(t.eval_every) and tr.step % t.eval_every == 0 and not last
        # with early stopping a stop does not skip a due eval: it counts, and the resumed run
        # must judge the evals the uninterrupted one would
        if eval_due and (not stop or tr.early is not None):
            with self.steplog.not_step_time():
                _eval(ctx, tr, self.metrics)
            if tr.patience_spent:  # every rank judged the same all-reduced loss: no vote needed
                ckpt.finish_pending()
                early_stop(tr, self.metrics)
                return "early_stopped"
        if stop:
            self.steplog.flush()  # before the stop's save: a kill in it must not lose the logged steps
            return "stopped"
        if (ckpt.due_by_steps(tr.step) or time_due) and not last:
            with self.steplog.not_step_time():
                save_checkpoint(ctx, tr)
        return None

    def close(self, crashed: bool) -> None:
        # every logged step is written at an end or a stop; after an error another rank may be dead and
        # a pending all-reduce never end: write the complete ones, wait for none
        self.steplog.flush(wait=not crashed)
        self.collector.close()
        self.ctx.agreement.settle()
        self.profiler.close()
        if self.bar is not None:
            self.bar.close()


def posted_after(agreed: Agreed, step: int | None) -> bool:
    """Whether the ranks posted `agreed` after `step` (None: no such step), so that it knows of
    what happened at that step (a save started)."""
    return agreed.step is not None and (step is None or agreed.step > step)


def _eval(ctx: Context, tr: Trainer, metrics: MetricsWriter) -> None:
    """Eval loss, logged; with early stopping it is judged, and a new best is saved to checkpoints/best/."""
    loss = tr.evaluate()
    if loss is None:
        return
    metrics.write("eval", step=tr.step, loss=loss, tokens=tr.tokens_seen)
    log.info(f"step {tr.step:>6} | eval loss {loss:.4f}")
    if tr.early is not None and tr.judge_eval(loss):
        save_best(ctx, tr, loss)


def save_best(ctx: Context, tr: Trainer, loss: float) -> None:
    tr.training.save_best(ctx.checkpoint, {"trainer": tr.state_dict()},
                        {"step": tr.step, "eval_loss": loss, "tokens": tr.tokens_seen})
    log.info(f"step {tr.step:>6} | best eval loss so far: checkpoints/best/")


def early_stop(tr: Trainer, metrics: MetricsWriter) -> None:
    assert tr.early is not None and tr.best_eval is not None
    es = tr.early
    metrics.write("early_stop", step=tr.step, best_step=tr.best_step, best_eval_loss=tr.best_eval,
                  patience=es.patience, min_delta=es.min_delta, max_steps=tr.max_steps)
    log.info(f"early stopping at step {tr.step} of {tr.max_steps}: the eval loss has not improved on "
             f"{tr.best_eval:.4f} (step {tr.best_step}) by more than {es.min_delta:g} in {es.patience} eval(s)")


def restore_best(ctx: Context, tr: Trainer) -> None:
    """With early stopping the final model is the best one: its weights are loaded from checkpoints/best/
    unless the last eval was the best. Collective."""
    if tr.early is None or tr.best_step is None or tr.best_step == tr.step:
        return
    payload = tr.training.payload()
    if ctx.checkpoint.load_best(payload) is None:
        log.warning("checkpoints/best/ could not be loaded: the final model is the last one, not the best")
        return
    tr.training.load_model(payload)
    log.info(f"the final model is the best one: step {tr.best_step}, eval loss {tr.best_eval:.4f}")


def save_final_model(ctx: Context, tr: Trainer) -> Path:
    """A plain Hugging Face model (loads without DeepSpeed), written by rank 0, renamed when complete."""
    out = ctx.run_dir / "model"
    lora = tr.spec.train.lora is not None
    state_dict = tr.strategy.final_state_dict(lora)  # collective where the weights are spread; rank 0 holds them
    if ctx.is_main:
        with folder_written_whole(out) as tmp:
            # with LoRA: the adapter folder (adapter_config.json, adapter_model.safetensors) peft loads on its base
            tr.raw_model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            if hasattr(tr.tokenizer, "save_pretrained"):
                tr.tokenizer.save_pretrained(tmp)
        log.info(f"saved the final {'LoRA adapter' if lora else 'model'} to {out}")
        if lora and tr.spec.train.merge:
            write_merged(tr.spec, tr.raw_model, out, ctx.run_dir / "merged", tr.tokenizer)
            log.info(f"saved the base with the adapter merged in to {ctx.run_dir / 'merged'}")
    ctx.barrier()
    return out


def quiet_libraries(ctx: Context) -> None:
    from transformers.utils import logging as hf_logging  # seconds to import: once the job has started

    if not ctx.is_main:
        hf_logging.set_verbosity_error()  # one copy of library warnings, from rank 0
    hf_logging.disable_progress_bar()
    deepspeed_on_cpu(ctx.device)  # transformers imports DeepSpeed when saving, or it is the strategy


def start_plan(ctx: Context, spec: Spec, paths: RunPaths, data: TrainData) -> RunPlan:
    """Settle the run plan (before the model is built: the strategy decides how it is built and
    wrapped; after the data is read: train.epochs counts its sequences) and give a lone rank the
    group DeepSpeed and fsdp need, now that the plan chose one. A job of several ranks has had its group since
    init(): the group starts exactly once either way."""
    plan = settle_plan(spec, paths, ctx.world_size, ctx.device, num_sequences=len(data.train))
    if lone_rank_group(plan.training.strategy) and not ctx.env.distributed:
        init_process_group(ctx.env, spec, ctx.device, alone=True)
    ctx.plan = plan
    ctx.checkpoint.plan_text = plan.to_json()  # beside spec.yaml in every checkpoint
    return plan


def plan_recorder(ctx: Context, paths: RunPaths, metrics: MetricsWriter) -> Callable[[RunPlan, bool], None]:
    """Records a plan the job changed (a micro batch halved after running out of memory): the context,
    the following checkpoints and plan.json, so that a requeued job starts with it. agreed: every
    rank took it (rank 0 writes plan.json), else only this rank knows it (it writes)."""
    def record(plan: RunPlan, agreed: bool = True) -> None:
        old = ctx.plan.training if ctx.plan is not None and ctx.plan.train is not None else None
        ctx.plan = plan
        ctx.checkpoint.plan_text = plan.to_json()
        t = plan.training
        if ctx.is_main or not agreed:
            write_plan(paths.plan, plan)
        metrics.write("oom", micro_batch=t.micro_batch, accum=t.accum, oom_halvings=t.oom_halvings,
                      previous_micro_batch=old.micro_batch if old else None)

    return record


def record_plan(ctx: Context, plan: RunPlan, paths: RunPaths) -> None:
    """<run dir>/plan.json, by rank 0, before the first step; after a barrier, so that every rank has
    read the recorded plan (or found none) before this one appears."""
    ctx.barrier()
    if ctx.is_main:
        write_plan(paths.plan, plan)


def stop_run(ctx: Context, tr: Trainer, save: bool) -> int:
    """After an agreed stop: the run's one stop (runtime/run.py), with a checkpoint of this step where
    the loop ran (save), and the step and whether its state is saved in the record."""
    how = "with a checkpoint" if save else "before the first step; nothing new to save"
    # saved: the state is a checkpoint's (just written, or resumed from); False only before any
    note = StopNote({"step": tr.step}, f"stopped at step {tr.step} {how}", {"saved": save or tr.step > 0})
    return ctx.run.stop(note, save=(lambda: save_checkpoint(ctx, tr, blocking=True)) if save else None)


def run_train(spec: Spec, paths: RunPaths) -> int:
    clock = StartupClock()
    clock.mark("interpreter and imports")
    with init(spec, paths, alone_group=False) as ctx:  # a lone rank's group waits for the plan
        if is_finished(ctx.run_dir):
            log.info(f"{ctx.run_dir} finished earlier; nothing to do")
            return 0
        plan, data = begin(ctx, spec, paths, clock)
        tracking = open_tracking(spec, paths, ctx.is_main)  # rank 0's TensorBoard / W&B, fed by metrics
        metrics = ctx.run.open_metrics(tracking)  # closed with the run
        tr: Trainer | None = None
        try:
            tr = Trainer(ctx, spec, plan, data)
            start_trainer(ctx, tr, paths, metrics, clock)
            if ctx.should_stop():
                # the signal came while the job was starting: its state is the checkpoint it resumed
                # from (or nothing yet), so nothing is lost by leaving now
                return stop_run(ctx, tr, save=False)
            return train_to_end(ctx, spec, tr, metrics, tracking, clock)
        finally:
            # The DDP reducer must not hold the last reference to the gloo process group when the
            # context destroys it: freed from the reducer, the group's destructor joins its worker
            # threads with the GIL held while a worker may need the GIL to free a finished barrier's
            # tensors (a deadlock seen at exit). Freed here, the group goes through torch's wrapper,
            # which releases the GIL first.
            tr = None
            gc.collect()


def begin(ctx: Context, spec: Spec, paths: RunPaths, clock: StartupClock) -> tuple[RunPlan, TrainData]:
    """The data, then the run plan (train.epochs counts the data's sequences)."""
    clock.mark("process group")
    quiet_libraries(ctx)
    data = load_train_data(spec)
    clock.mark("data")
    plan = start_plan(ctx, spec, paths, data)
    clock.mark("plan")
    return plan, data


def start_trainer(ctx: Context, tr: Trainer, paths: RunPaths, metrics: MetricsWriter, clock: StartupClock) -> None:
    """Resume from the newest checkpoint, if any, and record the plan before the first step."""
    tr.on_new_plan = plan_recorder(ctx, paths, metrics)
    log.info(describe(tr))
    clock.mark("model")
    resume(ctx, tr, metrics)
    tr.start_step = tr.step
    record_plan(ctx, tr.plan, paths)
    clock.mark("resume")


def train_to_end(ctx: Context, spec: Spec, tr: Trainer, metrics: MetricsWriter, tracking: Any,
                 clock: StartupClock) -> int:
    """The loop, then the stop (75), or the best model restored, saved and the run marked finished (0)."""
    tracking.start(tr.start_step)  # plan.json is written; TensorBoard drops steps after the checkpoint
    with ctx.run.monitor(ctx.device.type == "cuda", on_sample=tracking.gpu_sample if tracking.active else None):
        outcome = train_loop(ctx, tr, metrics, clock)
    if outcome == "stopped":
        return stop_run(ctx, tr, save=True)
    restore_best(ctx, tr)
    with watchdog.slow():  # a multi-GB write, no steps
        save_final_model(ctx, tr)
    mark_finished(ctx.run_dir, ctx.env)
    metrics.write("end", step=tr.step, tokens=tr.tokens_seen, max_steps=tr.max_steps,
                  early_stopped=outcome == "early_stopped", best_step=tr.best_step)
    return 0
