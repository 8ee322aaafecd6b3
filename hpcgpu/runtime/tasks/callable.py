"""`task: callable`: `entry: pkg.module:function`, called in-process with the context.

The run's lifecycle (runtime/run.py) is init()'s; the function's own loop supplies the stop's hooks
through the user API: ctx.should_stop() at its safe points, ctx.stop(step) to save and leave."""
from __future__ import annotations

import importlib
import sys

from hpcgpu.contract import RunPaths
from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime.code import code_map, mapped_search_path
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
    if (code := code_map(paths)) is not None:  # the entry's module imported from the submit-time copy
        sys.path[:] = mapped_search_path(code, sys.path)
    fn = load_entry(spec.entry or "")
    with init(spec, paths) as ctx, ctx.run.monitor(ctx.device.type == "cuda"):
        result = fn(ctx)
    return result if isinstance(result, int) else 0
