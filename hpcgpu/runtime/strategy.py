"""How a model is spread over the ranks, shared by `task: train` and `ctx.prepare` (the user's code).

Only what both need lives here, so that the user's code never imports the train task (and with it
transformers and the data pipeline).
"""
from __future__ import annotations

from typing import Any

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
