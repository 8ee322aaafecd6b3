"""Where GPU readings come from: the driver (NVML), or a recording named by HPCGPU_NVML_RECORDED.

Kept apart from readings.py (the data) and nvml.py (the driver), which therefore need not import
each other.
"""
from __future__ import annotations

import os

from hpcgpu.gpu.nvml import NvmlSource
from hpcgpu.gpu.readings import RECORDED_ENV, GpuSource, RecordedSource


def default_source() -> GpuSource:
    """The driver, unless HPCGPU_NVML_RECORDED names a recording."""
    recorded = os.environ.get(RECORDED_ENV)
    if recorded:
        return RecordedSource.from_file(recorded)
    return NvmlSource()
