"""How a model is spread over the ranks, shared by `task: train` and `ctx.prepare` (the user's code).

Only what both need lives here, so that the user's code never imports the train task (and with it
transformers and the data pipeline).
"""
from __future__ import annotations

from typing import Any

from hpcgpu.spec import Spec
from hpcgpu.spec.schema import Ddp


def ddp_options(spec: Spec | None) -> dict[str, Any]:
    """torch's DistributedDataParallel arguments from distributed.ddp (torch's defaults without a spec)."""
    d = spec.distributed.ddp if spec is not None else Ddp()
    return {"bucket_cap_mb": d.bucket_cap_mb, "gradient_as_bucket_view": d.gradient_as_bucket_view,
            "static_graph": d.static_graph, "find_unused_parameters": d.find_unused_parameters}
