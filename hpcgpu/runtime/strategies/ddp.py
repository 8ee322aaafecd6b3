"""`distributed.strategy: ddp`: torch's DistributedDataParallel with the distributed.ddp options.

`wrap_ddp` is the only DDP construction of hpcgpu; `ddp_options` gives the arguments to the train
task and `ctx.prepare` alike (the user's code never imports the train task).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hpcgpu.runtime.checkpoint import Payload
from hpcgpu.runtime.strategies.base import Strategy
from hpcgpu.spec import Spec
from hpcgpu.spec.schema import Ddp

# a compiled model under DDP is split into one graph per gradient bucket (torch's DDPOptimizer), and each
# graph costs the host its launch every step: at 2 GPUs the 25 MiB default made GPT-2 124M's step
# host-bound (2 x H200: 49.5 ms/step median, 43.7-63.8 over 10-step intervals; 100 MiB: 44.1, 43.1-45.2)
COMPILED_BUCKET_MB = 100.0
TORCH_BUCKET_MB = 25.0


def ddp_options(spec: Spec | None, own_loop: bool = False, compiled: bool = False) -> dict[str, Any]:
    """torch's DistributedDataParallel arguments from distributed.ddp (torch's defaults without a spec).
    own_loop: hpcgpu's train loop drives the model, not the user's code; compiled: the model DDP wraps
    is compiled. Gradients as bucket views save a copy of every gradient per step but break code that
    detaches or replaces a gradient in place, which only hpcgpu's own loop is known not to do. Buckets
    of auto size are 100 MiB around a compiled model (fewer graphs to launch), else torch's 25."""
    d = spec.distributed.ddp if spec is not None else Ddp()
    as_view = own_loop if d.gradient_as_bucket_view == "auto" else d.gradient_as_bucket_view
    bucket = d.bucket_cap_mb
    if bucket == "auto":
        bucket = COMPILED_BUCKET_MB if compiled else TORCH_BUCKET_MB
    return {"bucket_cap_mb": bucket, "gradient_as_bucket_view": as_view,
            "static_graph": d.static_graph, "find_unused_parameters": d.find_unused_parameters}


def describe_ddp(options: dict[str, Any]) -> str:
    """The DDP arguments for a log line: bucket size and the options that are on."""
    flags = [name for name, value in options.items() if value is True]
    return f"buckets {options['bucket_cap_mb']:g} MiB" + "".join(f", {name}" for name in flags)


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


class DDP(Strategy):
    name = "ddp"

    options: dict[str, Any] | None = None  # DDP's arguments, decided at wrap (a compiled model's buckets differ)

    def wrap(self, target: torch.nn.Module) -> Any:
        self.options = ddp_options(self.spec, own_loop=self.own_loop, compiled=is_compiled(target))
        self.model = wrap_ddp(target, self.device, self.options)
        return self.model

    def describe(self) -> str:
        return f"{self.name} ({describe_ddp(self.options)})" if self.options is not None else self.name

    def options_note(self) -> str:
        return f"; DDP {describe_ddp(self.options)}" if self.options is not None else ""

    def guards_first_step(self) -> bool:
        # a static graph's reducer cannot skip an iteration's reduction
        return self.spec is None or not self.spec.distributed.ddp.static_graph

    def without_reduction(self) -> contextlib.AbstractContextManager:
        return self.model.no_sync()

    def local_only(self) -> contextlib.AbstractContextManager:
        # no buffer broadcast in the guarded step's forwards: it is a collective, and a rank that failed
        # before it would leave the others waiting there (the buffers are equal since DDP's start)
        self.model.require_forward_param_sync = False
        return self.model.no_sync()

    def reduce_gradients(self, params: list[torch.nn.Parameter], world: int) -> None:
        """As DDP's reducer does it: each gradient divided by the world size, then summed over the ranks."""
        for param in params:
            if param.grad is not None:
                param.grad.div_(world)
                dist.all_reduce(param.grad)

    def payload(self) -> Payload | dict[str, Any]:
        self.sync_buffers()
        return super().payload()

    def sync_buffers(self) -> None:
        """Collective: rank 0's buffers on every rank. BatchNorm's running statistics differ by rank
        when the batch statistics are not synced (CPU ranks), while DCP writes one copy of a tensor
        every rank holds, from any rank; DDP itself copies rank 0's at the next forward, so rank 0's
        are the ones the run goes on with, and the ones a resume must load."""
        if getattr(self.model, "broadcast_buffers", False):
            for buffer in self.module.buffers():
                dist.broadcast(buffer, src=0)
