"""`task: callable`: `entry: pkg.module:function`, called in-process with the context."""
from __future__ import annotations

import importlib

from hpcgpu.contract import RunPaths
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.monitor import GpuMonitor
from hpcgpu.runtime.context import init
from hpcgpu.spec import Spec


def load_entry(entry: str):  # type: ignore[no-untyped-def]
    module_name, _, attr = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise HpcgpuError(f"entry: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise HpcgpuError(f"entry: {module_name} has no function {attr!r}")
    return fn


def run_callable(spec: Spec, paths: RunPaths) -> int:
    fn = load_entry(spec.entry or "")
    with init(spec, paths) as ctx:
        with GpuMonitor(ctx.run_dir, ctx.local_rank, spec.monitor.interval_s, node_rank=ctx.env.node_rank,
                        enabled=spec.monitor.enabled and ctx.device.type == "cuda"):
            result = fn(ctx)
    return result if isinstance(result, int) else 0
