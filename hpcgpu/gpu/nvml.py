"""A thin layer over pynvml. "No NVML" (no driver, no GPU) is a normal state, never a crash."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return True
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError: all mean "no GPUs here"
        return False


def gpu_count() -> int:
    if not nvml_available():
        return 0
    import pynvml

    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return 0
